"""python -m hpctrain.optim: one Adam step over the default MLP's 650k
parameters, timed on both paths (base.py: the NumPy blocks and the
single pass)."""
import time

import numpy as np

from .adam import Adam
from ..base.precision import FLOAT32

n = 784 * 500 + 500 + 500 * 500 + 500 + 500 * 10 + 10   # MNIST's default model
p = np.zeros(n, FLOAT32.params)
g = np.random.default_rng(0).standard_normal(n).astype(FLOAT32.grads)
for fused, what in ((False, "NumPy blocks"), (True, "single pass")):
    opt = Adam(n, fused=fused)
    if fused and opt._kernel is None:
        print("single pass: numba is not installed (pip install 'hpctrain[fast]')")
        continue
    for _ in range(10):
        opt.step(p, g, 1e-4)
    t0 = time.perf_counter()
    for _ in range(200):
        opt.step(p, g, 1e-4)
    print(f"Adam step over {n} parameters, {what}: {(time.perf_counter() - t0) / 200 * 1e3:.3f} ms")
