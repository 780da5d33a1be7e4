"""Layers: what one layer of a model must provide, and the plain layers
(ReLU, Flatten, Dropout; Dense is nn/linear.py's Linear). A model is a list of these (nn/sequential.py
runs it; nn/spec.py lays its parameters into the one flat buffer); the image
layers are in nn/conv.py and nn/pool.py, batch norm in nn/batchnorm.py, the residual container
in nn/residual.py.

The contract, in the order a model uses it (`Layer` below is the base
class; a user's own layer subclasses it and overrides what it needs):

1. `configure(in_shape) -> out_shape`: shapes per sample (no batch axis),
   called once when the spec is made. Raise `LayerError` with one line when
   the input does not fit (attention on a flat input, a pool below 1x1).
2. `param_shapes()`: the trainable tensors, `[(name, shape), ...]`, in the
   order they sit in the flat buffer (`[]` for a layer without parameters:
   ReLU, pooling). Any number, any shapes: not one W and one b.
   `layer.tie(name, owner, tensor, transposed)` makes one of them another
   layer's tensor (an output head reading the embedding's matrix): it then
   takes no room of its own and its gradient is summed (nn/tied.py).
   `state_shapes()`: non-trainable tensors (batch-norm running statistics),
   kept in a buffer of their own, outside the gradient.
   `decays`: the names of its tensors that weight decay applies to (with
   --weight-decay-on matrices, the default): what multiplies its input (a
   weight matrix, a convolution's kernel, an embedding table), not biases,
   norms' gains and shifts or position tables. Default (): none. A
   container's inner layers (`inner`, (prefix, layer) pairs) add theirs as
   `prefix.name`.
3. `init(rng, params, dtype)`: fill this layer's parameters (host NumPy
   views, pre-zeroed) from the NumPy Generator `rng`, drawing in a fixed
   order: the seed alone decides the model. `init_state(state)` sets the
   non-trainable tensors' starting values (running variance 1, ...).
4. `bind(xp, params, grads, state)`: the layer's views (dicts name ->
   array on the model's device), handed out once by the model's parameter
   store (nn/store.py: views of the flat buffers, or of a working buffer a
   store fills). Keep them; write gradients into `grads[...]` in place,
   never rebind. The parameter views hold the parameters during forward and
   backward only (a store may fill them just before and wipe them after):
   read their values there, not at bind time. Parameters, gradients, state
   views and constants (`self.ones(...)`) are all a layer keeps on itself:
   it holds nothing of a call between calls.
5. `context() -> ctx`: a `Context` for one slot of calls (the runner asks
   once per slot: the whole model has one, a pipeline stage one per
   micro-batch in flight, all over the one set of layers). What a forward
   leaves for its backward goes on ctx (`ctx.x = x`), and so do the
   buffers it reuses between calls (`ctx.buffer(key, shape, dtype)`): a
   step allocates nothing once warm. A container returns a Context whose
   `inner` holds its layers' contexts. A container that declares
   `recompute_unit = True` (the transformer's Block) is what --recompute
   recomputes: its forward runs in a context shared by the range's units
   and is run again from its kept input just before its backward
   (nn/sequential.LayerRange), so it must not depend on which context it gets.
6. `forward(ctx, x, train) -> y`: x is (batch, *in_shape). A layer may
   work in place on x when nothing
   else reads x later (ReLU does). Such a layer says so with
   `inplace = True`, and a layer whose output is a view of its input (a
   reshape) with `view = True`. The runner then hands an in-place layer a
   copy of its input wherever something still reads it: the skip path of a
   Residual, or a layer before it (past any views) whose backward reads its
   own output. A layer declares `keeps_output = False` when its backward
   does not read its forward's output (Dense keeps its input, ReLU its
   output); the default, True, is the safe one: an in-place layer after it
   gets a copy. A user's model is checked once when its spec is made
   (nn/check.py): a layer that writes into its input without declaring
   `inplace`, returns a view of it without declaring `view`, says
   `keeps_output = False` and reads it after all, or keeps anything of a
   call on itself, is refused with one line; so is a layer still written to
   the contract before issue 42 (`forward(x, train)`).
   Before each training forward the runner calls
   `set_noise(ctx, noise)`: `noise` is a `Noise(seed, step, sample_ids, stream)`
   or None, kept on ctx (`ctx.noise`, the default); a layer that draws
   randomness (Dropout) derives every sample's draws from (seed, step,
   that sample's id, stream) alone, so the batch split over ranks does not
   change them, and a recomputed forward draws the same.
7. `backward(ctx, dy, need_dx) -> dx`: the slot's ctx, as its forward left
   it. Write this layer's parameter gradients
   (the gradient of the batch-mean loss; the head divides by the batch);
   return the input gradient, or None when need_dx is False (no layer
   before it has parameters: the first Dense skips its largest matmul).
8. `train_floats()`: floats per sample this layer keeps for a training step
   (its outputs, its input gradient, its scratch such as im2col columns),
   and `flops()`: multiply-adds per
   sample of its forward pass; the memory check and the pipeline's stage
   balance read these. `describe()`: one short line for the model summary.
9. What it is, declared as class attributes a subclass inherits
   (`elementwise`, `tokenwise`, `kernel`, `draws_noise`, `role`: `Layer`).

Everything runs on NumPy or CuPy (`xp`) with the same code.

    python -m hpctrain.nn               # the MLP's layers, shapes and buffer layout
"""
import math
from typing import NamedTuple

