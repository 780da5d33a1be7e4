"""The model contract and everything behind it: layers (layers.py: what a
layer must provide), a spec of the model's tensors and buffers (spec.py),
the layer list that runs over them (sequential.py), the loss that scores
its output (losses.py), tensors shared by layers (tied.py), the transformer's
layers (norm.py, gelu.py, linear.py, attention.py, transformer.py) and
nanoGPT's model (gpt.py), and the models known by name (zoo.py). Never imports MPI.

    python -m hpctrain.nn               # the MLP's layers, shapes and buffer layout
"""
from .conv import Channels, Conv2d
from .embedding import Embedding
from .pool import AvgPool2d, GlobalAvgPool, MaxPool2d
from .layers import Context, Dropout, Flatten, Layer, LayerError, Noise, ReLU
from .losses import ClassCrossEntropy, Loss, TokenCrossEntropy
from .attention import CausalSelfAttention
from .gelu import GELU
from .gpt import gpt, gpt_layers
from .linear import Dense, Linear
from .norm import LayerNorm
from .transformer import Block, PositionEmbedding
from .batchnorm import BatchNorm1d, BatchNorm2d
from .residual import Residual
from .spec import ModelSpec
from .zoo import MNIST_CLASSES, MNIST_SHAPE, MODELS, cnn, lenet, mlp, resnet, small_cnn, spec_for

__all__ = ["AvgPool2d", "BatchNorm1d", "BatchNorm2d", "Block", "CausalSelfAttention", "Channels", "ClassCrossEntropy",
           "Conv2d", "Dense", "Dropout", "Embedding", "Flatten", "GELU", "LayerNorm", "Linear", "Loss", "Context",
           "GlobalAvgPool", "Layer", "LayerError", "MNIST_CLASSES", "MNIST_SHAPE", "MODELS", "MaxPool2d", "ModelSpec",
           "Noise", "PositionEmbedding", "ReLU", "Residual", "TokenCrossEntropy", "cnn", "gpt", "gpt_layers", "lenet",
           "mlp", "resnet", "small_cnn", "spec_for"]
