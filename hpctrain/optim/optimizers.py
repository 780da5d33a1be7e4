"""SGD, momentum and Adam on flat arrays, decoupled weight decay, and the
learning-rate schedules (constant, step, cosine; each after a linear warm-up).

An optimizer owns its state for one contiguous range of parameters (the whole
model in ring mode, one server's slice in ps mode, the parts of the buckets a
rank owns with --shard-optimizer on: `Sharded`) and updates in place. Every
operation is elementwise, so updating a slice gives bit-for-bit what updating
the whole buffer gives for those elements: ps and ring runs stay comparable.

Work is done block by block (BLOCK elements at a time) so the parameters,
gradient, moments and one scratch block stay in cache across the ~10 passes an
Adam step makes, instead of streaming 4 large arrays through memory 10 times.
Adam's moments of weights that never see a gradient (MNIST's border pixels)
decay towards subnormal floats, which are ~100x slower to compute with; every
FLUSH_EVERY steps such values are flushed to zero.

Weight decay is decoupled (AdamW, Loshchilov & Hutter): p *= 1 - lr * wd
before the gradient step, in the same block pass, for every optimizer (for
SGD and momentum it is plain L2 decay with the lr folded in). At wd = 0 the
multiply is skipped, so results stay bit for bit what they were without it.

    python -m hpctrain.optim       # times one Adam step over 650k parameters
"""
import math

import numpy as np

BLOCK = 32768
FLUSH_EVERY = 50
# float32 subnormals start below 1.2e-38; m decays by beta1=0.9 per step, so
# from 1e-30 it needs ~170 steps to get there: flushing every 50 steps is enough.
FLUSH_BELOW = 1e-30


class SGD:
    """params -= lr * grad_scale * grads (after params *= 1 - lr * weight_decay).

    A step is `begin(lr, grad_scale)` once, then `update(params, grads, lo, hi)`
    for any ranges covering the buffer (bucket fusion updates each bucket as
    soon as its allreduce lands); `step()` does both for the whole buffer.
    """

    state_names = ()

    def __init__(self, size, xp=np, dtype=np.float32, weight_decay=0.0):
        self.xp, self.size, self.t = xp, size, 0
        self.weight_decay = weight_decay
        self.keep = 1.0
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
        self.lr = lr
        # Decoupled decay follows the scheduled lr (as AdamW's does).
        self.keep = 1.0 - lr * self.weight_decay
        self.set_grad_scale(grad_scale)

    def set_grad_scale(self, grad_scale):
        """Change this step's grad_scale before its updates: --clip-norm
        knows its factor only once the whole gradient is summed, after
        begin(), and folds it in here (a multiply the update does anyway)."""
        self.grad_scale = grad_scale

    def update(self, params, grads, lo=0, hi=None):
        """Apply the current step to elements [lo, hi) (views of the full buffers)."""
        hi = self.size if hi is None else hi
        for b_lo in range(lo, hi, BLOCK):
            b_hi = min(b_lo + BLOCK, hi)
            if self.weight_decay:   # skipped at 0: bit-identical to no decay at all
                params[b_lo:b_hi] *= self.keep
            self._update_block(params, grads, b_lo, b_hi)

    def _update_block(self, params, grads, lo, hi):
        t = self._tmp[: hi - lo]
        self.xp.multiply(grads[lo:hi], self.lr * self.grad_scale, out=t)
        params[lo:hi] -= t


