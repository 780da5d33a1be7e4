"""A user's layers, run once on a small batch when their spec is made: what
their code can silently get wrong is refused with one line naming the layer,
before any rank trains (docs/models.md, "The contract, as it is checked").

A user's layer is trusted to run, not to be right. ModelSpec already checks
what the spec itself reads (output shapes, tensor names and shapes, one
object per place). `check_layers(spec)` then runs every layer by itself, as
training does, on host NumPy in the run's precision (float32) with a batch of a few random
samples, and refuses it when:

- it is written to the layer contract before issue 42 (`forward(x, train)`,
  `backward(dy, need_dx)`, `set_noise(noise)`: activations kept on the
  layer): one line saying what changed, before anything runs;
- `init`, `init_state`, `bind`, `context`, `forward` or `backward` raises (the line
  says which, the user's traceback goes with it), or `init` leaves values
  that are not finite;
- `forward` returns something other than a float32 array of
  (batch, *out_shape) (a float64 output would be upcast silently, 2.5x
  slower, and break the pipeline's bit-identity), or `backward` an input
  gradient other than a float32 array of the input's shape;
- `forward` writes into its input without declaring `inplace = True` (the
  layer before may keep it: a Residual's skip path read it, giving
  2 x f(h)), or returns its input or a view of it without declaring
  `view = True` or `inplace = True` (the runner's in-place rule,
  nn/chain.py, would not know the buffer is shared);
- it declares `keeps_output = False` but its backward reads its forward's
  output after all (an in-place layer after it would then overwrite what it
  reads), or it rebinds its views (`self.grads["W"] = ...` instead of
  writing into them: the gradient would never reach the flat buffer);
- it declares `needs_params_without_dx = False` (Linear's, Conv2d's,
  Embedding's, inherited by a subclass) but its backward without dx reads
  its parameters after all (--zero 3 leaves them ungathered for the
  model's first layer's backward);
- it declares `grads_may_overwrite_params = True` (Linear's, inherited by
  a subclass) but its backward, with its gradient views over its
  parameters, gives other gradients than with them apart (it reads a
  parameter after writing its gradient: --zero 3 binds them so);
- `forward` or `backward` sets or replaces an attribute of the layer (a
  call's activations kept on `self`, not on its ctx: a pipeline stage runs
  several micro-batches through the one layer, and the last forward's would
  reach every backward).

A user's own loss (nn/losses.py) is run once too (`check_loss`), on random
logits of the last layer's output and the integer class targets the
readers give (one a sample for images, one a token for text), and refused when a method raises, when `forward_backward`
writes into the logits or returns other than (a finite scalar, a float32
gradient of the logits' shape), or when `sums` returns other than a dict
with numbers under "loss" and "count".

Layers of hpctrain's own (nn/) are tested against finite differences and
skipped here. What the check does not do: compare a backward against finite
differences (a wrong derivative is the user's bug to find; tests/test_layers.py
shows how).

    python -m hpctrain.nn --model examples/custom_model.py:build    # the summary, after the check
"""
import copy
import inspect
import traceback

import numpy as np

from .layers import Context, Layer, Noise, describe
from .layer_errors import LayerCodeError
from ..base.precision import FLOAT32

# The probe runs a layer in the precision a run takes (hpctrain/base/precision.py):
# parameters in .params, activations and gradients in .compute.
PROBE = FLOAT32
BATCH = 3   # samples per check: more than one (batch norm), few (big layers are cheap to run)


def _ours(layer):
    """hpctrain's own layer class, holding (a container) only layers of its own."""
    return type(layer).__module__.startswith("hpctrain.nn.") and \
        all(_ours(inner) for _, inner in getattr(layer, "inner", ()))


def _views(entries, buffer):
    """{name: view} of `entries` [(name, shape, lo, hi)] over `buffer`, which starts at the first lo."""
    base = entries[0][2] if entries else 0
    return {name.split("/", 1)[1]: buffer[lo - base:hi - base].reshape(shape) for name, shape, lo, hi in entries}


def _size(entries):
    return entries[-1][3] - entries[0][2] if entries else 0


