"""hpctrain's ring allreduce against MPI's native Allreduce, in one run.

    python -m hpctrain.bench allreduce --ranks 2          # launches mpirun -n 2 itself
    mpirun -n 4 python -m hpctrain.bench allreduce        # or run it under your launcher

For each size, the two algorithms alternate (so machine noise hits both), each
iteration starts after a barrier, and an iteration's time is the slowest
rank's. Reported: median time, algbw = S/t and busbw = algbw * 2(N-1)/N (the
nccl-tests definitions, so busbw is comparable across rank counts).
"""
import json
import sys
import time

import numpy as np

from ..cluster import in_mpi_job
from .common import launch, table

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"


def parse_size(text):
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def measure(comm, sizes, device="cpu", min_time=0.3, max_iters=200):
    from ..comm import make_allreduce
    from ..comm.topology import Topology
    from .. import device as dev
    xp, _, _ = dev.select(device)
    with Topology(comm) as topology:  # GPU: direct on a CUDA-aware MPI, else staged
        strategies = {name: make_allreduce(name, topology, xp) for name in ("ring", "mpi")}
    size, rows = comm.Get_size(), []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        buf = xp.ones(n, np.float32)
        for strategy in strategies.values():  # warm-up: connections, scratch buffers
            strategy.allreduce(buf)
        # iterations: enough for ~min_time per algorithm, decided on rank 0
        t0 = time.perf_counter()
        strategies["mpi"].allreduce(buf)
        est = np.array([time.perf_counter() - t0])
        comm.Bcast(est, root=0)
        iters = int(min(max_iters, max(5, min_time / max(est[0], 1e-6))))
        times = {name: np.empty(iters) for name in strategies}
        for i in range(iters):
            for name, strategy in strategies.items():
                buf.fill(1.0)
                dev.synchronize(xp)
                comm.Barrier()
                t = time.perf_counter()
                strategy.allreduce(buf)
                dev.synchronize(xp)
                times[name][i] = time.perf_counter() - t
        row = {"bytes": n * 4, "ranks": size, "iters": iters}
        for name, t in times.items():
            from mpi4py import MPI
            comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
            med = float(np.median(t))
            algbw = n * 4 / med / 1e9
            row[f"{name}_us"] = med * 1e6
            row[f"{name}_busbw"] = algbw * 2 * (size - 1) / size
        row["ratio_busbw"] = row["ring_busbw"] / row["mpi_busbw"] if row["mpi_busbw"] else None
        row["ratio_latency"] = row["ring_us"] / row["mpi_us"]
        rows.append(row)
    return rows


COLUMNS = [("bytes", "bytes", "{:,}"), ("ring us", "ring_us", "{:,.1f}"), ("mpi us", "mpi_us", "{:,.1f}"),
           ("ring busbw GB/s", "ring_busbw", "{:.2f}"), ("mpi busbw GB/s", "mpi_busbw", "{:.2f}"),
           ("ring/mpi busbw", "ratio_busbw", "{:.2f}"), ("ring/mpi time", "ratio_latency", "{:.2f}")]


def main(args):
    if not in_mpi_job():
        argv = [a for a in sys.argv[1:]]
        r = launch(args.ranks, ["-m", "hpctrain.bench", *argv])
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        return r.returncode
    from ..cluster import configure_process
    configure_process()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rows = measure(comm, [parse_size(s) for s in args.sizes.split(",")], args.device)
    if comm.rank == 0:
        if args.json:
            print(json.dumps({"bench": "allreduce", "ranks": comm.size, "device": args.device, "rows": rows}))
        else:
            print(f"allreduce, {comm.size} ranks, float32, {args.device}: median of the slowest rank per iteration")
            print(table(rows, COLUMNS))
    return 0