import numpy as np

from . import compiled, passes, threads
from ..base.precision import draw_dtype
from .layer_errors import LayerError


def describe(layer):
    """layer.describe(), or its class name where a user's describe() fails."""
    try:
        text = layer.describe()
        return text if isinstance(text, str) else type(layer).__name__
    except Exception:
        return type(layer).__name__


class Noise(NamedTuple):
    """What a layer that draws randomness gets before a training forward:
    the run's seed, the global step, one id per row of the batch (the
    sample's position in the epoch, a 1-D integer array) and a stream number
    telling two such layers of one model apart (the model sets it)."""
    seed: int
    step: int
    sample_ids: object
    stream: int = 0


class Context:
    """One slot of a layer's calls: what its forward leaves for its
    backward (attributes the layer sets: `ctx.x = x`), the buffers it reuses
    between calls of the slot (`buffer`, `zeroed`), the noise of the slot's
    training forward (`noise`) and, for a container, its layers' contexts
    (`inner`). Owned by the runner (nn/sequential.LayerRange), not the layer."""

    def __init__(self, xp, inner=()):
        self.xp, self.noise, self.inner = xp, None, list(inner)
        self._buffers = {}

    def buffer(self, key, shape, dtype):
        """An array of `shape` kept under `key` for the next call of the same shape."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self._buffers[key] = self.xp.empty(shape, dtype)
        return buf

    def zeroed(self, key, shape, dtype):
        """Like buffer, zero-filled when made (borders that no call writes stay 0)."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self._buffers[key] = self.xp.zeros(shape, dtype)
        return buf

    def held_bytes(self):
        """Bytes of the buffers this slot holds, inner contexts' included."""
        return sum(buf.nbytes for buf in self._buffers.values()) + sum(c.held_bytes() for c in self.inner)


