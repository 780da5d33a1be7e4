"""A user's own model: `--model FILE.py:FUNCTION`.

The file is the user's code: every rank imports it itself (nothing is
pickled or sent), calls FUNCTION(input_shape, classes) and gets back a list
of layers (hpctrain's, or the user's own classes on the layer contract of
nn/layers.py), or a pair (that list, a loss): the loss the model is trained
and evaluated with (nn/losses.py; softmax cross-entropy over classes when
the function returns layers alone), checked when the spec is made. The file's folder is on the import path while it loads and
builds (a module beside it can be imported). Ranks compare its code (the
file's bytes and the modules imported from beside it: `code_digest`) and
the spec made from the list (run/startup.py), so a file that differs between
nodes is one line too; nn/check.py then runs its layers once.

What goes wrong is one line naming the file and the problem (UserModelError,
exit 2 on the whole job): a missing or unreadable file, no such function,
something that is not a layer list. An exception inside the user's own
code is their bug to fix: the line names it, and `traceback` carries the
user's traceback for the chief to print above it.

    mpirun -n 2 python -m hpctrain.train --model examples/custom_model.py:build --data DIR
"""
import hashlib
import importlib.util
import os
import sys
import traceback as tb

from .layers import Layer
from .losses import Loss


class UserModelError(ValueError):
    """One line; `traceback`: the user's own traceback text, or None."""

    def __init__(self, line, traceback=None):
        super().__init__(line)
        self.traceback = traceback


def split(value):
    """'path/to/file.py:function' -> (path, function)."""
    path, _, function = value.rpartition(":")
    return path, function


def _failed(value, what, error):
    """The one line for an exception the user's code raised (inside the
    except block that caught it: the traceback is the user's). sys.exit
    too: a model file has no business ending the job, least of all with 0."""
    if isinstance(error, SystemExit):
        return UserModelError(f"--model {value}: {what} called sys.exit({error.code!r}): a model file must not "
                              f"end the process", tb.format_exc())
    return UserModelError(f"--model {value}: {what} raised {type(error).__name__}: {error}", tb.format_exc())


def code_digest(path, modules):
    """sha256 of the model file's bytes and of every module imported from its
    folder (or below) while it loaded: what ranks compare, so two copies that
    differ anywhere in the user's code are not taken for one model."""
    home = os.path.dirname(os.path.realpath(path)) + os.sep
    files = {os.path.realpath(path)}
    for module in modules:
        where = getattr(module, "__file__", None)
        where = where and os.path.realpath(where)
        if where and where.startswith(home) and not any(part in where for part in ("site-packages", "dist-packages")):
            files.add(where)
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(os.path.relpath(name, home).encode() + b"\0")
        try:
            with open(name, "rb") as f:
                digest.update(f.read())
        except OSError:
            digest.update(b"(unreadable)")
    return digest.hexdigest()[:16]


def load(value, input_shape, classes):
    """(the layer list FUNCTION(input_shape, classes) returns, checked; its
    loss, or None where it returns layers alone; the digest of its code). The file's folder is on the import path while it
    loads and builds, so it can import modules beside it (a `layers.py`
    next to `model.py`); they are compared across ranks with it."""
    path, function = split(value)
    if not os.path.isfile(path):
        raise UserModelError(f"--model {value}: {path} is not a file")
    name = f"hpctrain_user_model_{abs(hash(os.path.realpath(path)))}"
    folder = os.path.dirname(os.path.realpath(path))
    before = set(sys.modules)
    sys.path.insert(0, folder)
    try:
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module   # dataclasses and pickling-free helpers look themselves up here
            spec.loader.exec_module(module)
        except OSError as e:
            raise UserModelError(f"--model {value}: cannot read {path} ({e.strerror or e})") from None
        except (Exception, SystemExit) as e:
            raise _failed(value, f"importing {path}", e) from None
        make = getattr(module, function, None)
        if not callable(make):
            raise UserModelError(f"--model {value}: {path} defines no function {function!r}")
        try:
            layers = make(tuple(input_shape), int(classes))
        except (Exception, SystemExit) as e:
            raise _failed(value, f"{function}{(tuple(input_shape), int(classes))}", e) from None
    finally:
        if sys.path and sys.path[0] == folder:
            sys.path.pop(0)
    layers, loss = _layers_and_loss(layers)
    if loss is not None and not isinstance(loss, Loss):
        raise UserModelError(f"--model {value}: {function} returned (layers, {type(loss).__name__}): the second "
                             f"item is not a loss (subclass hpctrain.nn.Loss)")
    if not isinstance(layers, (list, tuple)):
        raise UserModelError(f"--model {value}: {function} returned {type(layers).__name__}, not a list of layers")
    if not layers:
        raise UserModelError(f"--model {value}: {function} returned an empty list: a model needs at least one layer")
    for i, layer in enumerate(layers):
        if not isinstance(layer, Layer):
            raise UserModelError(f"--model {value}: {function} returned a list whose item {i} is a "
                                 f"{type(layer).__name__}, not a layer (subclass hpctrain.nn.Layer)")
    new = [sys.modules[key] for key in set(sys.modules) - before if key in sys.modules]
    return list(layers), loss, code_digest(path, new)


def _layers_and_loss(returned):
    """(layers, loss) from what FUNCTION returned: a pair (list, loss) is a
    model with its own loss; anything else is the layers alone (loss None).
    A pair whose second item is neither a layer nor a loss is a wrong loss."""
    if (isinstance(returned, tuple) and len(returned) == 2 and isinstance(returned[0], (list, tuple))
            and not isinstance(returned[1], Layer)):
        return returned
    return returned, None
