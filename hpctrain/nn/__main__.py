"""A model's spec: its layers, output shapes, parameters and buffer layout;
with --check, every layer and the whole model against finite differences.

    python -m hpctrain.nn                                   # the MLP (--hidden 500,500) on 28x28, 10 classes
    python -m hpctrain.nn --model resnet --shape 32,32,3
    python -m hpctrain.nn --model examples/custom_model.py:build --check

--check runs what training's start-up runs on a user's layers (nn/check.py:
shapes, dtypes, in-place writes, views) and then, in float64 on a batch of
3 random samples, each layer's parameter and input gradients and the whole
model's parameter gradient against central differences, one line per
layer: passed, with the largest relative error, or what is wrong and by
how much. Exit 0 when everything passed, 1 when a check failed, 2 for bad
arguments or a model that cannot be built.
"""
import argparse
import sys

import numpy as np

from ..flags.arguments import Parser, positive_ints
from ..base.errors import HpctrainError
from .check import check_layer, sample_inputs, takes_tokens
from .layers import LayerError, Noise, describe
from .layer_errors import LayerCodeError
from .user import UserModelError
from .zoo import MODELS, mlp, spec_for

TOLERANCE = 1e-6   # relative error of a float64 gradient against central differences
BATCH = 3


def _shape(text):
    dims = positive_ints(text, "the image shape")
    if not dims:
        raise argparse.ArgumentTypeError("the image shape is empty")
    return dims


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _model(text):
    from ..flags.cli import MODELS as NAMES, _model as flag
    if text not in NAMES:
        flag(text)   # FILE.py:FUNCTION, as the training flag takes it
    return text


def parser():
    p = Parser(prog="python -m hpctrain.nn", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=_model, default="mlp", metavar="NAME|FILE.py:FUNCTION",
                   help=f"{', '.join(sorted(MODELS))}, or a model file (default: mlp)")
    p.add_argument("--shape", type=_shape, default=(28, 28), help="the image shape, e.g. 32,32,3 (default: 28,28)")
    p.add_argument("--classes", type=_positive, default=10, help="(default: %(default)s)")
    p.add_argument("--hidden", type=lambda t: positive_ints(t, "--hidden"), default=(500, 500),
                   help="the mlp's widths (default: 500,500)")
    p.add_argument("--check", action="store_true", help="every layer and the model against finite differences")
    return p


def build(args):
    """The spec, or one line about why not."""
    try:
        if args.model == "mlp":
            return mlp(args.shape, args.classes, hidden=args.hidden)
        return spec_for(argparse.Namespace(model=args.model, hidden=args.hidden), args.shape, args.classes,
                        check=not args.check)   # --check says what is wrong layer by layer
    except UserModelError as e:
        raise HpctrainError(str(e), detail=e.traceback) from None
    except LayerCodeError as e:
        raise HpctrainError(f"--model {args.model}: {e}", detail=e.traceback) from None
    except LayerError as e:
        raise HpctrainError(f"--model {args.model} on {'x'.join(map(str, args.shape))}, {args.classes} classes: "
                            f"{e}") from None


# --- finite differences --------------------------------------------------------

def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a) + np.linalg.norm(b), 1e-300))


def _float64_layer(spec, i):
    """Layer i alone over float64 buffers of its own: (layer, its context, params, grads)."""
    import copy
    from .check import _views, _size
    layer = copy.deepcopy(spec.layers[i])
    tensors, state = spec.layer_tensors[i], spec.layer_state[i]
    # its tied tensors (nn/tied.py) as tensors of its own after them, checked like them
    at = _size(tensors) + (tensors[0][2] if tensors else 0)
    for t in spec.ties:
        if t.user == i:
            shape = tuple(reversed(t.shape)) if t.transposed else t.shape
            tensors = [*tensors, (f"tied/{t.name}", shape, at, at + t.hi - t.lo)]
            at += t.hi - t.lo
    params, grads = np.zeros(_size(tensors)), np.zeros(_size(tensors))
    states = np.zeros(_size(state))
    layer.init(np.random.default_rng(1), _views(tensors, params), np.float64)
    layer.init_state(_views(state, states))
    layer.bind(np, _views(tensors, params), _views(tensors, grads), _views(state, states))
    return layer, layer.context(), params, grads


