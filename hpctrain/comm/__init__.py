"""Communication: allreduce strategies behind one factory, bucket fusion, the
parameter-server protocol.

Everything here takes an MPI communicator (or a Topology built from one) and
contiguous 1-D arrays, nothing else (no model, no optimizer), so each piece
can be tested on its own:

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_ring.py tests/test_strategies.py

Strategies (one module each, one interface: comm/strategy.py): ring.py
(hpctrain's ring), mpi.py (MPI's collectives), nccl.py (NCCL on GPUs);
staged.py wraps a host strategy for device buffers when MPI is not CUDA-aware
(cuda_aware.py asks). `make_allreduce` picks and wraps; `allreduce_plan` is
the start-up line that says which path gradients take and why.

Imports are deferred to the calls: hpctrain.comm is a package that
cluster.py and mnist.py reach before the process is configured (BLAS
threads, GPU binding), and NumPy and mpi4py must not load before that.
"""

STRATEGIES = ("ring", "mpi", "nccl")


def make_allreduce(name, topology, xp, watchdog=None, cuda_aware="auto"):
    """The gradient allreduce strategy `name` ('ring', 'mpi' or 'nccl') over
    topology.comm for arrays of module xp:
    - NumPy: the ring or MPI strategy itself (no wrapper, no extra work per call);
    - CuPy: NCCL for 'nccl'; else the same strategy given device buffers on a
      CUDA-aware MPI (`cuda_aware`: 'auto' asks the library, 'yes'/'no'
      override), or staged through pinned host memory; either bound to this
      rank's GPU in whatever thread calls it. Its `path` says which, and why.
    Collective over topology.comm (every rank must call it)."""
    from .. import device
    from ..errors import HpctrainError
    if name not in STRATEGIES:
        raise ValueError(f"unknown allreduce {name!r} (one of {', '.join(STRATEGIES)})")
    comm = topology.comm
    gpu = device.is_gpu(xp)
    if name == "nccl":
        if not gpu:
            raise HpctrainError("--allreduce nccl needs a GPU")  # allreduce_plan said so first
        from .nccl import NcclAllreduce
        return NcclAllreduce(comm, xp, watchdog)
    if name == "ring":
        from .ring import RingAllreduce as Strategy
    else:
        from .mpi import MpiAllreduce as Strategy
    strategy = Strategy(comm, watchdog)
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
    nccl without a GPU or without NCCL). Local and collective-free: call it on
    every rank inside train.collective, before make_allreduce."""
    from .. import device
    from ..errors import HpctrainError
    gpu = device.is_gpu(xp)
    if name == "nccl":
        if not gpu:
            _, why = device._cupy_or_reason()
            raise HpctrainError(f"--allreduce nccl needs a GPU, and this run is on the CPU "
                                f"({why or '--device cpu'})")
        from .nccl import nccl_or_reason
        nccl, why = nccl_or_reason(xp)
        if nccl is None:
            raise HpctrainError(f"--allreduce nccl: {why}; use --allreduce ring or mpi")
        return f"gradients: NCCL allreduce on the GPU ({why})"
    if not gpu:
        return ""
    from .cuda_aware import cuda_aware as ask
    direct, why = ask(cuda_aware)
    if mode == "ps":  # ps always moves host copies of the device arrays (train_ps.work)
        return f"CUDA-aware MPI: {'yes' if direct else 'no'} ({why})"
    path = "device buffers straight to MPI" if direct else "staged through pinned host memory"
    return f"gradients: {name} allreduce, {path} ({why})"
