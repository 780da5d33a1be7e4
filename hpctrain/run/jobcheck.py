"""The job's first log line, and the check that the launcher made ONE MPI world.

A plain `srun` (no `--mpi=pmi2`/`pmix` for the MPI library at hand) starts N
independent processes that each initialize MPI as a singleton: N worlds of
size 1, each training alone and all writing the same checkpoints. The job
scripts export `HPCTRAIN_EXPECT_WORLD_SIZE=$SLURM_NTASKS`; `check_world()`
compares it with the MPI world size and stops every rank with one clear line
(exit 2) when they differ. Then, on the chief, it prints the layout:

    hpctrain: world size 4 (as expected), 1 host: node1 x4; rank -> host/local rank/GPU: 0 -> node1/0/-, ...

The GPU column is the device a rank binds to, `local_rank % gpus_on_node`
(local rank from the MPI shared-memory split, GPU count from CuPy); "-" where
CuPy is not installed or sees no GPU. No pickle: the map is gathered as
fixed-size byte records.

    HPCTRAIN_EXPECT_WORLD_SIZE=4 mpirun -n 4 python -m hpctrain.run.jobcheck
"""
import importlib.util
import os

import numpy as np

from ..comm.records import gather_bytes
from ..errors import HpctrainError

ENV_EXPECT = "HPCTRAIN_EXPECT_WORLD_SIZE"
HOST_BYTES = 64
# Beyond this many ranks the map lists the first and last ranks only.
MAP_MAX_RANKS = 64


def expected_world_size(env=None):
    """The size the job script asked for, or None when it did not say."""
    env = os.environ if env is None else env
    text = env.get(ENV_EXPECT, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise HpctrainError(f"{ENV_EXPECT}={text!r}: expected a positive number of ranks")
    return value


def gpus_on_node():
    """CUDA devices this process can see (0 without CuPy or without a GPU).
    Only the device count: no CUDA context is created."""
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, no device, broken install: all mean "no GPU here"
        return 0


def check_world(cluster, log, env=None):
    """Stop (HpctrainError, exit 2, on every rank) when the world is not the
    size the job script expects; otherwise log the layout from the chief.
    Collective over cluster.comm."""
    try:
        expected = expected_world_size(env)
    except HpctrainError as exc:  # the same environment on every rank: a clean, collective stop
        exc.collective, exc.report = True, cluster.rank == 0
        raise
    if expected is not None and expected != cluster.size:
        # Every rank of every world computes the same thing here, so each
        # world's rank 0 reports and all ranks exit without waiting on anyone.
        raise HpctrainError(
            f"expected one MPI world of {expected} ranks, got size {cluster.size} "
            f"(srun without --mpi=pmi2? set HPCTRAIN_SRUN_MPI)",
            collective=True, report=cluster.rank == 0)
    records = gather_layout(cluster)
    if records is not None:
        log(layout_line(records, expected))


def gather_layout(cluster):
    """(host, local_rank, gpu) per rank, on the chief; None elsewhere."""
    gpus = gpus_on_node()
    gpu = cluster.local_rank % gpus if gpus else -1
    nums = np.array([cluster.local_rank, gpu], np.int32)
    # An impossible layout (--num-ps >= world size) has no chief: gather to
    # rank 0 then, and let validation report the layout right after.
    root = cluster.chief_rank if cluster.chief_rank < cluster.size else 0
    is_root = cluster.rank == root
    size = cluster.size
    all_hosts = gather_bytes(cluster.comm, cluster.host, HOST_BYTES, root=root)
    all_nums = np.empty((size, 2), np.int32) if is_root else None
    cluster.comm.Gather(nums, all_nums, root=root)
    if not is_root:
        return None
    return [(all_hosts[r], int(all_nums[r, 0]), int(all_nums[r, 1])) for r in range(size)]


def layout_line(records, expected=None):
    """One line: world size, hosts (with ranks per host), rank -> host/local/GPU."""
    size = len(records)
    per_host = {}
    for host, _, _ in records:
        per_host[host] = per_host.get(host, 0) + 1
    hosts = ", ".join(f"{h} x{n}" for h, n in per_host.items())
    said = "as expected" if expected == size else (f"expected {expected}" if expected else "no expected size set")

    def entry(r):
        host, local, gpu = records[r]
        return f"{r} -> {host}/{local}/{gpu if gpu >= 0 else '-'}"

    if size <= MAP_MAX_RANKS:
        shown = ", ".join(entry(r) for r in range(size))
    else:
        half = MAP_MAX_RANKS // 2
        shown = (", ".join(entry(r) for r in range(half)) + f", ... ({size - 2 * half} more), "
                 + ", ".join(entry(r) for r in range(size - half, size)))
    return (f"hpctrain: world size {size} ({said}), {len(per_host)} host"
            f"{'' if len(per_host) == 1 else 's'}: {hosts}; rank -> host/local rank/GPU: {shown}")


if __name__ == "__main__":
    import sys
    from mpi4py import MPI
    from .cluster import Cluster
    c = Cluster(MPI.COMM_WORLD)
    try:
        check_world(c, lambda text: print(text, flush=True) if c.is_chief else None)
    except HpctrainError as exc:
        if exc.report:
            print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
