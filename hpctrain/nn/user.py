"""A user's own model: `--model FILE.py:FUNCTION`.

The file is the user's code: every rank imports it itself (nothing is
pickled or sent), calls FUNCTION(input_shape, classes) and gets back a list
of layers (hpctrain's, or the user's own classes on the layer contract of
nn/layers.py). The spec made from that list is compared across ranks
(session.py), so a file that differs between nodes is one line too.

What goes wrong is one line naming the file and the problem (UserModelError,
exit 2 on the whole job): a missing or unreadable file, no such function,
something that is not a layer list. An exception inside the user's own
code is their bug to fix: the line names it, and `traceback` carries the
user's traceback for the chief to print above it.

    mpirun -n 2 python -m hpctrain.train --model examples/small_cnn.py:build --data DIR
"""
import importlib.util
import os
import sys
import traceback as tb

from .layers import Layer


class UserModelError(ValueError):
    """One line; `traceback`: the user's own traceback text, or None."""

    def __init__(self, line, traceback=None):
        super().__init__(line)
        self.traceback = traceback


def split(value):
    """'path/to/file.py:function' -> (path, function)."""
    path, _, function = value.rpartition(":")
    return path, function


def load(value, input_shape, classes):
    """The layer list FUNCTION(input_shape, classes) returns, checked."""
    path, function = split(value)
    if not os.path.isfile(path):
        raise UserModelError(f"--model {value}: {path} is not a file")
    name = f"hpctrain_user_model_{abs(hash(os.path.realpath(path)))}"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module   # dataclasses and pickling-free helpers look themselves up here
        spec.loader.exec_module(module)
    except OSError as e:
        raise UserModelError(f"--model {value}: cannot read {path} ({e.strerror or e})") from None
    except Exception as e:
        raise UserModelError(f"--model {value}: importing {path} raised {type(e).__name__}: {e}",
                             tb.format_exc()) from None
    make = getattr(module, function, None)
    if not callable(make):
        raise UserModelError(f"--model {value}: {path} defines no function {function!r}")
    try:
        layers = make(tuple(input_shape), int(classes))
    except Exception as e:
        raise UserModelError(f"--model {value}: {function}{(tuple(input_shape), int(classes))} raised "
                             f"{type(e).__name__}: {e}", tb.format_exc()) from None
    if not isinstance(layers, (list, tuple)) or not layers:
        raise UserModelError(f"--model {value}: {function} returned {type(layers).__name__}, not a non-empty "
                             f"list of layers")
    for i, layer in enumerate(layers):
        if not isinstance(layer, Layer):
            raise UserModelError(f"--model {value}: {function} returned a list whose item {i} is a "
                                 f"{type(layer).__name__}, not a layer (subclass hpctrain.nn.Layer)")
    return list(layers)
