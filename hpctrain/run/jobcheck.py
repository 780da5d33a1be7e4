"""The job's first log line, and the check that the launcher made ONE MPI world.

A plain `srun` (no `--mpi=pmi2`/`pmix` for the MPI library at hand) starts N
independent processes that each initialize MPI as a singleton: N worlds of
size 1, each training alone and all writing the same checkpoints. The job
scripts export `HPCTRAIN_EXPECT_WORLD_SIZE=$SLURM_NTASKS`; `check_world()`
compares it with the MPI world size and stops every rank with one clear line
(exit 2) when they differ. Then, on the chief, it prints the layout:

    hpctrain: world size 4 (as expected), 1 host: node1 x4; rank -> host/local rank/GPU/pid: 0 -> node1/0/-/4242, ...

The GPU column is the device a rank binds to, `local_rank % gpus_on_node`
(local rank from the MPI shared-memory split, GPU count from CuPy); "-" where
CuPy is not installed or sees no GPU. The pid is the rank's process id: a
rank killed by a signal (SIGKILL: the kernel's OOM killer) ends an MPICH job
with a banner that names only a PID and a host, and this line says which
rank that was. Where jobs/launch.sh runs the job (HPCTRAIN_RANKS_FILE), the
chief also writes the map there, one rank a line (rank host pid), and the
job script names the rank behind the banner's PID itself. No pickle: the map
is gathered as fixed-size byte records.

    HPCTRAIN_EXPECT_WORLD_SIZE=4 mpirun -n 4 python -m hpctrain.run.jobcheck
"""
import importlib.util
import os
import sys

import numpy as np

from ..comm.records import gather_bytes
from ..base.errors import HpctrainError
from ..base.files import write_atomically

ENV_EXPECT = "HPCTRAIN_EXPECT_WORLD_SIZE"
ENV_RANKS_FILE = "HPCTRAIN_RANKS_FILE"
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
        write_ranks_file(records, env)


def gather_layout(cluster):
    """(host, local_rank, gpu, pid) per rank, on the chief; None elsewhere."""
    gpus = gpus_on_node()
    gpu = cluster.local_rank % gpus if gpus else -1
    nums = np.array([cluster.local_rank, gpu, os.getpid()], np.int64)
    # An impossible layout (--num-ps >= world size) has no chief: gather to
    # rank 0 then, and let validation report the layout right after.
    root = cluster.chief_rank if cluster.chief_rank < cluster.size else 0
    is_root = cluster.rank == root
    size = cluster.size
    all_hosts = gather_bytes(cluster.comm, cluster.host, HOST_BYTES, root=root)
    all_nums = np.empty((size, len(nums)), np.int64) if is_root else None
    cluster.comm.Gather(nums, all_nums, root=root)
    if not is_root:
        return None
    return [(all_hosts[r], *map(int, all_nums[r])) for r in range(size)]


def write_ranks_file(records, env=None):
    """The map for jobs/launch.sh, where it asked for it (HPCTRAIN_RANKS_FILE):
    `rank host pid` a line, written whole. A failure is a warning: the map is
    also on the first line of the log."""
    env = os.environ if env is None else env
    path = env.get(ENV_RANKS_FILE)
    if not path:
        return
    lines = "".join(f"{r} {host} {pid}\n" for r, (host, _, _, pid) in enumerate(records))
    try:
        write_atomically(path, lambda f: f.write(lines))
    except OSError as e:
        print(f"hpctrain: warning: {ENV_RANKS_FILE} {path}: cannot write ({e.strerror or e}); the job script "
              f"cannot name a rank that dies by its pid", file=sys.stderr, flush=True)


def layout_line(records, expected=None):
    """One line: world size, hosts (with ranks per host), rank -> host/local/GPU/pid."""
    size = len(records)
    per_host = {}
    for host, *_ in records:
        per_host[host] = per_host.get(host, 0) + 1
    hosts = ", ".join(f"{h} x{n}" for h, n in per_host.items())
    said = "as expected" if expected == size else (f"expected {expected}" if expected else "no expected size set")

    def entry(r):
        host, local, gpu, pid = records[r]
        return f"{r} -> {host}/{local}/{gpu if gpu >= 0 else '-'}/{pid}"

    if size <= MAP_MAX_RANKS:
        shown = ", ".join(entry(r) for r in range(size))
    else:
        half = MAP_MAX_RANKS // 2
        shown = (", ".join(entry(r) for r in range(half)) + f", ... ({size - 2 * half} more), "
                 + ", ".join(entry(r) for r in range(size - half, size)))
    return (f"hpctrain: world size {size} ({said}), {len(per_host)} host"
            f"{'' if len(per_host) == 1 else 's'}: {hosts}; rank -> host/local rank/GPU/pid: {shown}")


if __name__ == "__main__":
    from mpi4py import MPI
    from .cluster import Cluster
    c = Cluster(MPI.COMM_WORLD)
    try:
        check_world(c, lambda text: print(text, flush=True) if c.is_chief else None)
    except HpctrainError as exc:
        if exc.report:
            print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