class Layer:
    """The base of every layer: no parameters, no state, identity shapes."""
    inplace = False       # forward overwrites its input
    view = False          # forward returns a view of its input (a reshape)
    keeps_output = True   # backward reads forward's output: an in-place layer after it gets a copy
    # backward(need_dx=False), the model's first layer's, reads its parameters: False where only its input and
    # dy make its gradient (Linear, Conv2d, Embedding), so --zero 3 need not gather them again for it
    # (nn/sharded_store.py); the default, True, is the safe one
    needs_params_without_dx = True
    # backward reads each of its parameters only before it writes that parameter's gradient (Linear: W for dx,
    # dx first): its gradient may then be bound over its parameters, --zero 3's one slot a bucket for both
    # (nn/sharded_store.py), and where it is (a parameter and its gradient share memory) its backward keeps that
    # order; the default, False, is the safe one
    grads_may_overwrite_params = False
    min_batch = 1         # the smallest batch a training forward makes sense of (BatchNorm1d: 2)
    input_kind = "image"  # what it takes as a model's first layer (nn/spec.INPUT_KINDS): the reader must give it
    ties = ()             # (name, owner layer, its tensor, transposed): tensors read from another layer (tie)
    # its path in the model (`blocks.0`), given where the model is built (named): its tensors are PATH/tensor in
    # checkpoints and --save files; None: `layer{k}`, k counting the layers with tensors (nn/spec.py)
    model_path = None
    recompute_unit = False  # --recompute drops its activations after forward and recomputes them in backward
    decays = ()           # its tensors weight decay applies to (--weight-decay-on matrices): what multiplies
    # What it is, declared here and inherited by a subclass (a user's `class MyReLU(ReLU)` is a ReLU to all
    # of these):
    elementwise = False   # works on each element alone: a column-parallel slice passes through as it is
    tokenwise = False     # works on each position alone: decoded by its own forward (nn/decode.py)
    kernel = None         # the nn/compiled.py kernel it runs with compiled layers on (nn/kernels_used.py)
    draws_noise = False   # its training forward needs the batch's noise (Dropout)
    # --tensor-parallel (nn/tensor_parallel.py): how it splits over a tensor group, declared where it is
    # built (Linear's "column", "row", "vocab"; the embedding's "vocab"; attention's heads); None: whole
    role = None
    group = None          # the TensorGroup it is a slice of (join), None: whole

    def configure(self, in_shape):
        self.in_shape = tuple(in_shape)
        self.out_shape = self.in_shape
        return self.out_shape

    def param_shapes(self):
        return []

    def state_shapes(self):
        return []

    def init(self, rng, params, dtype):
        pass

    def init_state(self, state):
        """Fill the non-trainable tensors' starting values (views on the model's device)."""

    def join(self, group):
        """--tensor-parallel: become rank group.rank's slice of this layer
        (by its `role`; with --sequence-parallel a layer between a GPT's
        embedding and head, its positions). The spec calls it once, on its
        own copy of the layer, before configure (nn/tensor_split.py)."""
        self.group = group

    def bind(self, xp, params, grads, state):
        self.xp, self.params, self.grads, self.state = xp, params, grads, state
        self._constants = {}

    def tie(self, name, owner, tensor, transposed=False):
        """Use `owner`'s tensor `tensor` (transposed=True: its 2-D transpose)
        as this layer's tensor `name`: one tensor of the model, read by both
        (nn/tied.py), e.g. `Dense(vocab).tie("W", embedding, "E",
        transposed=True)`. Returns the layer. Checked when the spec is made."""
        self.ties = (*self.ties, (name, owner, tensor, bool(transposed)))
        return self

    def named(self, path):
        """Call this layer `path` in the model (`blocks.0`, `embedding`),
        where the model is built (nn/gpt.py): its tensors are then named
        `path/tensor`. Returns the layer."""
        self.model_path = path
        return self

    def context(self):
        """A Context for one slot of calls (after bind)."""
        return Context(self.xp)

    def ones(self, n, dtype):
        """A vector of n ones, kept on the layer (a constant, the same for
        every slot): per-channel sums as GEMVs (ones @ x), several times
        faster than x.sum(axis=0) over few channels."""
        ones = self._constants.get("ones")
        if ones is None or ones.shape != (n,) or ones.dtype != dtype:
            ones = self._constants["ones"] = self.xp.ones(n, dtype)
        return ones

    def scratch_floats(self):
        """Floats this layer keeps per compute thread whatever the batch (a
        convolution's block of columns): the memory check counts them once
        per thread (nn/spec.py memory_bytes)."""
        return 0

    def in_parallel(self, n, work, unit=1, floats=None, macs=None):
        """work(thread, lo, hi) over rows [lo, hi) of n, on the rank's compute
        threads (nn/threads.py) when the arrays are NumPy's, in at most
        threads.most(floats, macs) parts where either is given (what the
        work is worth: `floats` elementwise, `macs` multiply-adds). Each
        range's result must not depend on the others (elementwise work, or
        its own rows or columns of a product), so the bits do not depend on
        the threads."""
        threads.split(n, work, unit, floats, macs, on=self.xp is np)

    def pair(self, first, second):
        """first() and second() at once on a two-thread rank (nn/threads.py pair)."""
        threads.pair(first, second, on=self.xp is np)

    def set_noise(self, ctx, noise):
        """Randomness for the slot's next training forward (Noise or None), kept on ctx."""
        ctx.noise = noise

    def forward(self, ctx, x, train):
        return x

    def backward(self, ctx, dy, need_dx):
        return dy if need_dx else None

    def train_floats(self):
        return 0

    def flops(self):
        return 0

    def describe(self):
        return type(self).__name__


