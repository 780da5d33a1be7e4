"""hpctrain.dist's start and end, who is where, and process sets: init(),
shutdown(), rank(), size(), local_rank(), local_size(), cross_rank(),
cross_size(), ProcessSet.

init() starts MPI as the hpctrain program does (comm/start.py: under a
deadline, MPI_THREAD_MULTIPLE so the watchdog's roll call can name a rank
that stalled), or takes the communicator the user gives; it learns the
nodes (comm/topology.py: MPI's shared-memory split), makes the allreduce
hpctrain's training uses (comm/__init__.make_allreduce: the ring on one
node, the hierarchical ring across nodes) and starts the engine's thread
(engine.py). Every wait from then on is bounded by `timeout`
(HPCTRAIN_TIMEOUT, default the program's --timeout, 300 s): past it, the
job ends with one line naming the rank that stopped responding, exit 3.

Where a node's ranks outnumber its cores (4 ranks on 2 cores), init()
waits as the program does there (`wait_mode`, the program's --wait-mode):
MPI's idle progress throttled before MPI_Init (run/cluster.
throttle_idle_mpi), and each call's meeting, the fingerprint that comes
first (calls.py), and the ring's exchanges that follow (comm/
ring_allreduce.py's `waits`; across nodes, both of hier.py's rings) nap
(comm/waits.py) instead of busy-polling a core the other ranks compute on. The ring runs on the engine's thread
while the user's backward runs on the same shared cores: a spinning wait
there took the core from the very neighbour it waited for (the program's
ring, latency-bound between steps, keeps spinning). The ranks decide
together (one rank that naps makes them all meet through the napping
Ibarrier: the same calls everywhere).

A ProcessSet is a list of world ranks; its communicator, topology and
ring are made by its members at its first use (MPI_Comm_create_group,
collective over the members only), on the engine's thread, in call order.

    mpirun -n 2 python -c "import hpctrain.dist as hvd; hvd.init(); print(hvd.rank(), hvd.size())"
"""
import atexit
import os
import sys

from .errors import DistError, install_hook

DEFAULT_TIMEOUT = 300.0   # the program's --timeout default (flags/cli.py)
WAIT_MODES = ("auto", "nap", "spin")   # the program's --wait-mode (flags/cli.py)


class ProcessSet:
    """A subset of the world's ranks that runs collectives of its own
    (`process_set=` of every call). Ranks are world ranks, sorted."""

    def __init__(self, ranks):
        self.ranks = tuple(sorted({int(r) for r in ranks}))
        if not self.ranks:
            raise DistError("ProcessSet: no ranks")

    def included(self):
        """Whether this rank belongs to the set."""
        return _rt().world_rank in self.ranks

    def rank(self):
        return self.ranks.index(_rt().world_rank)

    def size(self):
        return len(self.ranks)

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and other.ranks == self.ranks

    def __hash__(self):
        return hash(self.ranks)

    def __repr__(self):
        return f"ProcessSet({list(self.ranks)})"


class Group:
    """A process set as this rank's members made it: comm (its own),
    rank, size, world_ranks, the topology and allreduce strategy, the
    16-bit rings made on first use. whole: the world's group (an error
    its ranks agree on is every rank's)."""

    def __init__(self, comm, watchdog, waits, whole):
        from ..comm import make_allreduce
        from ..comm.strategy import world_ranks
        from ..comm.topology import Topology
        import numpy as np
        self.comm, self.watchdog, self.waits, self.whole = comm, watchdog, waits, whole
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.world_ranks = world_ranks(comm)
        with watchdog.waiting("hpctrain.dist: a process set's topology and ring", peer=None):
            self.topology = Topology(comm)
            self.strategy = make_allreduce("auto", self.topology, np, watchdog, waits=waits)
        self._halves = {}

    def half(self, kind):
        """The strategy with 16-bit messages (comm/compressed_exchange.half_strategy)."""
        if kind not in self._halves:
            from ..comm.compressed_exchange import half_strategy
            from ..optim.compression_math import Half
            self._halves[kind] = half_strategy(self.strategy, Half(kind))
        return self._halves[kind]

    def free(self):
        if hasattr(self.strategy, "free"):   # the ring's and MPI's own duplicate
            self.strategy.free()
        self.topology.free()
        self.comm.Free()


