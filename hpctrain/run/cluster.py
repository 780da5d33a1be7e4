"""The MPI world turned into roles: parameter servers, workers, the chief;
node-local ranks; and this node's facts (cores, memory, /dev/shm).

Two halves, because some settings must be made before MPI (and BLAS) start:
- `launcher_env()` / `configure_process()`: read the launcher's variables
  (SLURM, Open MPI, MPICH/Hydra, PMIx) and set progress throttling for
  oversubscribed nodes and BLAS threads per rank, and pick this rank's GPU
  (`bind_gpu`: some CUDA-aware MPIs need the device set before MPI_Init),
  and check that /dev/shm has the room MPICH takes in MPI_Init
  (`check_shm_room`). Standard library only, apart from CuPy for the GPU.
- `Cluster(comm, mode, num_ps, ps_rule)`: after MPI_Init, the roles and
  communicators; which ranks serve (`server_ranks`: --ps-ranks first|spread);
  `Cluster.confirm_gpu_binding()` checks the GPU choice against MPI's own
  node-local rank.

    mpirun -n 4 python -m hpctrain.run.cluster --mode ps --num-ps 2 --ps-ranks spread   # prints the layout
"""
import os
import socket

from ..base.errors import HpctrainError
from ..base.launcher import launcher_env

# The variables by which a launcher tells its ranks who they are.
_LAUNCHER_PREFIXES = ("PMI_", "MPI_LOCAL", "OMPI_", "PMIX_", "HYDRA_")
# ...except the user's own choices, which no launcher sets: Open MPI as root.
_USER_SETTINGS = ("OMPI_ALLOW_RUN_AS_ROOT",)


def child_env(env=None, also=()):
    """The environment for a job started from inside another (a benchmark or a
    test launching mpirun): without our launcher's variables, so the child
    never joins our world; `also`: more prefixes to drop (e.g. "SLURM_")."""
    env = dict(os.environ if env is None else env)
    for var in [v for v in env if v.startswith(_LAUNCHER_PREFIXES + tuple(also))
                and not v.startswith(_USER_SETTINGS)]:
        env.pop(var)
    return env


def cores_available():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def oversubscribed(local_size):
    """More ranks on this node than cores: a rank that waits must not
    busy-poll the cores the computing ranks need (comm/waits.py)."""
    return (local_size or 1) > cores_available()


