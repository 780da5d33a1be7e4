"""The base every optimizer over a flat array shares (`Optimizer`): its
step (`begin`, `set_grad_scale`, `update` over any ranges, `step`), its
decoupled weight decay, and how its one pass is chosen and compiled
(`fused_kernel`, `fuse_pays`). An optimizer is one module beside this one
(sgd.py, momentum.py, adam.py) that gives its state, its NumPy blocks, its
loop and its CUDA kernel; optimizers.py names them and makes one.

An optimizer owns its state for one contiguous range of parameters (the whole
model in ring mode, one server's slice in ps mode, the parts of the buckets a
rank owns with --zero 1: sharded.py) and updates in place. Every operation
is elementwise, so updating a slice gives bit-for-bit what updating the
whole buffer gives for those elements: ps and ring runs stay comparable.

One update is one pass over its range: on NumPy a loop compiled by numba
(`pip install 'hpctrain[fast]'`; each element's parameter, gradient and
moments are read once and written once), on CuPy one elementwise kernel per
range. Both do the float operations of the NumPy blocks in the same order,
each rounded to the buffer's dtype (no fused multiply-add), so the bits are
the same on every path. Without numba (or on another array module) the
NumPy code itself runs, block by block (BLOCK elements at a time) so the
parameters, gradient, moments and one scratch block stay in cache across the
~13 passes an Adam step makes. Measured here (648k parameters, one core):
numba's pass 0.4-0.7 ms an Adam step against 2.3-2.8 ms for the NumPy
blocks; numexpr (three expressions) took 8.4 ms. Below FUSE_FROM elements
the NumPy blocks run on NumPy (numba's start-up would not pay for itself).

Weight decay is decoupled (AdamW, Loshchilov & Hutter): p *= 1 - lr * wd
before the gradient step, in the same block pass, for every optimizer (for
SGD and momentum it is plain L2 decay with the lr folded in), on the
elements of `decay_ranges` only (sorted (lo, hi) of the buffer: the
model's matrices, nn/spec.py decay_ranges; None: every element). The NumPy
blocks multiply the parts of each block inside those ranges; the single
pass runs once per piece of a range, with keep = 1 - lr * wd inside them
and 1.0 outside. Multiplying by 1.0 changes no bit, so an element outside
the ranges (and every element at wd = 0, where the NumPy blocks skip the
multiply) gets what it would get without decay.

    python -m hpctrain.optim       # times one Adam step over 650k parameters, both paths (__main__.py)
"""
import numpy as np

from ..base import vector_width
from .decay import Decayed
from ..base.precision import FLOAT32

BLOCK = 32768
# numba costs a process about 1 s of CPU (its import and type registries, even
# with the kernel cached on disk) and 110 MB; the pass saves ~2.8 ns per
# element of an Adam step. It runs where it pays back that second within the
# run: from 2**17 elements (0.35 ms a step) and FUSE_WORK = 1 s / 2.8 ns
# element-steps (the default MLP's 648K parameters: from 556 steps); short
# runs (most of the test suite's jobs) keep the NumPy blocks and start 1 s
# sooner. The same bits either way.
FUSE_FROM = 1 << 17
FUSE_WORK = 360_000_000

# ---- the single-pass kernels --------------------------------------------------
# Each optimizer writes its pass once as a plain loop (`loop`: numba compiles
# it) and as CUDA (`cuda`: (inputs, outputs read and written, body); CuPy
# compiles it), each its NumPy blocks' operations in their order. p is always
# multiplied by keep: at weight decay 0 that is 1.0, which changes no bit (the
# NumPy code skips it).
_compiled = {}


def fused_kernel(xp, optimizer, dtype):
    """The single-pass update of `optimizer` (a class) for arrays of xp and
    dtype, called as kernel(p, g, *state, *scalars) on equal-length 1-D
    slices (its `loop`); None where there is none (NumPy without numba, an
    array module that is neither NumPy nor CuPy): the caller then runs the
    NumPy blocks. Compiled once per process (numba: cached on disk where it
    can write), before the first step."""
    key = (getattr(xp, "__name__", ""), optimizer.kernel, np.dtype(dtype).str)
    if key not in _compiled:
        _compiled[key] = _compile(xp, optimizer, np.dtype(dtype))
    return _compiled[key]


def fuse_pays(xp, size, steps=None):
    """Whether fused="auto" takes the single pass for `size` elements over a
    run of `steps` (None: not known, size alone decides): CuPy always (one
    kernel, no start-up to pay back); NumPy from FUSE_FROM elements and
    FUSE_WORK element-steps (numba's start-up, above)."""
    if xp is not np:
        return True
    return size >= FUSE_FROM and (steps is None or size * steps >= FUSE_WORK)


