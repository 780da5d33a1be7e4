"""Adam (Kingma & Ba) on a flat array, with PyTorch's bias correction and
epsilon placement; AdamW with weight decay (base.py).

Adam's moments of weights that never see a gradient (MNIST's border pixels)
decay towards subnormal floats, which are ~100x slower to compute with; every
FLUSH_EVERY steps such values are flushed to zero.

    python -m hpctrain.optim       # times one Adam step, both paths
"""
import math

import numpy as np

from .base import Optimizer
from ..base.precision import FLOAT32

FLUSH_EVERY = 50
# float32 subnormals start below 1.2e-38; m decays by beta1=0.9 per step, so
# from 1e-30 it needs ~170 steps to get there: flushing every 50 steps is enough.
FLUSH_BELOW = 1e-30


def _adam(p, g, m, v, keep, b1, gsm, b2, gsv, ibc, eps, ss, fb):
    # fb is FLUSH_BELOW on a flushing step, else 0 (no |x| < 0); the new p
    # uses the moments before the flush.
    for i in range(p.shape[0]):
        gi = g[i]
        mi = m[i] * b1 + gi * gsm
        vi = v[i] * b2 + (gi * gi) * gsv
        p[i] = p[i] * keep - (mi / (np.sqrt(vi) * ibc + eps)) * ss
        # x * 0.0 (x - x is 0.0 for the finite x flushed here): the sign of
        # a flushed negative moment stays, as in the NumPy blocks.
        m[i] = mi * (mi - mi) if abs(mi) < fb else mi
        v[i] = vi * (vi - vi) if abs(vi) < fb else vi


class Adam(Optimizer):
    """Adam (Kingma & Ba) with PyTorch's bias-correction and epsilon placement."""

    state_names = ("m", "v")
    kernel = "adam"
    loop = staticmethod(_adam)
    cuda = ("T g, T keep, T b1, T gsm, T b2, T gsv, T ibc, T eps, T ss, T fb", "T p, T m, T v",
            "T mi = m * b1 + g * gsm; T vi = v * b2 + (g * g) * gsv;"
            " p = p * keep - (mi / (sqrt(vi) * ibc + eps)) * ss;"
            " m = fabs(mi) < fb ? mi * (T)0 : mi; v = fabs(vi) < fb ? vi * (T)0 : vi;")

    def __init__(self, size, xp=np, dtype=FLOAT32.optimizer, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 fused="auto", decay_ranges=None):
        super().__init__(size, xp, dtype, weight_decay, fused, decay_ranges)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.m = xp.zeros(size, dtype)
        self.v = xp.zeros(size, dtype)

    @classmethod
    def hyper(cls, momentum, betas):
        return {"beta1": betas[0], "beta2": betas[1]}

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