def he_normal(rng, shape, fan_in, dtype):
    """He/Kaiming normal for ReLU nets: N(0, 2/fan_in), drawn from `rng` in
    C order of `shape`. One layer at a time, in the buffer's dtype: no
    model-sized temporaries."""
    w = rng.standard_normal(math.prod(shape), dtype=draw_dtype(dtype))
    w *= np.sqrt(2.0 / fan_in)
    return w.astype(dtype, copy=False).reshape(shape)


class Flatten(Layer):
    """(batch, *shape) -> (batch, prod(shape)): a view, no copy."""
    view = True

    def configure(self, in_shape):
        super().configure(in_shape)
        self.out_shape = (math.prod(self.in_shape),)
        return self.out_shape

    def forward(self, ctx, x, train):
        return x.reshape(x.shape[0], -1)

    def backward(self, ctx, dy, need_dx):
        return dy.reshape(dy.shape[0], *self.in_shape) if need_dx else None


class ReLU(Layer):
    """max(x, 0), in place on its input: the layer before keeps its own input,
    so nothing reads x after this (a container that does, copies first)."""
    inplace = True
    elementwise = True
    kernel = "relu"

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)
        # Compiled layers on: the gradient in one pass, the same bits (nn/passes.py).
        self.compiled = compiled.on() and xp is np
        if self.compiled:
            passes.prepare(("relu_backward",))

    def forward(self, ctx, x, train):
        self.in_parallel(x.shape[0], lambda t, lo, hi: self.xp.maximum(x[lo:hi], 0, out=x[lo:hi]),
                         floats=x.size)
        ctx.y = x
        return x

    def backward(self, ctx, dy, need_dx):
        # pass the gradient where the unit was active (the mask's buffer kept:
        # a warm step allocates nothing)
        if self.compiled and dy.flags.c_contiguous and ctx.y.flags.c_contiguous:
            y, flat = ctx.y.reshape(len(dy), -1), dy.reshape(len(dy), -1)
            self.in_parallel(len(dy), lambda t, lo, hi: passes.relu_backward(y[lo:hi].reshape(-1),
                                                                               flat[lo:hi].reshape(-1)),
                             floats=dy.size)
            return dy
        active = ctx.buffer("active", dy.shape, bool)

        def rows(t, lo, hi):
            self.xp.greater(ctx.y[lo:hi], 0, out=active[lo:hi])
            self.xp.multiply(dy[lo:hi], active[lo:hi], out=dy[lo:hi])
        self.in_parallel(dy.shape[0], rows, floats=dy.size)
        return dy


# splitmix64's constants: a counter-based generator, the same bits on NumPy and CuPy
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix(xp, h, tmp):
    """splitmix64's finaliser on the uint64 array h, in place (tmp: scratch of h's shape)."""
    for shift, mult in ((30, _MIX1), (27, _MIX2)):
        xp.right_shift(h, np.uint64(shift), out=tmp)
        xp.bitwise_xor(h, tmp, out=h)
        xp.multiply(h, mult, out=h)
    xp.right_shift(h, np.uint64(31), out=tmp)
    xp.bitwise_xor(h, tmp, out=h)
    return h


def _mix_host(*words):
    """splitmix64 over Python ints: the (seed, step, stream) key of one draw."""
    h = 0
    for w in words:
        h = (h ^ (int(w) & 0xFFFFFFFFFFFFFFFF)) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return np.uint64(h)


