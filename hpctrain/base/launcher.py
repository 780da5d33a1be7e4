"""Who this process is in a job, as the launcher's variables say (SLURM,
Open MPI, MPICH/Hydra, PMIx), read before MPI starts so that MPI is not
initialized just to ask: run/cluster.py's settings made before MPI_Init,
`hpctrain data verify`'s choice to start MPI at all, the tests' passes.
Standard library only.

    python -c "from hpctrain.base.launcher import launcher_env; print(launcher_env())"
"""
import os

# (rank, size, local rank, local size) variables, per launcher, in the order we trust them.
_LAUNCHER_VARS = [
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),          # MPICH Hydra
    ("PMIX_RANK", None, "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
]


def _int(env, name):
    try:
        return int(env[name]) if name and name in env else None
    except ValueError:
        return None


def _slurm_local_size(env):
    """SLURM_TASKS_PER_NODE looks like '4' or '2(x3),1'; this node's entry is
    SLURM_NODEID's. Good enough for the (homogeneous) jobs we launch."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    counts = []
    for part in spec.split(","):
        if "(x" in part:
            n, rep = part.rstrip(")").split("(x")
            counts += [int(n)] * int(rep)
        else:
            counts.append(int(part))
    node = _int(env, "SLURM_NODEID") or 0
    return counts[node] if node < len(counts) else counts[0]


def launcher_env(env=None):
    """(rank, size, local_rank, local_size) as the launcher told us, before MPI
    starts; missing values are None (plain `python`, or an unknown launcher)."""
    env = os.environ if env is None else env
    for rank_v, size_v, lrank_v, lsize_v in _LAUNCHER_VARS:
        rank = _int(env, rank_v)
        if rank is None:
            continue
        size = _int(env, size_v)
        local_rank = _int(env, lrank_v)
        local_size = _int(env, lsize_v)
        if rank_v == "SLURM_PROCID":
            local_size = _slurm_local_size(env)
        elif (local_rank is None or local_size is None) and _int(env, "SLURM_PROCID") == rank \
                and size in (None, _int(env, "SLURM_NTASKS")):
            # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE but not Hydra's node-local
            # MPI_LOCALRANKID/MPI_LOCALNRANKS: SLURM's variables of this very
            # task (same rank and size) say it.
            if local_rank is None:
                local_rank = _int(env, "SLURM_LOCALID")
            if local_size is None:
                local_size = _slurm_local_size(env)
        return rank, size, local_rank, local_size
    return None, None, None, None


def in_mpi_job(env=None):
    """True when this process is one rank of a multi-rank job, as the
    launcher's variables say (before MPI starts, so MPI is not initialized
    just to ask)."""
    env = os.environ if env is None else env
    _, size, _, _ = launcher_env(env)
    size = size if size is not None else _int(env, "PMIX_SIZE")
    return (size or 1) > 1