def check_gradients(spec, i, rng, picks=24):
    """The largest relative error of layer i's parameter and input gradients
    (loss = sum(y * R), float64) against central differences."""
    layer, ctx, params, grads = _float64_layer(spec, i)
    in_shape = spec.input_shape if i == 0 else spec.shapes[i - 1]
    x = sample_inputs(layer, rng, (BATCH, *in_shape), np.float64)
    r = rng.standard_normal((BATCH, *spec.shapes[i]))
    noise = Noise(0, 0, np.arange(BATCH), stream=i)

    def loss(inputs):
        layer.set_noise(ctx, noise)
        y = layer.forward(ctx, inputs.copy(), True)
        if y.dtype != np.float64:
            raise LayerCodeError(f"forward returned {y.dtype} for a float64 input: it cannot be checked in float64 "
                                 f"(make its arrays with x.dtype)")
        return float((y * r).sum())

    loss(x)
    dx = layer.backward(ctx, r.copy(), True)
    analytic = grads.copy()
    worst = 0.0
    eps = 1e-6
    if params.size:
        ks = rng.choice(params.size, min(picks, params.size), replace=False)
        numeric = []
        for k in ks:
            old = params[k]
            params[k] = old + eps
            up = loss(x)
            params[k] = old - eps
            down = loss(x)
            params[k] = old
            numeric.append((up - down) / (2 * eps))
        worst = max(worst, _rel(analytic[ks], np.array(numeric)))
    if dx is not None and not takes_tokens(layer):   # token ids get no gradient
        flat = x.reshape(-1)
        ks = rng.choice(flat.size, min(picks, flat.size), replace=False)
        numeric = []
        for k in ks:
            old = flat[k]
            flat[k] = old + eps
            up = loss(x)
            flat[k] = old - eps
            down = loss(x)
            flat[k] = old
            numeric.append((up - down) / (2 * eps))
        worst = max(worst, _rel(np.asarray(dx).reshape(-1)[ks], np.array(numeric)))
    return worst


def check_model(spec, rng, picks=32):
    """The whole model's parameter gradient (the model's loss, float64,
    the in-place rule's copies included) against central differences."""
    model = spec.build(dtype=np.float64)
    model.init(1)
    x = sample_inputs(spec.layers[0], rng, (BATCH, *spec.input_shape), np.float64)
    y = rng.integers(0, spec.classes, BATCH)
    noise = (0, 0, np.arange(BATCH))
    model.forward_backward(x.copy(), y, noise=noise)
    analytic = model.grads.copy()
    ks = rng.choice(model.num_params, min(picks, model.num_params), replace=False) if model.num_params else []
    numeric = []
    for k in ks:
        old = model.params[k]
        model.params[k] = old + 1e-6
        up = float(model.forward_backward(x.copy(), y, noise=noise))
        model.params[k] = old - 1e-6
        down = float(model.forward_backward(x.copy(), y, noise=noise))
        model.params[k] = old
        numeric.append((up - down) / 2e-6)
    return _rel(analytic[ks], np.array(numeric)) if len(ks) else 0.0


def check(spec, out=print):
    """One line per layer and one for the model; returns whether all passed."""
    rng = np.random.default_rng(0)
    ok = True
    for i, layer in enumerate(spec.layers):
        name = f"layer {i:>3} {describe(layer):<28}"
        try:
            check_layer(spec, i)
            error = check_gradients(spec, i, rng)
        except LayerCodeError as e:
            out(f"{name} FAILED: {str(e).split(': ', 1)[-1]}")
            ok = False
            continue
        except Exception as e:   # the layer's own code, in float64
            out(f"{name} FAILED: in float64, {type(e).__name__}: {e}")
            ok = False
            continue
        passed = error < TOLERANCE
        ok &= passed
        out(f"{name} {'passed' if passed else 'FAILED'}: gradients within {error:.1e} of finite differences"
            + ("" if passed else f" (more than {TOLERANCE:g}: the backward does not match the forward)"))
    if ok:
        error = check_model(spec, rng)
        passed = error < TOLERANCE
        ok &= passed
        out(f"model {'passed' if passed else 'FAILED'}: its gradient within {error:.1e} of finite differences"
            + ("" if passed else " (each layer passed alone: an in-place write between them?)"))
    return ok


def main(argv=None):
    try:
        args = parser().parse_args(argv)
        spec = build(args)
    except HpctrainError as e:
        if e.detail:
            print(e.detail, end="", file=sys.stderr)
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return e.exit_code
    print("\n".join(spec.summary()))
    for name, lo, hi in spec.tensor_ranges():
        print(f"{name:10s} [{lo:>7}, {hi:>7})  {hi - lo:>7} floats")
    if args.check:
        print(f"check: each layer alone, then the model, in float64 on {BATCH} random samples "
              f"(relative error below {TOLERANCE:g})")
        return 0 if check(spec) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