def throttle_idle_mpi(local_size, env=None):
    """Before MPI_Init, where this node's ranks outnumber its cores: MPI's
    idle progress yields the core (MPICH's progress throttle, Open MPI's
    yield_when_idle) instead of busy-polling it beside the ranks that
    compute; a variable the user set is left alone. Training's ranks
    (configure_process) and hpctrain.dist.init() both set it here. Returns
    whether the node is oversubscribed."""
    env = os.environ if env is None else env
    if not oversubscribed(local_size):
        return False
    for var in ("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "OMPI_MCA_mpi_yield_when_idle"):
        env.setdefault(var, "1")
    return True


def threads_per_rank(env=None):
    """The cores one rank of this node gets: a launcher that binds ranks to
    cores leaves each rank fewer cores than the node has, and then those
    cores are all its own; otherwise the node's cores shared out."""
    _, _, _, local_size = launcher_env(os.environ if env is None else env)
    cores = cores_available()
    bound = cores < (os.cpu_count() or cores)
    return cores if bound else max(1, cores // (local_size or 1))


def pin_blas(env=None, threads=None):
    """Before numpy loads: BLAS's threads for this process, one where it has
    compute threads of its own (nn/threads.py: the cores threads_per_rank
    gives it, or --threads), else the cores it has; a variable the user set
    is left alone. Training's ranks (configure_process) and the one-process
    commands (generate, evaluate, predict: one_process) both take it from
    here. Returns the compute threads to configure (nn/threads.configure)
    once numpy is loaded."""
    env = os.environ if env is None else env
    # Two BLAS threads on the small GEMMs of a convolution gained nothing or
    # lost (their helper spinning beside our threads: resnet at one rank,
    # 568-651 samples/s against 764-856 with BLAS at one thread); the MLP
    # ran the same either way, its wide Dense layers split by our threads.
    per_rank = threads_per_rank(env)
    blas = 1 if (threads or per_rank) > 1 else per_rank
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, str(blas))
    return threads or per_rank


def one_process(env=None):
    """A command that computes in one process (generate, evaluate, predict),
    before numpy loads: BLAS's threads as training sets them for a rank alone
    on this node (pin_blas). Left at OpenBLAS's default (a thread per core,
    spinning while it waits), `hpctrain generate` took 40-67 s for 300
    characters on a busy 2-core machine, 12-17x what one thread took.
    Returns the compute threads for nn/threads.configure."""
    return pin_blas(env)


def configure_process(env=None, device="auto", threads=None):
    """Before numpy and MPI load: when more ranks than cores share this node,
    make idle MPI ranks yield instead of busy-polling the cores that the
    computing ranks need, give each rank's cores to its compute threads
    (`threads`, --threads: nn/threads.py) with BLAS at one thread, or where
    there is one (or --threads 1) to BLAS's threads, keep
    Open MPI's osc/ucx out of the way, refuse a /dev/shm too small for
    MPICH (check_shm_room: HpctrainError), and (--device gpu|auto) bind this
    rank's GPU. A variable the user set is left alone. Returns a note for the log."""
    env = os.environ if env is None else env
    _, _, local_rank, local_size = launcher_env(env)
    local_size = local_size or 1
    cores = cores_available()
    notes = []
    if throttle_idle_mpi(local_size, env):
        notes.append(f"{local_size} ranks on {cores} cores: MPI progress throttled")
    pin_blas(env, threads)
    notes.append(f"BLAS threads per rank: {env['OPENBLAS_NUM_THREADS']}")
    # Our one RMA window is ps's node-local shared memory (comm/ps/shared.py),
    # Open MPI's osc/sm; osc/ucx, queried first, prints an "Error" line per
    # rank where UCX has no RMA transport (a node without InfiniBand).
    env.setdefault("OMPI_MCA_osc", "^ucx")
    check_shm_room(env)
    gpu = bind_gpu(device, env)
    if gpu:
        notes.append(gpu)
    return "; ".join(notes)


SHM_DIR = "/dev/shm"


def mpich_shm_mb(local_size):
    """MB of /dev/shm that MPICH may take in MPI_Init for local_size ranks on
    one node. Measured (MPICH 5.0, ch4): 5.15 MB per rank when there is room;
    with less it dies of SIGBUS or SIGSEGV (1 rank: 16 MB; 2: 20; 4: 24; 8: 46;
    16: 88 MB), or falls back to 1 MB per rank below a few MB. With margin."""
    return 6 * local_size + 16


def check_shm_room(env=None, path=SHM_DIR):
    """Before MPI_Init: a /dev/shm too small for MPICH (4-20 MB in a container)
    kills every rank in MPI_Init with no line of ours; say it in one (the
    node's local rank 0 says it, every rank of the node exits 2). Open MPI's
    mpirun is not checked: its need was not measured."""
    env = os.environ if env is None else env
    _, _, local_rank, local_size = launcher_env(env)
    if any(v.startswith("OMPI_COMM_WORLD_") for v in env):
        return
    try:
        st = os.statvfs(path)
    except OSError:
        return   # no /dev/shm: MPICH uses what it finds; nothing to measure
    local_size = local_size or 1
    free, need = st.f_bavail * st.f_frsize / 2**20, mpich_shm_mb(local_size)
    if free < need:
        # Rounded down, the free MB always reads as less than the need.
        raise HpctrainError(
            f"{path} on {socket.gethostname()} has {int(free * 10) / 10:.1f} MB free; MPICH needs "
            f"about {need} MB there for {local_size} rank{'s' if local_size > 1 else ''} on this node "
            f"(it dies in MPI_Init with less): mount a bigger {path} (docker run --shm-size=1g; "
            f"mount -o remount,size=1G {path}) or start fewer ranks per node",
            report=not local_rank)


# What bind_gpu did before MPI started, for Cluster.confirm_gpu_binding after.
_GPU_BINDING = {"device": None, "local_rank": None, "count": 0}


def _cupy():
    try:
        import cupy
        return cupy
    except Exception:  # not installed, or a broken CUDA: device.select says why, later
        return None


def gpu_for(local_rank, gpu_count):
    """The GPU of a rank: node-local ranks dealt round-robin over the visible
    GPUs (a launcher that gives each rank its own CUDA_VISIBLE_DEVICES leaves
    one visible, so every rank takes its device 0)."""
    return local_rank % gpu_count


def bind_gpu(device="auto", env=None, cupy=None):
    """Before MPI_Init, with --device gpu|auto: make GPU local_rank % visible
    GPUs this process's CUDA device (cupy.cuda.Device(i).use()), local_rank
    from the launcher. Devices are counted with cudaGetDeviceCount, which
    creates no CUDA context, so no rank touches GPU 0 on the way to its own;
    nothing is hidden with CUDA_VISIBLE_DEVICES, so CUDA IPC between ranks
    keeps working. Without CuPy, a GPU or a launcher local rank this does
    nothing (confirm_gpu_binding decides after MPI starts). Returns a note."""
    if device == "cpu":
        return ""
    cupy = _cupy() if cupy is None else cupy
    if cupy is None:
        return ""
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return ""
    if count < 1:
        return ""
    _, _, local_rank, _ = launcher_env(env)
    _GPU_BINDING.update(device=None, local_rank=local_rank, count=count)
    if local_rank is None:
        return ""
    chosen = gpu_for(local_rank, count)
    cupy.cuda.Device(chosen).use()
    _GPU_BINDING["device"] = chosen
    return f"GPU {chosen} of {count} (launcher local rank {local_rank})"


PS_RULES = ("spread", "first")


def server_ranks(node_of, num_ps, rule="spread"):
    """The world ranks of the parameter servers, sorted (ps task k is the k-th
    of them). node_of: the node index of every world rank (nodes numbered by
    their lowest rank, as comm/topology.py numbers them). first: ranks
    0..num_ps-1. spread: server k goes to node k mod M (M nodes), to the
    lowest rank there not taken yet; a node with no rank left is skipped for
    the next one. On one node both give 0..num_ps-1. More servers than ranks:
    every rank (cli.validate refuses that layout right after)."""
    size = len(node_of)
    num_ps = min(num_ps, size)
    if rule == "first":
        return list(range(num_ps))
    if rule != "spread":
        raise ValueError(f"unknown --ps-ranks rule {rule!r} (choose from {', '.join(PS_RULES)})")
    free = {}   # node -> its ranks not taken yet, lowest first
    for rank, node in enumerate(node_of):
        free.setdefault(node, []).append(rank)
    nodes = sorted(free)
    taken = []
    for k in range(num_ps):
        i = k % len(nodes)
        while not free[nodes[i]]:   # this node is all servers already: the next one
            i = (i + 1) % len(nodes)
        taken.append(free[nodes[i]].pop(0))
    return sorted(taken)


class Cluster:
    """Roles of every rank. ring: all ranks are workers, rank 0 is the chief.
    ps: num_ps ranks are servers (which ones: `server_ranks(node_of, num_ps,
    ps_rule)`, the same on every rank), the rest workers. Servers are ps task
    0..K-1 in the order of their world ranks (ps_index), workers 0..W-1 in the
    order of theirs (worker_index); the chief is worker 0, the lowest worker
    rank. Collective over comm."""

    def __init__(self, comm, mode="ring", num_ps=0, ps_rule="spread"):
        from mpi4py import MPI
        from ..comm.records import allgather_bytes
        from ..comm.topology import HOST_BYTES, nodes_of
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.mode = mode
        self.num_ps = num_ps if mode == "ps" else 0
        self.ps_rule = ps_rule
        # Node-local rank from the MPI shared-memory split: the truth, whatever the launcher says.
        self.local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self.local_comm.Get_rank()
        self.local_size = self.local_comm.Get_size()
        self.node_of = nodes_of(comm, self.local_comm)
        self.num_nodes = max(self.node_of) + 1
        self.host = socket.gethostname()
        self.hosts = allgather_bytes(comm, self.host, HOST_BYTES)
        self.ps_ranks = list(server_ranks(self.node_of, self.num_ps, ps_rule))
        self._task = {r: k for k, r in enumerate(self.ps_ranks)}   # world rank -> ps task
        self.worker_ranks = [r for r in range(self.size) if r not in self._task]
        self._worker = {r: w for w, r in enumerate(self.worker_ranks)}   # world rank -> worker task
        self.num_workers = len(self.worker_ranks)
        self.is_ps = self.rank in self._task
        self.is_worker = not self.is_ps
        self.worker_index = self._worker.get(self.rank)
        self.ps_index = self._task.get(self.rank)
        # No worker (--num-ps >= world size, refused by cli.validate next): no chief.
        self.chief_rank = self.worker_ranks[0] if self.worker_ranks else self.size
        self.is_chief = self.rank == self.chief_rank
        # Workers' own communicator (ring allreduce, evaluation), ordered by
        # world rank, so its rank 0 is the chief: servers get COMM_NULL.
        color = 0 if self.is_worker else MPI.UNDEFINED
        self.worker_comm = comm.Split(color, self.rank)
        # The servers' own (ps mode), ordered by world rank: a collective
        # among them alone (--clip-norm's norm of the aggregate); COMM_NULL
        # on workers, and on every rank in ring mode.
        self.ps_comm = comm.Split(0 if self.is_ps else MPI.UNDEFINED, self.rank)

    def confirm_gpu_binding(self, device="auto", cupy=None):
        """After MPI_Init, on every rank (collective over comm): the GPU must be
        local_rank % GPUs with local_rank from MPI's shared-memory split. Ranks
        whose launcher variables disagreed (or were missing) are rebound now;
        the chief's note says how many. Call before any CuPy allocation."""
        from mpi4py import MPI
        import numpy as np
        counts = np.zeros(3, np.int64)   # [ranks on a GPU, launcher disagreed, no launcher local rank]
        note = ""
        cupy = None if device == "cpu" else (_cupy() if cupy is None else cupy)
        if cupy is not None:
            try:
                count = cupy.cuda.runtime.getDeviceCount()
            except Exception:
                count = 0
            if count:
                want = gpu_for(self.local_rank, count)
                launcher = _GPU_BINDING["local_rank"]
                counts[0] = 1
                if _GPU_BINDING["count"]:   # bind_gpu ran before MPI_Init
                    if launcher is None:
                        counts[2] = 1
                    elif launcher != self.local_rank:
                        counts[1] = 1
                if _GPU_BINDING["device"] != want:
                    cupy.cuda.Device(want).use()
                    _GPU_BINDING["device"] = want
                share = -(-self.local_size // count)
                note = (f"GPU {want} of {count} by node-local rank {self.local_rank}/{self.local_size}"
                        + (f", up to {share} ranks per GPU" if share > 1 else ""))
        self.comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
        if counts[1] and self.is_chief:
            import sys
            print(f"hpctrain: warning: on {counts[1]} of {counts[0]} GPU ranks the launcher's local rank "
                  f"disagreed with MPI's node-local rank; those ranks were rebound to MPI's choice "
                  f"after MPI_Init", file=sys.stderr, flush=True)
        if counts[2]:
            note += f"; {counts[2]} of {counts[0]} ranks bound after MPI start (no launcher local rank)"
        return note

    def role_name(self, rank=None):
        """TensorFlow's naming: /job:ps/task:0, /job:worker/task:1."""
        rank = self.rank if rank is None else rank
        if rank in self._task:
            return f"/job:ps/task:{self._task[rank]}"
        return f"/job:worker/task:{self._worker[rank]}"

    def servers_line(self):
        """Where each server is: one line for the start-up log."""
        shown = [f"{self.role_name(r)} = rank {r} on {self.hosts[r]}" for r in self.ps_ranks[:16]]
        more = f", ... ({len(self.ps_ranks) - 16} more)" if len(self.ps_ranks) > 16 else ""
        nodes = f"{self.num_nodes} node{'s' if self.num_nodes > 1 else ''}"
        return f"ps servers (--ps-ranks {self.ps_rule}, {nodes}): " + ", ".join(shown) + more


if __name__ == "__main__":
    from ..flags.arguments import Parser
    p = Parser()
    p.add_argument("--mode", default="ring")
    p.add_argument("--num-ps", type=int, default=1)
    p.add_argument("--ps-ranks", choices=PS_RULES, default="spread")
    a = p.parse_args()
    note = configure_process()
    from mpi4py import MPI
    c = Cluster(MPI.COMM_WORLD, a.mode, a.num_ps, a.ps_ranks)
    print(f"{c.role_name()} = rank {c.rank} on {c.host} (local {c.local_rank}/{c.local_size}; {note})")
