"""Communication: allreduce strategies behind one factory, bucket fusion, the
parameter-server protocol.

Everything here takes an MPI communicator (or a Topology built from one) and
contiguous 1-D arrays (and where buckets are updated as they arrive, the
optimizer object it is handed: fusion.py, ps/aggregate.py), never a model
or a layer, so each piece can be tested on its own:

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_ring.py tests/test_strategies.py

Strategies (one module each, one interface: comm/strategy.py): ring_allreduce.py
(hpctrain's ring), hier.py (a ring inside each node, then a ring across
nodes), mpi.py (MPI's collectives), nccl.py (NCCL on GPUs); staged.py wraps
a host strategy for device buffers when MPI is not CUDA-aware (cuda_aware.py
asks). `make_allreduce` picks and wraps; `allreduce_plan` is the start-up
line that says which path gradients take and why, and the strategy's
`choice` the line that says which algorithm the topology got and why.

The ring runs in node order by default (`ring_order="node"`: the ranks of
one node adjacent, comm/topology.py's by_node, agreed from the topology and
made a communicator by Split(0, key=position)), so it crosses each node
boundary once per direction whatever the launcher's placement; "rank" keeps
the launcher's order. On one node the two are the same communicator order.
`auto` (the default of --allreduce): the ring on one node; hier on several
nodes with equal ranks per node; the node-ordered ring otherwise.

Imports are deferred to the calls: hpctrain.comm is a package that
run/cluster.py and mnist.py reach before the process is configured (BLAS
threads, GPU binding), and NumPy and mpi4py must not load before that.
"""

STRATEGIES = ("auto", "ring", "hier", "mpi", "nccl")
RING_ORDERS = ("node", "rank")


def choose(name, topology, ring_order="node"):
    """(algorithm, why): what `name` becomes on this topology ('auto' and
    'hier' are decided here; the rest stay themselves, why ""). Local, the
    same on every rank (the topology is)."""
    nodes, sizes = topology.num_nodes, topology.local_sizes
    where = (f"{topology.size} rank{'s' if topology.size > 1 else ''} on one node" if nodes == 1 else
             f"{topology.size} ranks on {nodes} nodes, " +
             (f"{sizes[0]} per node" if topology.equal_nodes else "per node " + "+".join(map(str, sizes))))
    ring = f"ring ({ring_order} order)" if nodes > 1 else "ring"
    if name == "auto":
        if nodes == 1:
            return "ring", f"auto: {where}"
        if topology.equal_nodes:
            return "hier", f"auto: {where}"
        return "ring", f"auto: {where}, unequal, so the {ring}"
    if name == "hier" and not topology.equal_nodes:
        return "ring", f"hier needs equal ranks per node, got {where}: the {ring} instead"
    if name == "hier":
        return "hier", f"{where}" + (": the node's ring, the same as the flat ring" if nodes == 1 else "")
    if name == "ring" and nodes > 1:
        return "ring", f"{where}, {ring_order} order"
    return name, ""


def _ring_comm(topology, ring_order):
    """(communicator for the ring, one to free once the ring has its duplicate
    or None): topology.comm itself when the order changes nothing (one node,
    or ranks already placed by node), so those runs stay bit-identical."""
    if ring_order not in RING_ORDERS:
        raise ValueError(f"unknown ring order {ring_order!r} (one of {', '.join(RING_ORDERS)})")
    order = topology.by_node() if ring_order == "node" else list(range(topology.size))
    if order == list(range(topology.size)):
        return topology.comm, None
    split = topology.comm.Split(0, key=order.index(topology.rank))
    return split, split


