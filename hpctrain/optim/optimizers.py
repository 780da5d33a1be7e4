"""The optimizers by name (OPTIMIZERS: each one module, sgd.py, momentum.py,
adam.py, over base.py) and the one way to make one for a run
(`make_optimizer`: whole, or Sharded over owned ranges), what loading it
costs (`prepare`) and the state it holds (`state_bytes`). A new optimizer
is a module with its class, named here.

    python -m pytest -q tests/test_optim.py
"""
import numpy as np

from .adam import Adam
from .base import fuse_pays, fused_kernel
from .decay import decay_in
from .momentum import Momentum
from .sgd import SGD
from .sharded import Sharded
from ..base.precision import FLOAT32

OPTIMIZERS = {cls.kernel: cls for cls in (SGD, Momentum, Adam)}


def prepare(name, size, steps=None, single_pass="auto", xp=np, dtype=FLOAT32.optimizer):
    """Load now what an optimizer `name` over `size` elements for `steps`
    steps will use (numba and its compiled pass with --single-pass on, or
    auto where fuse_pays): the start-up memory check then counts it (about
    110 MB) in what the process holds."""
    wanted = single_pass == "on" or (single_pass == "auto" and fuse_pays(xp, size, steps))
    if xp is np and wanted and name in OPTIMIZERS:
        fused_kernel(np, OPTIMIZERS[name], dtype)


def state_bytes(optimizer):
    """Bytes of optimizer state this process holds (sharded or not)."""
    return sum(int(a.nbytes) for a in optimizer.state().values())


def make_optimizer(name, size, xp=np, dtype=FLOAT32.optimizer, momentum=0.9, owned=None, weight_decay=0.0, fused="auto",
                   steps=None, betas=(0.9, 0.999), decay_ranges=None, at=None):
    """The optimizer `name` for a flat buffer of `size` elements; with `owned`
    (a list of (lo, hi)), a Sharded one keeping state for those ranges only.
    weight_decay: decoupled (p *= 1 - lr * wd each step), per element, on
    the elements of decay_ranges, the model's [(lo, hi)] (None: all), so a
    slice or a shard decays exactly as the whole buffer would; `at`: the
    model's pieces [(lo, hi)] the buffer holds one after another (None: the
    model from 0). betas: Adam's (beta1, beta2); momentum: Momentum's. fused:
    see base.Optimizer (the same bits either way); "auto" decides by
    fuse_pays with `steps`, the run's optimizer steps."""
    ranges = decay_in(decay_ranges, at if at is not None else [(0, size)])
    if owned is not None:
        return Sharded(lambda n, inner: make_optimizer(name, n, xp, dtype, momentum, weight_decay=weight_decay,
                                                       fused=fused, steps=steps, betas=betas, decay_ranges=inner),
                       owned, size, ranges)
    if fused == "auto":
        fused = fuse_pays(xp, size, steps)
    cls = OPTIMIZERS[name]
    return cls(size, xp, dtype, weight_decay=weight_decay, fused=fused, decay_ranges=ranges,
               **cls.hyper(momentum, betas))
