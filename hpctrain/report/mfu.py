"""Model FLOPs utilisation (issue 60 §2): how close to the machine a run is.
The final record's `mfu` is the model's training FLOPs per second (its
samples/s times what a sample costs forward and backward: nn/spec.py
train_flops, a multiply-add 2 FLOPs, recomputation not counted, as
PaLM's MFU counts) over what the ranks' SGEMM does on the same cores: a
float32 product measured here by CPU time, once per process (tens of ms),
times the cores a rank computes with (its compute threads, nn/threads.py).
`sgemm_gflops` (a rank's) is in the record beside it, and `python -m
hpctrain.bench compare` prints the MFU of hpctrain and of PyTorch.

    python -m hpctrain.report.mfu            # one core's SGEMM GFLOP/s
"""
import functools
import os
import time

import numpy as np

# An n x n product: 0.27 GFLOP at n = 512, under 3 ms on one core of the
# 2-core EPYC (94-104 GFLOP/s at n 256 or 512 on one thread, as at 1024), so
# the best of a few fits in SECONDS: every run's end pays it, and the test
# suite runs hundreds.
N = 512
SECONDS = 0.03
LEAST = 3


def sgemm_gflops(seconds=SECONDS, n=N, least=LEAST):
    """GFLOP/s of one core on an n x n float32 product: its multiply-adds
    over the least CPU time of the runs in `seconds` (at least `least`).
    CPU time, not the wall clock: what other processes take of a shared
    machine is left out (python -m hpctrain.bench layers measures so)."""
    from ..nn import blas, threads
    a, b = np.ones((n, n), np.float32), np.ones((n, n), np.float32)
    out = np.empty((n, n), np.float32)
    # BLAS at one thread meanwhile where OpenBLAS lets this thread say so:
    # its idle helpers spin, and their CPU time would halve the figure
    hold = threads._blas_local_threads()
    before = hold(1) if hold else None
    try:
        best, runs, end = float("inf"), 0, time.perf_counter() + seconds
        while runs < least or time.perf_counter() < end:
            t = time.process_time()
            blas.matmul(np, a, b, out)   # the library the layers' products use (--blas)
            best = min(best, time.process_time() - t)
            runs += 1
    finally:
        if hold:
            hold(before)
    return 2 * n ** 3 / max(best, 1e-9) / 1e9


@functools.lru_cache(maxsize=None)
def core_gflops():
    """sgemm_gflops, measured once a process."""
    return sgemm_gflops()


def train_flops_per_sample(spec):
    """FLOPs a training sample costs, forward and backward (nn/spec.py train_flops: multiply-adds)."""
    return 2 * float(sum(spec.train_flops()))


def mfu(spec, samples_per_s, ranks, threads):
    """(mfu, sgemm_gflops): the model's FLOPs per second at samples_per_s
    (the whole job's) over `ranks` computing ranks' SGEMM, `threads` cores
    each (a rank's peak its cores' SGEMM: the 2-core EPYC's 103 GFLOP/s on
    one thread, 207 on two)."""
    peak = core_gflops() * threads
    return train_flops_per_sample(spec) * samples_per_s / (ranks * peak * 1e9), peak


if __name__ == "__main__":
    print(f"SGEMM {core_gflops():.1f} GFLOP/s a core ({N} x {N}, CPU time), {os.cpu_count()} cores")
