"""The models hpctrain knows by name, as layer lists on the layer contract
(nn/layers.py), and the one function that turns a run's flags and data
into a spec.

    mlp:       Flatten, then Dense(w) + ReLU for each --hidden width, then
               Dense(classes): the seed's 784-500-500-10 on MNIST.
    lenet:     LeNet-5-like: conv6 5x5 (same) - pool - conv16 5x5 - pool -
               dense120 - dense84 - dense, for 28x28 images.
    cnn:       Keras' cifar10_cnn: conv32 (same) - conv32 - pool - dropout 0.25 -
               conv64 (same) - conv64 - pool - dropout 0.25 - dense512 -
               dropout 0.5 - dense.
    resnet:    a ResNet-8 (He et al.'s CIFAR ResNet, one block per stage):
               conv16-BN-ReLU, three residual stages of 16, 32, 64 channels
               (the last two halve the image, 1x1 strided projections), global
               average pooling, dense.
    small_cnn: conv32 - pool - conv64 - pool - dense256 - dense (3x3 convolutions,
               padding 1): issue 21's benchmark net.
    gpt:layers=L,heads=H,width=E[,dropout=P][,act=A][,eps=X]: nanoGPT's model
               on text data (nn/gpt.py), its context --block-size tokens, its
               head the vocabulary, scored per token; act=gelu_tanh GPT-2's
               GELU, eps every LayerNorm's epsilon (flags/model_names.py).

Every function takes (input_shape, classes) and sizes itself from the image
shape; each model is scored by the spec's default loss, softmax
cross-entropy over the classes (nn/losses.py); ReLU after every convolution and hidden dense layer. Where a max
pool follows, the ReLU goes after the pool: the same numbers (max and ReLU
commute), on a quarter of the values. Convolutional nets start with
Channels() (the data's images to NHWC, once per batch).
`MODELS` names them.

    python -m hpctrain.nn               # the MLP's spec
"""
from ..flags.model_names import gpt_options, is_model_file
from . import user
from .check import check_layers
from .conv import Channels, Conv2d
from .pool import GlobalAvgPool, MaxPool2d
from .layers import Dropout, Flatten, ReLU
from .linear import Dense
from .batchnorm import BatchNorm2d
from .residual import Residual
from .gpt import gpt
from .spec import ModelSpec

# MNIST's shape: the defaults where no data is at hand (demos, tests, benches).
MNIST_SHAPE = (28, 28)
MNIST_CLASSES = 10


def _dense(widths):
    """Dense layers of these widths, ReLU between them, paired for
    --tensor-parallel (column, then row; an odd last one whole:
    nn/tensor_parallel.py)."""
    layers = []
    for k, width in enumerate(widths):
        pair = k < len(widths) // 2 * 2
        layers += [Dense(width, role=("column", "row")[k % 2] if pair else None), ReLU()]
    return layers[:-1]


def mlp(input_shape=MNIST_SHAPE, classes=MNIST_CLASSES, hidden=(500, 500)):
    return ModelSpec([Flatten(), *_dense([*hidden, classes])], input_shape, classes, name="mlp")


def lenet(input_shape=MNIST_SHAPE, classes=MNIST_CLASSES):
    layers = [Channels(), Conv2d(6, 5, padding=2), MaxPool2d(2), ReLU(), Conv2d(16, 5), MaxPool2d(2), ReLU(),
              Flatten(), *_dense([120, 84, classes])]
    return ModelSpec(layers, input_shape, classes, name="lenet")


def cnn(input_shape=MNIST_SHAPE, classes=MNIST_CLASSES):
    layers = [Channels(),
              Conv2d(32, 3, padding=1), ReLU(), Conv2d(32, 3), MaxPool2d(2), ReLU(), Dropout(0.25),
              Conv2d(64, 3, padding=1), ReLU(), Conv2d(64, 3), MaxPool2d(2), ReLU(), Dropout(0.25),
              Flatten(), Dense(512), ReLU(), Dropout(0.5), Dense(classes)]
    return ModelSpec(layers, input_shape, classes, name="cnn")


def _conv_bn(channels, stride=1):
    return [Conv2d(channels, 3, stride=stride, padding=1, bias=False), BatchNorm2d()]


def _stage(channels, stride):
    block = [*_conv_bn(channels, stride), ReLU(), *_conv_bn(channels)]
    projection = [Conv2d(channels, 1, stride=stride, bias=False), BatchNorm2d()] if stride != 1 else None
    return [Residual(block, projection), ReLU()]


def resnet(input_shape=MNIST_SHAPE, classes=MNIST_CLASSES, width=16):
    layers = [Channels(), *_conv_bn(width), ReLU(),
              *_stage(width, 1), *_stage(2 * width, 2), *_stage(4 * width, 2),
              GlobalAvgPool(), Dense(classes)]
    return ModelSpec(layers, input_shape, classes, name="resnet")


def small_cnn(input_shape=MNIST_SHAPE, classes=MNIST_CLASSES):
    layers = [Channels(), Conv2d(32, 3, padding=1), MaxPool2d(2), ReLU(), Conv2d(64, 3, padding=1), MaxPool2d(2),
              ReLU(), Flatten(), *_dense([256, classes])]
    return ModelSpec(layers, input_shape, classes, name="small_cnn")


# name -> function(input_shape, classes) -> ModelSpec (cli.MODELS lists the same names)
MODELS = {"mlp": mlp, "lenet": lenet, "cnn": cnn, "resnet": resnet, "small_cnn": small_cnn}


def spec_for(args, image_shape, classes, check=True):
    """The spec of the model this run trains (--model), shaped for its data
    (the manifest's image shape and class count). A layer that does not fit
    raises LayerError, one that breaks the contract LayerCodeError, a user's
    file UserModelError. check=False leaves a user's layers unchecked
    (`python -m hpctrain.nn --check` checks them one line each)."""
    name = args.model
    if name == "mlp":
        return mlp(image_shape, classes, args.hidden)
    options = gpt_options(name)
    if options is not None:   # token data: image_shape is (--block-size,), classes the vocabulary
        return gpt(classes, image_shape[0], **options, name=name)
    if is_model_file(name):
        layers, loss, code = user.load(name, image_shape, classes)
        spec = ModelSpec(layers, image_shape, classes, name=name, code=code, loss=loss)
        if check:   # a user's layers, run once: what they can silently get wrong (nn/check.py)
            check_layers(spec)
        return spec
    return MODELS[name](image_shape, classes)