class Momentum(SGD):
    """Heavy-ball momentum as in PyTorch: v = mu*v + g; p -= lr*v."""

    state_names = ("velocity",)

    def __init__(self, size, xp=np, dtype=np.float32, momentum=0.9, weight_decay=0.0):
        super().__init__(size, xp, dtype, weight_decay)
        self.mu = momentum
        self.velocity = xp.zeros(size, dtype)

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

    def __init__(self, size, xp=np, dtype=np.float32, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
        super().__init__(size, xp, dtype, weight_decay)
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

    def __init__(self, inner, size, dtype=np.float32):
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

    def __init__(self, inner_factory, ranges, full_size):
        self.full_size = full_size   # the buffer's length (checkpoints hold state this long)
        self.ranges = sorted((int(lo), int(hi)) for lo, hi in ranges if hi > lo)
        self.offsets, c = [], 0
        for i, (lo, hi) in enumerate(self.ranges):
            if i and lo < self.ranges[i - 1][1]:
                raise ValueError(f"overlapping owned ranges {self.ranges[i - 1]} and {(lo, hi)}")
            self.offsets.append(c)
            c += hi - lo
        self.size = c
        self.inner = inner_factory(c)
        self.xp = self.inner.xp
        self.state_names = self.inner.state_names

    def begin(self, lr, grad_scale=1.0):
        self.inner.begin(lr, grad_scale)

    def set_grad_scale(self, grad_scale):
        self.inner.set_grad_scale(grad_scale)

    def state(self):
        return self.inner.state()

    def _find(self, lo, hi):
        for (r_lo, r_hi), c in zip(self.ranges, self.offsets):
            if r_lo <= lo and hi <= r_hi:
                return c + (lo - r_lo)
        raise ValueError(f"[{lo}, {hi}) is not within one owned range")

    def update(self, params, grads, lo, hi):
        if hi <= lo:
            return
        c = self._find(lo, hi)
        # Shifted views, so the inner optimizer's index c means element lo of
        # the buffers (c <= lo: the compact layout keeps buffer order).
        shift = lo - c
        self.inner.update(params[shift:], grads[shift:], c, c + hi - lo)

    def compact(self, full, out):
        """out (compact) <- the owned elements of full (a full-length array)."""
        for (lo, hi), c in zip(self.ranges, self.offsets):
            out[c:c + hi - lo] = full[lo:hi]
        return out

    def expand(self, compact, out):
        """out (full-length) [owned ranges] <- compact; the rest untouched."""
        for (lo, hi), c in zip(self.ranges, self.offsets):
            out[lo:hi] = compact[c:c + hi - lo]
        return out


def state_bytes(optimizer):
    """Bytes of optimizer state this process holds (sharded or not)."""
    return sum(int(a.nbytes) for a in optimizer.state().values())


OPTIMIZERS = {"sgd": SGD, "momentum": Momentum, "adam": Adam}


def make_optimizer(name, size, xp=np, dtype=np.float32, momentum=0.9, owned=None, weight_decay=0.0):
    """The optimizer `name` for a flat buffer of `size` elements; with `owned`
    (a list of (lo, hi)), a Sharded one keeping state for those ranges only.
    weight_decay: decoupled (p *= 1 - lr * wd each step), per element, so a
    slice or a shard decays exactly as the whole buffer would."""
    if owned is not None:
        return Sharded(lambda n: make_optimizer(name, n, xp, dtype, momentum, weight_decay=weight_decay),
                       owned, size)
    if name == "momentum":
        return Momentum(size, xp, dtype, momentum=momentum, weight_decay=weight_decay)
    return OPTIMIZERS[name](size, xp, dtype, weight_decay=weight_decay)


SCHEDULES = ("constant", "step", "cosine")


def learning_rate(step, base_lr, workers=1, scale_lr=False, warmup_steps=0, schedule="constant",
                  decay=0.1, decay_steps=0, lr_min=0.0, total_steps=None):
    """lr for 0-based `step`, a pure function of it (so a resume is bit-exact):
    base (times workers with --scale-lr), shaped by `schedule`, ramped
    linearly from 1/warmup to full over the first warmup_steps (Goyal et al.).

    constant: base. step: base * decay ** (step // decay_steps), counted from
    step 0 (the warm-up ramps whatever the schedule gives). cosine: base at
    the end of the warm-up, down to lr_min (not scaled by --scale-lr) at the
    last step, total_steps - 1: lr_min + (base - lr_min) * (1 + cos(pi * p)) / 2,
    p = (step - warmup_steps) / (total_steps - 1 - warmup_steps)."""
    lr = base_lr * (workers if scale_lr else 1)
    if schedule == "step":
        lr *= decay ** (step // decay_steps)
    elif schedule == "cosine":
        span = max(total_steps - 1 - warmup_steps, 1)
        p = min(max(step - warmup_steps, 0) / span, 1.0)
        lr = lr_min + (lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * p))
    if warmup_steps and step < warmup_steps:
        lr *= (step + 1) / warmup_steps
    return lr


def schedule_line(base_lr, workers=1, scale_lr=False, warmup_steps=0, schedule="constant", decay=0.1,
                  decay_steps=0, lr_min=0.0, total_steps=None):
    """The schedule's key points in one line (the chief prints it at start)."""
    lr = base_lr * (workers if scale_lr else 1)
    warm = f" (after {warmup_steps} warm-up steps)" if warmup_steps else ""
    if schedule == "step":
        return f"lr: step from {lr:g}{warm}, times {decay:g} every {decay_steps} steps"
    if schedule == "cosine":
        return f"lr: cosine from {lr:g}{warm} to {lr_min:g} at step {total_steps}"
    return f"lr: constant {lr:g}{warm}"


if __name__ == "__main__":
    import time
    n = 784 * 500 + 500 + 500 * 500 + 500 + 500 * 10 + 10   # MNIST's default model
    p = np.zeros(n, np.float32)
    g = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    opt = Adam(n)
    for _ in range(10):
        opt.step(p, g, 1e-4)
    t0 = time.perf_counter()
    for _ in range(200):
        opt.step(p, g, 1e-4)
    print(f"Adam step over {n} parameters: {(time.perf_counter() - t0) / 200 * 1e3:.3f} ms")
