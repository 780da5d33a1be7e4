"""A tiny convolutional net with every kind of state a model can have
(batch norm's running statistics, dropout's masks), small enough for the
suite: tests/test_models_train.py trains it in ring and ps mode."""
from hpctrain.nn import BatchNorm2d, Channels, Conv2d, Dense, Dropout, Flatten, MaxPool2d, ReLU


def build(input_shape, classes):
    return [Channels(), Conv2d(4, 3, padding=1), BatchNorm2d(), ReLU(), MaxPool2d(2), Dropout(0.25),
            Conv2d(8, 3, stride=2), ReLU(), Flatten(), Dense(32), ReLU(), Dropout(0.5), Dense(classes)]


def without_batch_norm(input_shape, classes):
    """For the averaging invariant (batch statistics differ with the split)."""
    return [Channels(), Conv2d(4, 3, padding=1), ReLU(), MaxPool2d(2), Dropout(0.25),
            Conv2d(8, 3, stride=2), ReLU(), Flatten(), Dense(32), ReLU(), Dropout(0.5), Dense(classes)]
