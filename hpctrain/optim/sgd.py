"""Plain SGD on a flat array: params -= lr * grad_scale * grads (after the
decoupled decay, base.py).

    python -m pytest -q tests/test_optim.py
"""
from .base import Optimizer


def _sgd(p, g, keep, step):
    for i in range(p.shape[0]):
        p[i] = p[i] * keep - g[i] * step


class SGD(Optimizer):
    """params -= lr * grad_scale * grads (after params *= 1 - lr * weight_decay
    on the elements of decay_ranges, None: all)."""

    kernel = "sgd"
    loop = staticmethod(_sgd)
    cuda = ("T g, T keep, T step", "T p", "p = p * keep - g * step;")

    def _fused(self, p, g, lo, hi, dt, keep):
        # Each scalar rounded to the dtype first, as NumPy does with a Python
        # float beside a float32 array: the same operands, the same bits.
        self._kernel(p, g, dt(keep), dt(self.lr * self.grad_scale))

    def _update_block(self, params, grads, lo, hi):
        t = self._tmp[: hi - lo]
        self.xp.multiply(grads[lo:hi], self.lr * self.grad_scale, out=t)
        params[lo:hi] -= t