class Dropout(Layer):
    """Inverted dropout: in training each unit is kept with probability 1-p
    and scaled by 1/(1-p); in evaluation the identity.

    The mask is a pure function of (seed, step, sample id, stream) (see
    `Noise`): unit j of sample i is dropped when splitmix64(key(seed, step,
    stream) + id_i * golden, then xor unit j's own hash) falls below
    p * 2**64. Computed with xp's uint64 arithmetic, so NumPy and CuPy draw
    the same bits, and per sample, so N ranks holding the rows of one batch
    draw what one process does. Training without noise is an error: a mask
    from anything else would depend on the rank."""
    keeps_output = False   # its backward reads its mask
    # --tensor-parallel: where this rank's units start among the whole layer's (its heads' or positions'
    # part: nn/tensor_parallel.py), so a slice draws the whole layer's mask's slice
    unit_offset = 0
    tokenwise = True
    draws_noise = True

    @property
    def view(self):
        return self.p == 0   # p = 0 hands its input on as it is

    def __init__(self, p):
        self.p = float(p)
        if not 0 <= self.p < 1:
            raise LayerError(f"Dropout({p}): p must be in [0, 1)")

    def configure(self, in_shape):
        super().configure(in_shape)
        # joined to a tensor group, it masks a slice of the whole layer's units (rank r's heads or
        # positions, the leading axis of a sample), which starts at unit r x its size
        self.unit_offset = self.group.rank * math.prod(self.in_shape) if self.group is not None else 0
        return self.out_shape

    def _mask(self, ctx, x):
        xp, noise = self.xp, ctx.noise
        if noise is None:
            raise LayerError(f"{self.describe()} in training needs noise=(seed, step, sample_ids): "
                             f"Sequential.forward_backward(..., noise=...)")
        batch, units = x.shape[0], x[0].size
        if len(noise.sample_ids) != batch:
            raise LayerError(f"{self.describe()}: {len(noise.sample_ids)} sample ids for a batch of {batch}")
        ids = xp.asarray(noise.sample_ids).astype(np.uint64).reshape(batch, 1)
        unit_hash = self._constants.get("unit_hash")
        if unit_hash is None or len(unit_hash) != units:   # a constant of the layer: each unit's own hash
            j = xp.arange(self.unit_offset + 1, self.unit_offset + units + 1, dtype=np.uint64)
            unit_hash = self._constants["unit_hash"] = _splitmix(xp, j * _GOLDEN, xp.empty_like(j))
        h = ctx.buffer("hash", (batch, units), np.uint64)
        tmp = ctx.buffer("tmp", (batch, units), np.uint64)
        keys = _splitmix(xp, ids * _GOLDEN + _mix_host(noise.seed, noise.step, noise.stream), xp.empty_like(ids))
        xp.bitwise_xor(keys, unit_hash, out=h)
        _splitmix(xp, h, tmp)
        keep = ctx.buffer("keep", (batch, units), bool)
        xp.greater_equal(h, np.uint64(min(int(self.p * 2.0**64), 2**64 - 1)), out=keep)
        mask = ctx.buffer("mask", x.shape, x.dtype)
        xp.multiply(keep.reshape(x.shape), x.dtype.type(1 / (1 - self.p)), out=mask)
        return mask

    def forward(self, ctx, x, train):
        if not train or self.p == 0:
            ctx.mask = None
            return x
        ctx.mask = self._mask(ctx, x)
        y = ctx.buffer("out", x.shape, x.dtype)
        self.xp.multiply(x, ctx.mask, out=y)
        return y

    def backward(self, ctx, dy, need_dx):
        if not need_dx:
            return None
        if ctx.mask is None:
            return dy
        dx = ctx.buffer("dx", dy.shape, dy.dtype)
        self.xp.multiply(dy, ctx.mask, out=dx)
        return dx

    def train_floats(self):
        # output, mask and input gradient (the uint64 hashes are scratch of 4 floats a unit); p = 0
        # hands its input and gradient on as they are and holds nothing
        return 7 * math.prod(self.in_shape) if self.p else 0

    def flops(self):
        return math.prod(self.in_shape)

    def describe(self):
        return f"Dropout({self.p:g})"
