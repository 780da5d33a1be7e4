"""The arithmetic of one server update, once a decision (round.py) names its
members: their gradients summed in worker order, DC-ASGD's compensation
(async), --clip-norm's factor (sync), the optimizer's step on the slice.

    mpirun -n 3 python -m hpctrain.comm.ps      # the package's self-check drives it

Beyond contiguous 1-D arrays and a communicator this takes, as objects, the
server's optimizer (`step(params, grads, lr, grad_scale)`, `t`), its lr
function and a hpctrain.clipping.Clip: the server owns the parameters'
slice and its optimizer state, so the update happens here (the exception
to comm/'s rule that DESIGN.md names). It imports
hpctrain.clipping.sum_squares, the arithmetic the ring mode's norm
(comm/grad_norm.py) shares, so both take a norm by the same reduction.

DC-ASGD (`dc_lambda` L > 0): the server keeps, per worker, the parameters it
last sent that worker (w_bak) and applies g + L*g*g*(w - w_bak); w_bak is
the server's per-worker reply buffer, which holds exactly that.
"""
import math
import time

import numpy as np

from ...optim.clipping import sum_squares
from ..deadline import NO_WATCHDOG

BLOCK = 32768        # elements per block in the DC-ASGD pass (cache-sized)


def dc_compensate(g, w, w_bak, lam, scratch):
    """DC-ASGD (Zheng et al. 2017), in place: g += lam * g * g * (w - w_bak),
    block by block through `scratch` so nothing is allocated."""
    n = g.size
    for lo in range(0, n, scratch.size):
        hi = min(lo + scratch.size, n)
        delta, gb = scratch[: hi - lo], g[lo:hi]
        np.subtract(w[lo:hi], w_bak[lo:hi], out=delta)
        delta *= gb
        delta *= gb
        delta *= lam
        gb += delta
    return g


class Update:
    """One server's updates of `params` from `grads` (one buffer per worker).
    many: rounds can have several members (an accumulator is kept); clip
    (sync --clip-norm) with servers_comm, over which the slices' sums of
    squares meet (`peers`: the servers' ranks, to name them); w_bak and
    dc_lambda (async DC-ASGD); times: the server's seconds per activity."""

    def __init__(self, optimizer, lr_fn, params, grads, times, *, many=False, clip=None, servers_comm=None,
                 peers=(), dc_lambda=0.0, w_bak=None, watchdog=NO_WATCHDOG):
        self.opt, self.lr_fn, self.params, self.grads, self.times = optimizer, lr_fn, params, grads, times
        self.acc = np.zeros(params.size, params.dtype) if many else None
        self.clip, self.servers_comm, self.peers, self.watchdog = clip, servers_comm, list(peers), watchdog
        self.dc_lambda = float(dc_lambda)
        self.w_bak = w_bak if self.dc_lambda > 0 else None
        self.scratch = np.empty(max(1, min(BLOCK, params.size)), params.dtype) if self.w_bak is not None else None

    def apply(self, members, version):
        """The update of `version` from `members`' gradients (worker order);
        returns the pre-clip norm of their mean (nan without --clip-norm)."""
        t0 = time.perf_counter()
        first, grads = members[0], self.grads
        if len(members) == 1:
            total = grads[first]
        else:
            total = self.acc
            np.add(grads[first], grads[members[1]], out=total)
            for m in members[2:]:
                total += grads[m]          # worker order, whatever the arrival order
        if self.w_bak is not None:
            dc_compensate(total, self.params, self.w_bak[first], self.dc_lambda, self.scratch)
        scale, norm = 1.0 / len(members), math.nan
        if self.clip is not None:
            scale, norm = self._clipped(total, scale)
        t1 = time.perf_counter()
        self.opt.step(self.params, total, self.lr_fn(version), scale)
        self.times["aggregate"] += t1 - t0
        self.times["optimizer"] += time.perf_counter() - t1
        return norm

    def _clipped(self, total, scale):
        """--clip-norm: (the round's grad_scale times the clip factor of the
        averaged gradient's norm, that norm), from every server's slice of
        `total` (each server's sum of squares, gathered among the servers:
        they all apply every round, in order, so each is here for this one
        too; fsum makes the factor the same bits on every server)."""
        partials = sum_squares([total])
        comm = self.servers_comm
        if comm is not None and comm.Get_size() > 1:
            everyone = np.zeros(comm.Get_size(), np.float64)
            with self.watchdog.waiting("clip norm: the servers' sums of squares", peer=self.peers):
                comm.Allgather(partials, everyone)
            partials = everyone
        scale = self.clip.scaled(partials, scale)
        return scale, self.clip.norm