def make_allreduce(name, topology, xp, watchdog=None, cuda_aware="auto", ring_order="node", waits=None):
    """The gradient allreduce strategy `name` (one of STRATEGIES) over
    topology.comm for arrays of module xp; 'auto' and 'hier' resolved by
    `choose` (its reason is the returned strategy's `choice`, "" if none);
    the ring ordered by `ring_order` ('node' or 'rank'):
    - NumPy: the ring, hier or MPI strategy itself (no wrapper, no extra work per call);
    - CuPy: NCCL for 'nccl'; else the same strategy given device buffers on a
      CUDA-aware MPI (`cuda_aware`: 'auto' asks the library, 'yes'/'no'
      override), or staged through pinned host memory; either bound to this
      rank's GPU in whatever thread calls it. Its `path` says which, and why.
    waits: the rings' (ring_allreduce.RingAllreduce, hier's two rings:
    hpctrain.dist's napping exchanges where ranks outnumber cores; None, the
    program's: MPI's).
    Collective over topology.comm (every rank must call it)."""
    strategy = _make(name, topology, xp, watchdog, cuda_aware, ring_order, waits)
    strategy.choice = choose(name, topology, ring_order)[1]
    return strategy


def _make(name, topology, xp, watchdog, cuda_aware, ring_order, waits):
    from ..base import device
    from ..base.errors import HpctrainError
    if name not in STRATEGIES:
        raise ValueError(f"unknown allreduce {name!r} (one of {', '.join(STRATEGIES)})")
    comm = topology.comm
    gpu = device.is_gpu(xp)
    if name == "nccl":
        if not gpu:
            raise HpctrainError("--allreduce nccl needs a GPU")  # allreduce_plan said so first
        from .nccl import NcclAllreduce
        return NcclAllreduce(comm, xp, watchdog)
    name = choose(name, topology, ring_order)[0]
    if name == "ring":
        from .ring_allreduce import RingAllreduce
        ring_comm, to_free = _ring_comm(topology, ring_order)
        strategy = RingAllreduce(ring_comm, watchdog, waits=waits)
        if to_free is not None:
            to_free.Free()
    elif name == "hier":
        from .hier import HierAllreduce
        strategy = HierAllreduce(topology, watchdog, waits=waits)
    else:
        from .mpi import MpiAllreduce
        strategy = MpiAllreduce(comm, watchdog)
    if not gpu:
        return strategy
    from . import cuda_aware as aware
    from .device_buffers import BoundToDevice
    direct, why = aware.cuda_aware(cuda_aware)
    if aware.agree(comm, direct):
        return BoundToDevice(strategy, xp, f"device buffers straight to MPI ({why})")
    from .staged import StagedAllreduce
    return BoundToDevice(StagedAllreduce(strategy, device.copier(xp)), xp,
                         f"staged through pinned host memory ({why})")


def allreduce_plan(name, xp, mode="ring", cuda_aware="auto"):
    """One line for the start-up log: how gradients will move, and why ("" for
    NumPy). Raises HpctrainError where the flags cannot work here (--allreduce
    nccl without a GPU or without NCCL). Local and collective-free: the start-up
    calls it on every rank through `agreed` (one error line for the job), before
    make_allreduce."""
    from ..base import device
    from ..base.errors import HpctrainError
    gpu = device.is_gpu(xp)
    if name == "nccl":
        if not gpu:
            _, why = device._cupy_or_reason()
            raise HpctrainError(f"--allreduce nccl needs a GPU, and this run is on the CPU "
                                f"({why or '--device cpu'})")
        from .nccl import nccl_or_reason
        nccl, why = nccl_or_reason(xp)
        if nccl is None:
            raise HpctrainError(f"--allreduce nccl: {why}; use --allreduce auto, ring, hier or mpi")
        return f"gradients: NCCL allreduce on the GPU ({why})"
    if not gpu:
        return ""
    from .cuda_aware import cuda_aware as ask
    direct, why = ask(cuda_aware)
    if mode == "ps":  # point-to-point: each worker on its own (loops/ps.run_worker)
        how = "the model's device buffers straight to MPI" if direct else "through pinned host mirrors"
        return f"ps workers: {how} ({why})"
    path = "device buffers straight to MPI" if direct else "staged through pinned host memory"
    what = "allreduce (ring or hier by topology)" if name == "auto" else f"{name} allreduce"
    return f"gradients: {what}, {path} ({why})"