class Runtime:
    """What init() made: the world's group, the engine, the watchdog, the process sets."""

    def __init__(self, comm, timeout, wait_mode):
        from ..base.launcher import launcher_env
        from ..comm.deadline import Watchdog
        from ..comm.start import start_mpi
        from ..run.cluster import oversubscribed, throttle_idle_mpi
        from .engine import Engine
        timeout = float(timeout if timeout is not None else os.environ.get("HPCTRAIN_TIMEOUT", DEFAULT_TIMEOUT))
        self.watchdog = Watchdog(timeout, launcher_env()[0] or 0, abort=os._exit)
        import mpi4py
        mpi4py.rc.initialize = False   # (start_mpi's own setting, before the first import of mpi4py.MPI)
        from mpi4py import MPI
        self.owns_mpi = comm is None and not MPI.Is_initialized()   # else the user's MPI: not finalized here
        if self.owns_mpi and wait_mode != "spin":
            throttle_idle_mpi(launcher_env()[3])   # read by MPI_Init: only where init() starts MPI
        MPI = start_mpi(self.watchdog)
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            with self.watchdog.waiting("hpctrain.dist.init (roll-call communicator)", peer=None):
                self.watchdog.roll_call_on(MPI.COMM_WORLD)
        else:
            self.watchdog.without_roll_call("the culprit could not be determined: MPI gives less than "
                                            "MPI_THREAD_MULTIPLE", abort=os._exit)
        self.MPI = MPI
        from ..comm.waits import Waits   # imports mpi4py.MPI: only once MPI is started
        base = comm if comm is not None else MPI.COMM_WORLD
        self.world_rank = base.Get_rank()   # ranks of a process set count in `base`
        with self.watchdog.waiting("hpctrain.dist.init", peer=None):
            self.waits = Waits(self._nap(base, wait_mode, oversubscribed))
            self.world = Group(base.Dup(), self.watchdog, self.waits, True)
        self.groups = {}
        self.engine = Engine()
        self.previous_hook = install_hook(self.leave, MPI.COMM_WORLD.Abort)

    def group(self, process_set):
        """The Group of process_set (None: the world's); made on first use (engine thread only)."""
        if process_set is None or process_set.ranks == tuple(range(self.world.size)):
            return self.world
        group = self.groups.get(process_set.ranks)
        if group is None:
            if self.world_rank not in process_set.ranks:
                raise DistError(f"rank {self.world_rank} is not in {process_set}: only its ranks call its collectives")
            world_group = self.world.comm.Get_group()
            sub = world_group.Incl(list(process_set.ranks))
            with self.watchdog.waiting(f"hpctrain.dist: making {process_set}", peer=list(process_set.ranks)):
                comm = self.world.comm.Create_group(sub)
            sub.Free()
            world_group.Free()
            group = self.groups[process_set.ranks] = Group(comm, self.watchdog, self.waits, False)
        return group

    def _nap(self, base, wait_mode, oversubscribed):
        """Whether the ranks nap: wait_mode's, or (auto) where any node has
        more ranks than cores, decided by all (one MAX over base)."""
        if wait_mode != "auto":
            return wait_mode == "nap"
        import numpy as np
        node = base.Split_type(self.MPI.COMM_TYPE_SHARED)
        mine = np.array([oversubscribed(node.Get_size())], np.int64)
        node.Free()
        base.Allreduce(self.MPI.IN_PLACE, mine, op=self.MPI.MAX)
        return bool(mine[0])

    def close(self):
        """The engine stopped, the communicators freed, the exception hook
        put back; MPI finalized if init() started it."""
        self.engine.stop()
        sys.excepthook = self.previous_hook
        with self.watchdog.waiting("hpctrain.dist.shutdown", peer=None):
            for group in self.groups.values():
                group.free()
            self.world.free()
        if self.owns_mpi:
            from ..comm.start import stop_mpi
            stop_mpi(self.watchdog)

    def leave(self):
        """Every rank raised the same error (a collective DistError): MPI is
        finalized under the deadline, as the program's way out does."""
        global _RUNTIME
        _RUNTIME = None
        if self.owns_mpi:
            from ..comm.start import stop_mpi
            try:
                stop_mpi(self.watchdog)
            except Exception:
                pass


_RUNTIME = None


def _rt():
    if _RUNTIME is None:
        raise DistError("hpctrain.dist is not initialized: call hpctrain.dist.init() first")
    return _RUNTIME


def runtime():
    return _rt()


def init(comm=None, timeout=None, wait_mode="auto"):
    """Start hpctrain.dist over `comm` (an mpi4py communicator; default
    MPI.COMM_WORLD, MPI started here under the deadline). timeout: seconds
    any rank may wait for another (default HPCTRAIN_TIMEOUT or 300).
    wait_mode (the program's --wait-mode): "nap" (a waiting rank leaves
    shared cores to those that compute), "spin" (MPI's blocking calls, a core
    per rank), "auto" (nap where a node's ranks outnumber its cores).
    Collective. A second call does nothing."""
    global _RUNTIME
    if wait_mode not in WAIT_MODES:
        raise DistError(f"hpctrain.dist.init: wait_mode={wait_mode!r} is not one of {', '.join(WAIT_MODES)}")
    if _RUNTIME is None:
        _RUNTIME = Runtime(comm, timeout, wait_mode)
        atexit.register(_at_exit)


def _at_exit():
    if _RUNTIME is not None:
        shutdown()


def shutdown():
    """Wait for the calls under way, free what init() made and, if init()
    started MPI, finalize it (every rank, under the deadline). Collective."""
    global _RUNTIME
    if _RUNTIME is not None:
        rt, _RUNTIME = _RUNTIME, None
        rt.close()


def is_initialized():
    return _RUNTIME is not None


def rank():
    return _rt().world.rank


def size():
    return _rt().world.size


def local_rank():
    """This rank's index among the ranks of its node."""
    return _rt().world.topology.local_rank


def local_size():
    return _rt().world.topology.local_size


def cross_rank():
    """This rank's node (nodes numbered by their lowest rank)."""
    return _rt().world.topology.node


def cross_size():
    """How many nodes."""
    return _rt().world.topology.num_nodes


def mpi_threads_supported():
    return _rt().MPI.Query_thread() == _rt().MPI.THREAD_MULTIPLE
