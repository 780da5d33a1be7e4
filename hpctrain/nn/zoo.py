"""The models hpctrain knows by name, as layer lists on the layer contract
(nn/layers.py), and the one function that turns a run's flags and data
into a spec.

    mlp: Flatten, then Dense(w) + ReLU for each --hidden width, then
         Dense(classes): the seed's 784-500-500-10 on MNIST.

    python -m hpctrain.nn               # the MLP's spec
"""
from .layers import Dense, Flatten, ReLU
from . import user
from .spec import ModelSpec

# MNIST's shape: the defaults where no data is at hand (demos, tests, benches).
MNIST_SHAPE = (28, 28)
MNIST_CLASSES = 10


def mlp(input_shape=MNIST_SHAPE, classes=MNIST_CLASSES, hidden=(500, 500)):
    layers = [Flatten()]
    for width in hidden:
        layers += [Dense(width), ReLU()]
    return ModelSpec([*layers, Dense(classes)], input_shape, classes, name="mlp")


def spec_for(args, image_shape, classes):
    """The spec of the model this run trains (--model), shaped for its data
    (the manifest's image shape and class count). A layer that does not fit
    raises LayerError, a user's file UserModelError."""
    name = args.model
    if name == "mlp":
        return mlp(image_shape, classes, args.hidden)
    if ":" in name:
        return ModelSpec(user.load(name, image_shape, classes), image_shape, classes, name=name)
    return MODELS[name](image_shape, classes)


# Every model known by name: f(input_shape, classes) -> ModelSpec (cli.MODELS lists the names).
MODELS = {"mlp": mlp}