def _compile(xp, optimizer, dtype):
    inputs, outputs, body = optimizer.cuda
    n_out = outputs.count(",") + 1   # p and the state: the arrays read and written
    if xp is np:
        try:
            numba = vector_width.load()
        except ImportError:
            return None
        options = dict(nogil=True, error_model="numpy", boundscheck=False)   # "numpy": no zero check per divide
        try:
            kernel = numba.njit(cache=True, **options)(optimizer.loop)
        except RuntimeError:   # no cache directory it can write: compile in memory
            kernel = numba.njit(**options)(optimizer.loop)
        scalars = inputs.count(",")   # the inputs but g
        kernel(*[np.zeros(0, dtype)] * (n_out + 1), *[dtype.type(0)] * scalars)   # compile now, not in step 1
        return kernel
    if getattr(xp, "__name__", "") == "cupy" and hasattr(xp, "ElementwiseKernel"):
        # --fmad=false: NVRTC would fuse a * b + c into one rounding otherwise.
        ew = xp.ElementwiseKernel(inputs, outputs, body, f"hpctrain_{optimizer.kernel}", options=("--fmad=false",))

        def kernel(p, g, *rest):
            state, scalars = rest[:n_out - 1], rest[n_out - 1:]
            ew(g, *scalars, p, *state)
        return kernel
    return None


class Optimizer:
    """The base of SGD, momentum and Adam: a step is `begin(lr, grad_scale)`
    once, then `update(params, grads, lo, hi)` for any ranges covering the
    buffer (bucket fusion updates each bucket as soon as its allreduce
    lands); `step()` does both for the whole buffer. Before the gradient
    step, params *= 1 - lr * weight_decay on the elements of decay_ranges
    (None: all).

    A subclass gives `kernel` (its name), `loop` and `cuda` (its single
    pass, above), `state_names` (its state arrays, attributes of its own),
    `_fused` and `_update_block` (one range through the pass, one block
    through NumPy), and `hyper` (its own flags)."""

    state_names = ()

    def __init__(self, size, xp=np, dtype=FLOAT32.optimizer, weight_decay=0.0, fused="auto", decay_ranges=None):
        self.xp, self.size, self.t = xp, size, 0
        self.weight_decay = weight_decay
        self.decayed = Decayed(decay_ranges, size)
        self.keep = 1.0
        self.dtype = np.dtype(dtype)
        # fused: True where a kernel exists, "auto" (the default) where
        # fuse_pays (make_optimizer decides it with the run's steps), False:
        # the NumPy blocks on any array module (the tests hold the pass to
        # their bits).
        if fused == "auto":
            fused = fuse_pays(xp, size)
        self._kernel = fused_kernel(xp, type(self), self.dtype) if fused else None
        if self._kernel is None:
            self._tmp = xp.empty(min(BLOCK, max(size, 1)), dtype)
            self._tmp2 = xp.empty_like(self._tmp)

    @classmethod
    def hyper(cls, momentum, betas):
        """Its keyword arguments among the run's optimizer flags (--momentum, --betas)."""
        return {}

    def state(self):
        """name -> flat array of this optimizer's state (for checkpoints)."""
        return {name: getattr(self, name) for name in self.state_names}

    def step(self, params, grads, lr, grad_scale=1.0):
        self.begin(lr, grad_scale)
        self.update(params, grads)

    def begin(self, lr, grad_scale=1.0):
        """Start step t+1 with learning rate lr; grad_scale averages a summed gradient."""
        self.t += 1
        self.lr = float(lr)
        # Decoupled decay follows the scheduled lr (as AdamW's does).
        self.keep = 1.0 - lr * self.weight_decay
        self.set_grad_scale(grad_scale)

    def set_grad_scale(self, grad_scale):
        """Change this step's grad_scale before its updates: --clip-norm
        knows its factor only once the whole gradient is summed, after
        begin(), and folds it in here (a multiply the update does anyway)."""
        self.grad_scale = float(grad_scale)

    def update(self, params, grads, lo=0, hi=None):
        """Apply the current step to elements [lo, hi) (views of the full buffers)."""
        hi = self.size if hi is None else hi
        if hi <= lo:
            return
        if self._kernel is not None:
            # at weight decay 0 keep is 1.0 everywhere: one piece
            pieces = self.decayed.pieces(lo, hi, self.keep) if self.weight_decay else ((lo, hi, self.keep),)
            for a, b, keep in pieces:
                self._fused(params[a:b], grads[a:b], a, b, self.dtype.type, keep)
            return
        for b_lo in range(lo, hi, BLOCK):
            b_hi = min(b_lo + BLOCK, hi)
            if self.weight_decay:   # skipped at 0: bit-identical to no decay at all
                for a, b in self.decayed.within(b_lo, b_hi):
                    params[a:b] *= self.keep
            self._update_block(params, grads, b_lo, b_hi)


class Wrapper:
    """Base of the optimizers that drive an inner one (`self.inner`:
    sharded.py, on_device.py): `t`, the step count Adam's bias correction
    uses and checkpoints record, is the inner's, read and set through the
    wrapper."""

    @property
    def t(self):
        return self.inner.t

    @t.setter
    def t(self, value):
        self.inner.t = value
