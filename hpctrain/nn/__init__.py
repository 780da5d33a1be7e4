"""The model contract and everything behind it: layers (layers.py: what a
layer must provide), a spec of the model's tensors and buffers (spec.py),
the layer list that runs over them (sequential.py), and the models known
by name (zoo.py). Never imports MPI.

    python -m hpctrain.nn               # the MLP's layers, shapes and buffer layout
"""
from .layers import Dense, Flatten, Layer, LayerError, ReLU
from .spec import ModelSpec
from .zoo import MNIST_CLASSES, MNIST_SHAPE, mlp, spec_for

__all__ = ["Dense", "Flatten", "Layer", "LayerError", "MNIST_CLASSES", "MNIST_SHAPE", "ModelSpec", "ReLU", "mlp",
           "spec_for"]
