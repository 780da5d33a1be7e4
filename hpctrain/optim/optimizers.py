"""SGD, momentum and Adam on flat arrays, and decoupled weight decay (the
learning-rate schedules, which give each step's lr, are in lr_schedule.py).

An optimizer owns its state for one contiguous range of parameters (the whole
model in ring mode, one server's slice in ps mode, the parts of the buckets a
rank owns with --shard-optimizer on: `Sharded`) and updates in place. Every
operation is elementwise, so updating a slice gives bit-for-bit what updating
the whole buffer gives for those elements: ps and ring runs stay comparable.

One update is one pass over its range: on NumPy a loop compiled by numba
(`pip install 'hpctrain[fast]'`; each element's parameter, gradient and
moments are read once and written once), on CuPy one elementwise kernel per
range. Both do the float operations of the NumPy code below in the same
order, each rounded to the buffer's dtype (no fused multiply-add), so the
bits are the same on every path. Without numba (or on another array module)
the NumPy code itself runs, block by block (BLOCK elements at a time) so the
parameters, gradient, moments and one scratch block stay in cache across the
~13 passes an Adam step makes. Measured here (648k parameters, one core):
numba's pass 0.4-0.7 ms an Adam step against 2.3-2.8 ms for the NumPy
blocks; numexpr (three expressions) took 8.4 ms. Below FUSE_FROM elements
the NumPy blocks run on NumPy (numba's start-up would not pay for itself).
Adam's moments of weights that never see a gradient (MNIST's border pixels)
decay towards subnormal floats, which are ~100x slower to compute with; every
FLUSH_EVERY steps such values are flushed to zero.

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
import math

import numpy as np

from .. import vector_width
from .decay import Decayed, decay_in
from ..precision import FLOAT32

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
FLUSH_EVERY = 50
# float32 subnormals start below 1.2e-38; m decays by beta1=0.9 per step, so
# from 1e-30 it needs ~170 steps to get there: flushing every 50 steps is enough.
FLUSH_BELOW = 1e-30


# ---- the single-pass kernels --------------------------------------------------
# Written once per optimizer as a plain loop (numba compiles it) and as CUDA
# (CuPy compiles it), each the NumPy blocks' operations in their order. p is
# always multiplied by keep: at weight decay 0 that is 1.0, which changes no
# bit (the NumPy code skips it). Adam's flush: fb is FLUSH_BELOW on a flushing
# step, else 0 (no |x| < 0); the new p uses the moments before the flush.

def _sgd(p, g, keep, step):
    for i in range(p.shape[0]):
        p[i] = p[i] * keep - g[i] * step


def _momentum(p, g, v, keep, mu, gs, lr):
    for i in range(p.shape[0]):
        vi = v[i] * mu + g[i] * gs
        v[i] = vi
        p[i] = p[i] * keep - vi * lr


def _adam(p, g, m, v, keep, b1, gsm, b2, gsv, ibc, eps, ss, fb):
    for i in range(p.shape[0]):
        gi = g[i]
        mi = m[i] * b1 + gi * gsm
        vi = v[i] * b2 + (gi * gi) * gsv
        p[i] = p[i] * keep - (mi / (np.sqrt(vi) * ibc + eps)) * ss
        # x * 0.0 (x - x is 0.0 for the finite x flushed here): the sign of
        # a flushed negative moment stays, as in the NumPy blocks.
        m[i] = mi * (mi - mi) if abs(mi) < fb else mi
        v[i] = vi * (vi - vi) if abs(vi) < fb else vi


_CUDA = {
    # name: (inputs, outputs (read and written), body)
    "sgd": ("T g, T keep, T step", "T p", "p = p * keep - g * step;"),
    "momentum": ("T g, T keep, T mu, T gs, T lr", "T p, T v",
                 "T vi = v * mu + g * gs; v = vi; p = p * keep - vi * lr;"),
    "adam": ("T g, T keep, T b1, T gsm, T b2, T gsv, T ibc, T eps, T ss, T fb", "T p, T m, T v",
             "T mi = m * b1 + g * gsm; T vi = v * b2 + (g * g) * gsv;"
             " p = p * keep - (mi / (sqrt(vi) * ibc + eps)) * ss;"
             " m = fabs(mi) < fb ? mi * (T)0 : mi; v = fabs(vi) < fb ? vi * (T)0 : vi;"),
}
_LOOPS = {"sgd": _sgd, "momentum": _momentum, "adam": _adam}
_compiled = {}


def fused_kernel(xp, name, dtype):
    """The single-pass update `name` for arrays of xp and dtype, called as
    kernel(p, g, *state, *scalars) on equal-length 1-D slices (see _sgd,
    _momentum, _adam); None where there is none (NumPy without numba, an
    array module that is neither NumPy nor CuPy): the caller then runs the
    NumPy blocks. Compiled once per process (numba: cached on disk where it
    can write), before the first step."""
    key = (getattr(xp, "__name__", ""), name, np.dtype(dtype).str)
    if key not in _compiled:
        _compiled[key] = _compile(xp, name, np.dtype(dtype))
    return _compiled[key]


def fuse_pays(xp, size, steps=None):
    """Whether fused="auto" takes the single pass for `size` elements over a
    run of `steps` (None: not known, size alone decides): CuPy always (one
    kernel, no start-up to pay back); NumPy from FUSE_FROM elements and
    FUSE_WORK element-steps (numba's start-up, above)."""
    if xp is not np:
        return True
    return size >= FUSE_FROM and (steps is None or size * steps >= FUSE_WORK)


def prepare(name, size, steps=None, single_pass="auto", xp=np, dtype=FLOAT32.optimizer):
    """Load now what an optimizer `name` over `size` elements for `steps`
    steps will use (numba and its compiled pass with --single-pass on, or
    auto where fuse_pays): the start-up memory check then counts it (about
    110 MB) in what the process holds."""
    wanted = single_pass == "on" or (single_pass == "auto" and fuse_pays(xp, size, steps))
    if xp is np and wanted and name in OPTIMIZERS:
        fused_kernel(np, OPTIMIZERS[name].kernel, dtype)


def _compile(xp, name, dtype):
    if xp is np:
        try:
            numba = vector_width.load()
        except ImportError:
            return None
        options = dict(nogil=True, error_model="numpy", boundscheck=False)   # "numpy": no zero check per divide
        try:
            kernel = numba.njit(cache=True, **options)(_LOOPS[name])
        except RuntimeError:   # no cache directory it can write: compile in memory
            kernel = numba.njit(**options)(_LOOPS[name])
        scalars = {"sgd": 2, "momentum": 4, "adam": 9}[name]
        arrays = {"sgd": 2, "momentum": 3, "adam": 4}[name]
        kernel(*[np.zeros(0, dtype)] * arrays, *[dtype.type(0)] * scalars)   # compile now, not in step 1
        return kernel
    if getattr(xp, "__name__", "") == "cupy" and hasattr(xp, "ElementwiseKernel"):
        inputs, outputs, body = _CUDA[name]
        # --fmad=false: NVRTC would fuse a * b + c into one rounding otherwise.
        ew = xp.ElementwiseKernel(inputs, outputs, body, f"hpctrain_{name}", options=("--fmad=false",))
        n_out = outputs.count(",") + 1

        def kernel(p, g, *rest):
            state, scalars = rest[:n_out - 1], rest[n_out - 1:]
            ew(g, *scalars, p, *state)
        return kernel
    return None


class SGD:
    """params -= lr * grad_scale * grads (after params *= 1 - lr * weight_decay
    on the elements of decay_ranges, None: all).

    A step is `begin(lr, grad_scale)` once, then `update(params, grads, lo, hi)`
    for any ranges covering the buffer (bucket fusion updates each bucket as
    soon as its allreduce lands); `step()` does both for the whole buffer.
    """

    state_names = ()

    kernel = "sgd"   # the name of its single-pass kernel (fused_kernel)

    def __init__(self, size, xp=np, dtype=FLOAT32.optimizer, weight_decay=0.0, fused="auto", decay_ranges=None):
        self.xp, self.size, self.t = xp, size, 0
        self.weight_decay = weight_decay
        self.decayed = Decayed(decay_ranges, size)
        self.keep = 1.0
        self.dtype = np.dtype(dtype)
        # fused: True where a kernel exists, "auto" (the default) where
        # fuse_pays (make_optimizer decides it with the run's steps), False:
        # the NumPy blocks below on any array module (the tests hold the
        # pass to their bits).
        if fused == "auto":
            fused = fuse_pays(xp, size)
        self._kernel = fused_kernel(xp, self.kernel, self.dtype) if fused else None
        if self._kernel is None:
            self._tmp = xp.empty(min(BLOCK, max(size, 1)), dtype)
            self._tmp2 = xp.empty_like(self._tmp)

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

    def _fused(self, p, g, lo, hi, dt, keep):
        # Each scalar rounded to the dtype first, as NumPy does with a Python
        # float beside a float32 array: the same operands, the same bits.
        self._kernel(p, g, dt(keep), dt(self.lr * self.grad_scale))

    def _update_block(self, params, grads, lo, hi):
        t = self._tmp[: hi - lo]
        self.xp.multiply(grads[lo:hi], self.lr * self.grad_scale, out=t)
        params[lo:hi] -= t


class Momentum(SGD):
    """Heavy-ball momentum as in PyTorch: v = mu*v + g; p -= lr*v."""

    state_names = ("velocity",)
    kernel = "momentum"

    def __init__(self, size, xp=np, dtype=FLOAT32.optimizer, momentum=0.9, weight_decay=0.0, fused="auto",
                 decay_ranges=None):
        super().__init__(size, xp, dtype, weight_decay, fused, decay_ranges)
        self.mu = momentum
        self.velocity = xp.zeros(size, dtype)

    def _fused(self, p, g, lo, hi, dt, keep):
        self._kernel(p, g, self.velocity[lo:hi], dt(keep), dt(self.mu), dt(self.grad_scale), dt(self.lr))

    def _update_block(self, params, grads, lo, hi):
        xp, t, vb = self.xp, self._tmp[: hi - lo], self.velocity[lo:hi]
        vb *= self.mu
        xp.multiply(grads[lo:hi], self.grad_scale, out=t)
        vb += t
        xp.multiply(vb, self.lr, out=t)
        params[lo:hi] -= t


class Adam(SGD):
    """Adam (Kingma & Ba) with PyTorch's bias-correction and epsilon placement."""

    state_names = ("m", "v")
    kernel = "adam"

    def __init__(self, size, xp=np, dtype=FLOAT32.optimizer, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 fused="auto", decay_ranges=None):
        super().__init__(size, xp, dtype, weight_decay, fused, decay_ranges)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.m = xp.zeros(size, dtype)
        self.v = xp.zeros(size, dtype)

    def begin(self, lr, grad_scale=1.0):
        super().begin(lr, grad_scale)
        b1, b2 = self.beta1, self.beta2
        self.step_size = lr / (1 - b1 ** self.t)
        self.inv_sqrt_bc2 = 1.0 / math.sqrt(1 - b2 ** self.t)
        self.flush = self.t % FLUSH_EVERY == 0

    def set_grad_scale(self, grad_scale):
        super().set_grad_scale(grad_scale)
        self.g_scale_m = (1 - self.beta1) * grad_scale
        self.g_scale_v = (1 - self.beta2) * grad_scale * grad_scale

    def _fused(self, p, g, lo, hi, dt, keep):
        self._kernel(p, g, self.m[lo:hi], self.v[lo:hi], dt(keep), dt(self.beta1), dt(self.g_scale_m),
                     dt(self.beta2), dt(self.g_scale_v), dt(self.inv_sqrt_bc2), dt(self.eps), dt(self.step_size),
                     dt(FLUSH_BELOW if self.flush else 0.0))

    def _update_block(self, params, grads, lo, hi):
        xp, n = self.xp, hi - lo
        t, t2, g, mb, vb = self._tmp[:n], self._tmp2[:n], grads[lo:hi], self.m[lo:hi], self.v[lo:hi]
        mb *= self.beta1
        xp.multiply(g, self.g_scale_m, out=t)
        mb += t
        vb *= self.beta2
        xp.multiply(g, g, out=t)
        t *= self.g_scale_v
        vb += t
        # p -= step_size * m / (sqrt(v) / sqrt(bc2) + eps)
        xp.sqrt(vb, out=t)
        t *= self.inv_sqrt_bc2
        t += self.eps
        xp.divide(mb, t, out=t2)
        t2 *= self.step_size
        params[lo:hi] -= t2
        if self.flush:
            for state in (mb, vb):
                xp.abs(state, out=t)
                xp.less(t, FLUSH_BELOW, out=t2)  # 1.0 where tiny
                xp.subtract(1.0, t2, out=t2)
                state *= t2


class _Wrapper:
    """Base of the optimizers that drive an inner one (`self.inner`): `t`, the
    step count Adam's bias correction uses and checkpoints record, is the
    inner's, read and set through the wrapper."""

    @property
    def t(self):
        return self.inner.t

    @t.setter
    def t(self, value):
        self.inner.t = value


class OnDevice(_Wrapper):
    """An optimizer whose parameters and state live on a device (CuPy), driven
    through host arrays: what a parameter server with --ps-device gpu needs,
    since its messages travel through host buffers. The host `params` and the
    arrays state() returns stay the ones the caller sends and receives; every
    step copies the gradient in and the parameters out. state() brings the
    device state to the host and marks the device copy stale (the caller may
    write into what it returned, as a restore does), so the next step first
    pushes host parameters and state back: the update is always the inner
    optimizer's, on the device, whatever happened on the host in between."""

    def __init__(self, inner, size, dtype=FLOAT32.optimizer):
        self.inner, self.xp = inner, inner.xp
        self._params = self.xp.zeros(size, dtype)
        self._grads = self.xp.zeros(size, dtype)
        self._host = {name: np.zeros(size, dtype) for name in inner.state_names}
        self._stale = True  # host parameters (set by the first restore) are the truth

    def state(self):
        for name, dev in self.inner.state().items():
            _to_host(dev, self._host[name])
        self._stale = True
        return self._host

    def step(self, params, grads, lr, grad_scale=1.0):
        if self._stale:
            _to_device(params, self._params)
            for name, dev in self.inner.state().items():
                _to_device(self._host[name], dev)
            self._stale = False
        _to_device(grads, self._grads)
        self.inner.step(self._params, self._grads, lr, grad_scale)
        _to_host(self._params, params)


def _to_device(host, dev):
    if isinstance(dev, np.ndarray):
        np.copyto(dev, host)
    else:
        dev.set(host)


def _to_host(dev, host):
    if isinstance(dev, np.ndarray):
        np.copyto(host, dev)
    else:
        dev.get(out=host)


class Sharded(_Wrapper):
    """An optimizer that owns only `ranges` [(lo, hi), ...] (disjoint) of a
    flat buffer, its state kept compact: the owned ranges one after another,
    in buffer order, so the state is sum(hi - lo) elements, not the buffer's
    length (ring mode with --shard-optimizer on: each rank updates the part of
    every bucket it owns after the reduce-scatter, ZeRO stage 1).

    `update(params, grads, lo, hi)` takes full-length buffers and a range that
    lies inside one owned range; the arithmetic is the inner optimizer's, per
    element, so each owned element gets bit for bit what the unsharded
    optimizer would give it. `t` (Adam's bias correction) is the inner's, the
    same on every rank. `state()` is compact; `expand`/`compact` move state
    between that layout and full-length arrays (checkpoints hold full ones)."""

    def __init__(self, inner_factory, ranges, full_size, decay_ranges=None):
        """inner_factory(n, decay_ranges): the inner optimizer over n compact
        elements, decaying those of decay_ranges (its coordinates; given
        here in the full buffer's)."""
        self.full_size = full_size   # the buffer's length (checkpoints hold state this long)
        self.ranges = sorted((int(lo), int(hi)) for lo, hi in ranges if hi > lo)
        self.offsets, c = [], 0
        for i, (lo, hi) in enumerate(self.ranges):
            if i and lo < self.ranges[i - 1][1]:
                raise ValueError(f"overlapping owned ranges {self.ranges[i - 1]} and {(lo, hi)}")
            self.offsets.append(c)
            c += hi - lo
        self.size = c
        self.inner = inner_factory(c, decay_in(decay_ranges, self.ranges))
        self.xp, self.dtype = self.inner.xp, self.inner.dtype
        self.state_names = self.inner.state_names

    def begin(self, lr, grad_scale=1.0):
        self.inner.begin(lr, grad_scale)

    def set_grad_scale(self, grad_scale):
        self.inner.set_grad_scale(grad_scale)

    def state(self):
        return self.inner.state()

    def compact_offset(self, lo, hi):
        """Where buffer range [lo, hi), inside one owned range, starts in the compact layout."""
        for (r_lo, r_hi), c in zip(self.ranges, self.offsets):
            if r_lo <= lo and hi <= r_hi:
                return c + (lo - r_lo)
        raise ValueError(f"[{lo}, {hi}) is not within one owned range")

    def update(self, params, grads, lo, hi):
        if hi <= lo:
            return
        c = self.compact_offset(lo, hi)
        # Shifted views, so the inner optimizer's index c means element lo of
        # the buffers (c <= lo: the compact layout keeps buffer order).
        shift = lo - c
        self.inner.update(params[shift:], grads[shift:], c, c + hi - lo)

    def update_compact(self, params, grads, lo, hi, shard=False):
        """update(), the gradient given in the compact layout (--zero 2: the
        rank's shard of the summed gradient, comm/data_parallel.GradShard);
        shard: the parameters too (--zero 3: nn/sharded_store.ParamShard)."""
        if hi <= lo:
            return
        c = self.compact_offset(lo, hi)
        self.inner.update(params if shard else params[lo - c:], grads, c, c + hi - lo)

    def compact(self, full, out):
        """out (compact) <- the owned elements of full (a full-length array)."""
        for (lo, hi), c in zip(self.ranges, self.offsets):
            out[c:c + hi - lo] = full[lo:hi]
        return out


def state_bytes(optimizer):
    """Bytes of optimizer state this process holds (sharded or not)."""
    return sum(int(a.nbytes) for a in optimizer.state().values())


OPTIMIZERS = {"sgd": SGD, "momentum": Momentum, "adam": Adam}


def make_optimizer(name, size, xp=np, dtype=FLOAT32.optimizer, momentum=0.9, owned=None, weight_decay=0.0, fused="auto",
                   steps=None, betas=(0.9, 0.999), decay_ranges=None, at=None):
    """The optimizer `name` for a flat buffer of `size` elements; with `owned`
    (a list of (lo, hi)), a Sharded one keeping state for those ranges only.
    weight_decay: decoupled (p *= 1 - lr * wd each step), per element, on
    the elements of decay_ranges, the model's [(lo, hi)] (None: all), so a
    slice or a shard decays exactly as the whole buffer would; `at`: the
    model's pieces [(lo, hi)] the buffer holds one after another (None: the
    model from 0). betas: Adam's (beta1, beta2). fused: see SGD (the same
    bits either way); "auto" decides by fuse_pays with `steps`, the run's
    optimizer steps."""
    ranges = decay_in(decay_ranges, at if at is not None else [(0, size)])
    if owned is not None:
        return Sharded(lambda n, inner: make_optimizer(name, n, xp, dtype, momentum, weight_decay=weight_decay,
                                                       fused=fused, steps=steps, betas=betas, decay_ranges=inner),
                       owned, size, ranges)
    if fused == "auto":
        fused = fuse_pays(xp, size, steps)
    if name == "momentum":
        return Momentum(size, xp, dtype, momentum=momentum, weight_decay=weight_decay, fused=fused,
                        decay_ranges=ranges)
    if name == "adam":
        return Adam(size, xp, dtype, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, fused=fused,
                    decay_ranges=ranges)
    return OPTIMIZERS[name](size, xp, dtype, weight_decay=weight_decay, fused=fused, decay_ranges=ranges)