class _Probe:
    """One layer (a deep copy of the spec's) bound to buffers of its own."""

    def __init__(self, spec, i, seed):
        self.i, self.layer = i, copy.deepcopy(spec.layers[i])
        self.name = f"layer {i} ({describe(self.layer)})"
        self.in_shape = spec.input_shape if i == 0 else spec.shapes[i - 1]
        self.out_shape = spec.shapes[i]
        self.batch = max(BATCH, spec.min_batch)
        self.rng = np.random.default_rng(seed)
        tensors, state = spec.layer_tensors[i], spec.layer_state[i]
        self.params, self.grads = np.zeros(_size(tensors), PROBE.params), np.zeros(_size(tensors), PROBE.params)
        self.state = np.zeros(_size(state), PROBE.params)
        self.pv, self.gv, self.sv = _views(tensors, self.params), _views(tensors, self.grads), _views(state, self.state)
        for t in spec.ties:   # a tied tensor (nn/tied.py): buffers of its own here, filled like init's
            if t.user == i:
                shape = tuple(reversed(t.shape)) if t.transposed else t.shape
                self.pv[t.name] = self.rng.standard_normal(shape).astype(PROBE.params)
                self.gv[t.name] = np.zeros(shape, PROBE.params)

    def call(self, what, fn, *args):
        try:
            return fn(*args)
        except (Exception, SystemExit) as e:
            did = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
            raise LayerCodeError(f"{self.name}: {what} {did}", traceback.format_exc()) from None

    def refuse(self, why):
        raise LayerCodeError(f"{self.name}: {why}")

    def start(self):
        layer = self.layer
        self.call("init", layer.init, np.random.default_rng(0), self.pv, PROBE.params)
        bad = [name for name, view in self.pv.items() if not np.isfinite(view).all()]
        if bad:
            self.refuse(f"init left values that are not finite in {', '.join(bad)}")
        self.call("init_state", layer.init_state, self.sv)
        # (dicts of its own: what it does to them is held against ours)
        self.call("bind", layer.bind, np, dict(self.pv), dict(self.gv), dict(self.sv))
        self.ctx = self.call("context", layer.context)
        if not isinstance(self.ctx, Context):
            self.refuse(f"context() returned {type(self.ctx).__name__}, not a Context (leave context() to "
                        f"hpctrain.nn.Layer, or return Context(self.xp))")
        self.attributes = _attributes(layer)

    def kept_nothing(self, what):
        """Refuse a layer whose `what` set or replaced an attribute of its own."""
        changed = sorted(name for name, value in _attributes(self.layer).items()
                         if self.attributes.get(name, _MISSING) is not value)
        if changed:
            self.refuse(f"{what} set self.{changed[0]}: a layer keeps nothing of a call on itself (several "
                        f"micro-batches run through one layer); keep it on the call's context instead "
                        f"(ctx.{changed[0].rsplit('.', 1)[-1].lstrip('_')} = ..., buffers from "
                        f"ctx.buffer(key, shape, dtype))")

    def forward(self, x, train=True):
        self.call("set_noise", self.layer.set_noise, self.ctx, Noise(0, 0, np.arange(self.batch), stream=self.i))
        y = self.call("forward", self.layer.forward, self.ctx, x, train)
        self.kept_nothing("forward")
        want = (self.batch, *self.out_shape)
        if not isinstance(y, np.ndarray) or y.shape != want:
            got = f"shape {'x'.join(map(str, y.shape))}" if isinstance(y, np.ndarray) else type(y).__name__
            self.refuse(f"forward returned {got}, but configure said {'x'.join(map(str, want))} "
                        f"(batch x output shape)")
        if y.dtype != PROBE.compute:
            self.refuse(f"forward returned {y.dtype} for a {PROBE.compute} input: the model trains in {PROBE.compute} "
                        f"(make its arrays with x.dtype, e.g. ctx.buffer(key, shape, x.dtype))")
        return y

    def backward(self, dy):
        dx = self.call("backward", self.layer.backward, self.ctx, dy, True)
        self.kept_nothing("backward")
        want = (self.batch, *self.in_shape)
        if not isinstance(dx, np.ndarray) or dx.shape != want:
            got = f"shape {'x'.join(map(str, dx.shape))}" if isinstance(dx, np.ndarray) else type(dx).__name__
            self.refuse(f"backward returned {got} as the input gradient, the input is "
                        f"{'x'.join(map(str, want))}")
        if dx.dtype != PROBE.compute:
            self.refuse(f"backward returned a {dx.dtype} input gradient for {PROBE.compute} arrays")
        return dx

    def sample(self, shape):
        return self.rng.standard_normal((self.batch, *shape)).astype(PROBE.compute)

    def inputs(self):
        """A batch of the layer's input (token ids where it takes tokens: sample_inputs)."""
        return sample_inputs(self.layer, self.rng, (self.batch, *self.in_shape), PROBE.compute)


