"""Heavy-ball momentum on a flat array, as PyTorch's: v = mu*v + g; p -= lr*v.

    python -m pytest -q tests/test_optim.py
"""
import numpy as np

from .base import Optimizer
from ..base.precision import FLOAT32


def _momentum(p, g, v, keep, mu, gs, lr):
    for i in range(p.shape[0]):
        vi = v[i] * mu + g[i] * gs
        v[i] = vi
        p[i] = p[i] * keep - vi * lr


class Momentum(Optimizer):
    """Heavy-ball momentum as in PyTorch: v = mu*v + g; p -= lr*v."""

    state_names = ("velocity",)
    kernel = "momentum"
    loop = staticmethod(_momentum)
    cuda = ("T g, T keep, T mu, T gs, T lr", "T p, T v", "T vi = v * mu + g * gs; v = vi; p = p * keep - vi * lr;")

    def __init__(self, size, xp=np, dtype=FLOAT32.optimizer, momentum=0.9, weight_decay=0.0, fused="auto",
                 decay_ranges=None):
        super().__init__(size, xp, dtype, weight_decay, fused, decay_ranges)
        self.mu = momentum
        self.velocity = xp.zeros(size, dtype)

    @classmethod
    def hyper(cls, momentum, betas):
        return {"momentum": momentum}

    def _fused(self, p, g, lo, hi, dt, keep):
        self._kernel(p, g, self.velocity[lo:hi], dt(keep), dt(self.mu), dt(self.grad_scale), dt(self.lr))

    def _update_block(self, params, grads, lo, hi):
        xp, t, vb = self.xp, self._tmp[: hi - lo], self.velocity[lo:hi]
        vb *= self.mu
        xp.multiply(grads[lo:hi], self.grad_scale, out=t)
        vb += t
        xp.multiply(vb, self.lr, out=t)
        params[lo:hi] -= t