def takes_tokens(layer):
    """Whether the layer takes token ids (an Embedding): no gradient reaches them."""
    return getattr(layer, "input_kind", "image") == "tokens"


def sample_inputs(layer, rng, shape, dtype):
    """Random inputs of `shape` for a layer: standard normal values, or
    whole-number ids below its `vocab` (2 without one) where it takes tokens."""
    if takes_tokens(layer):
        return rng.integers(0, int(getattr(layer, "vocab", 2)), shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


_MISSING = object()


def _attributes(layer, prefix=""):
    """The layer's own attributes and its inner layers' (a container's),
    "block1.name" -> object: what a call must leave as it is."""
    out = {f"{prefix}{name}": value for name, value in vars(layer).items()}
    for inner_prefix, inner in getattr(layer, "inner", ()):
        out.update(_attributes(inner, f"{prefix}{inner_prefix}."))
    return out


# The methods whose arguments changed with issue 42: (name, the new arguments after self)
CONTRACT = (("forward", ("ctx", "x", "train")), ("backward", ("ctx", "dy", "need_dx")),
            ("set_noise", ("ctx", "noise")))


def old_contract(layer, where):
    """One line for a layer (or a container's inner layer) whose class
    overrides forward, backward or set_noise with the arguments of the
    contract before issue 42, or None."""
    for name, new in CONTRACT:
        method = getattr(type(layer), name, None)
        if method is None or method is getattr(Layer, name):
            continue
        try:
            positional = [p for p in list(inspect.signature(method).parameters.values())[1:]
                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            continue
        if len(positional) == len(new) - 1:
            return (f"{where} ({describe(layer)}): {name}({', '.join(p.name for p in positional)}) is the layer "
                    f"contract before issue 42: it is now {name}({', '.join(new)}), what backward needs kept on "
                    f"ctx (ctx.x = x), not on self, and buffers from ctx.buffer(key, shape, dtype) (docs/models.md)")
    for prefix, inner in getattr(layer, "inner", ()):
        line = old_contract(inner, f"{where}.{prefix}")
        if line:
            return line
    return None


def _same(a, b):
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


def check_layer(spec, i, seed=0):
    """Run layer i of spec by itself; raise LayerCodeError for what the module docstring lists."""
    line = old_contract(spec.layers[i], f"layer {i}")
    if line:
        raise LayerCodeError(line)
    probe = _Probe(spec, i, seed)
    layer = probe.layer
    probe.start()
    x = probe.inputs()
    dy = probe.sample(probe.out_shape)
    before = x.copy()
    y = probe.forward(x)
    if not layer.inplace and not _same(x, before):
        probe.refuse("forward wrote into its input but the layer does not declare inplace = True (whatever "
                     "still reads that input, such as a Residual's skip path, would see the change): declare "
                     "it, or write into a buffer of its own (ctx.buffer(key, shape, x.dtype))")
    if np.shares_memory(y, x) and not (layer.inplace or layer.view):
        probe.refuse("forward returns its input (or a view of it) but declares neither view = True (a "
                     "reshape) nor inplace = True")
    probe.backward(dy.copy())
    if getattr(layer, "grads", None) is not None and isinstance(layer.grads, dict) and \
            any(layer.grads.get(name) is not view for name, view in probe.gv.items()):
        probe.refuse("its gradient views were replaced (write into self.grads[name][...] in place, never "
                     "assign self.grads[name]): the gradient would not reach the model's buffer")
    if not layer.keeps_output:
        # Says its backward does not read its output: run again with the
        # output scribbled over; the same gradients, or it does read it.
        # (Twice intact first: a layer that draws randomness of its own
        # gives other gradients anyway, and cannot be judged so.)
        runs = []
        for scribble in (False, False, True):
            out = probe.forward(before.copy())
            if scribble:
                out[...] = probe.sample(probe.out_shape)
            d = probe.backward(dy.copy()).copy()
            runs.append((d, probe.grads.copy()))
        repeatable = _same(runs[0][0], runs[1][0]) and _same(runs[0][1], runs[1][1])
        if repeatable and not (_same(runs[2][0], runs[0][0]) and _same(runs[2][1], runs[0][1])):
            probe.refuse("declares keeps_output = False, but its backward reads its forward's output (an in-place "
                         "layer after it would overwrite that): remove the declaration")
    if not layer.needs_params_without_dx and probe.pv:
        # Says its backward without dx reads no parameters (--zero 3 then
        # leaves them ungathered for the model's first layer): run it so
        # with the parameters scribbled over; the same gradients, or it reads them.
        runs = []
        for scribble in (False, False, True):
            probe.forward(before.copy())
            kept = {name: view.copy() for name, view in probe.pv.items()}
            if scribble:
                for view in probe.pv.values():
                    view[...] = probe.rng.standard_normal(view.shape)
            probe.call("backward", layer.backward, probe.ctx, dy.copy(), False)
            for name, view in probe.pv.items():
                view[...] = kept[name]
            runs.append(probe.grads.copy())
        if _same(runs[0], runs[1]) and not _same(runs[2], runs[0]):
            probe.refuse("declares needs_params_without_dx = False, but its backward without dx reads its "
                         "parameters (--zero 3 would not gather them for the model's first layer): declare "
                         "needs_params_without_dx = True")
    if layer.grads_may_overwrite_params and probe.pv and not any(t.user == i for t in spec.ties):
        overwritten(spec, i, seed, before, dy)
    probe.forward(probe.inputs(), train=False)


def overwritten(spec, i, seed, x, dy):
    """A layer that declares grads_may_overwrite_params, run on x and dy
    (need_dx) twice as --zero 3 runs it: with its gradient views apart,
    then over its parameters; refused where they differ (twice apart first:
    a layer that draws randomness of its own cannot be judged so)."""
    runs = []
    for over in (False, False, True):
        probe = _Probe(spec, i, seed)
        if over:
            probe.grads, probe.gv = probe.params, probe.pv
        probe.start()
        probe.forward(x.copy())
        runs.append((probe.backward(dy.copy()).copy(), probe.grads.copy()))
    repeatable = _same(runs[0][0], runs[1][0]) and _same(runs[0][1], runs[1][1])
    if repeatable and not (_same(runs[2][0], runs[0][0]) and _same(runs[2][1], runs[0][1])):
        probe.refuse("declares grads_may_overwrite_params = True, but its backward reads a parameter after writing "
                     "its gradient (--zero 3 writes the gradient over the parameters): compute dx first, or declare "
                     "grads_may_overwrite_params = False")


def check_layers(spec, seed=0):
    """check_layer for every layer of the spec that is not hpctrain's own, then check_loss."""
    for i, layer in enumerate(spec.layers):
        if not _ours(layer):
            check_layer(spec, i, seed)
    check_loss(spec, seed)


def check_loss(spec, seed=0):
    """A user's loss, run once on random float32 logits (BATCH, *last
    output) against integer class targets, one per position of the logits
    but their last axis (an image's one, a text window's one a token);
    hpctrain's own is skipped."""
    loss = spec.loss
    if type(loss).__module__.startswith("hpctrain.nn."):
        return
    rng = np.random.default_rng(seed)
    name = f"the loss ({type(loss).__name__})"
    logits = rng.standard_normal((BATCH, *spec.shapes[-1])).astype(PROBE.compute)
    targets = rng.integers(0, spec.classes, (BATCH, *spec.shapes[-1][:-1]))
    given = logits.copy()

    def call(what, fn, *args):
        try:
            return fn(*args)
        except (Exception, SystemExit) as e:
            raise LayerCodeError(f"{name}: {what} raised {type(e).__name__}: {e}", traceback.format_exc()) from None
    out = call("forward_backward", loss.forward_backward, Context(np), logits, targets)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise LayerCodeError(f"{name}: forward_backward returned {type(out).__name__}, not (loss, dlogits)")
    value, d = out
    if not np.array_equal(logits, given):
        raise LayerCodeError(f"{name}: forward_backward wrote into the logits (the last layer's output, which its "
                             f"backward may read)")
    if np.ndim(value) != 0 or not np.isfinite(float(value)):
        raise LayerCodeError(f"{name}: forward_backward's loss is {value!r}, not a finite scalar")
    if not (isinstance(d, np.ndarray) and d.dtype == PROBE.compute and d.shape == logits.shape):
        got = f"{d.dtype} {d.shape}" if isinstance(d, np.ndarray) else type(d).__name__
        raise LayerCodeError(f"{name}: forward_backward's gradient is {got}, not {PROBE.compute} {logits.shape} "
                             f"(the logits' shape)")
    sums = call("sums", loss.sums, Context(np), logits, targets)
    if not (isinstance(sums, dict) and all(isinstance(sums.get(k), (int, float)) for k in ("loss", "count"))):
        raise LayerCodeError(f"{name}: sums returned {sums!r}, not a dict with numbers under \"loss\" and \"count\"")
