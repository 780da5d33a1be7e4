"""hpctrain.dist: Horovod's API over hpctrain's ring, for a training loop
hpctrain did not write (issue 59). The five lines of a Horovod script work
with `import hpctrain.dist as hvd`:

    hvd.init()
    lr *= hvd.size()
    opt = hvd.DistributedOptimizer(grads)          # NumPy: a list of gradient arrays
    hvd.broadcast_parameters(params, root_rank=0)
    ...  opt.ready(i) from backward, or opt.allreduce_gradients(grads); opt.synchronize()

    mpirun -n 4 python examples/numpy_mlp.py       # a whole loop (docs/library.md)

Modules, one job each: runtime.py (init, ranks, process sets), engine.py
(the thread that runs the collectives and the handles), calls.py (every
rank makes the same call: the fingerprint, join's part), collectives.py
(allreduce over hpctrain's ring, allgather, broadcast, reducescatter,
alltoall, barrier, join), objects.py (broadcast_object, allgather_object
without pickle), optimizer.py (DistributedOptimizer, broadcast_parameters,
broadcast_optimizer_state), dispatch.py and torch.py (those two names for a torch
optimizer), arrays.py (NumPy, PyTorch CPU tensors and
buffers, zero-copy), errors.py (the one-line errors).
"""
from .collectives import (Average, Compression, Max, Min, Product, Sum, allgather, allgather_async, allreduce,
                          allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier,
                          barrier_async, broadcast, broadcast_, broadcast_async, broadcast_async_, join, poll,
                          reducescatter, reducescatter_async, synchronize)
from .errors import DistError
from .objects import allgather_object, broadcast_object
from .dispatch import DistributedOptimizer, broadcast_optimizer_state
from .optimizer import broadcast_parameters, flat_like
from .runtime import (ProcessSet, cross_rank, cross_size, init, is_initialized, local_rank, local_size,
                      mpi_threads_supported, rank, shutdown, size)

global_process_set = None   # the world: process_set=None (Horovod's hvd.global_process_set)

__all__ = ["Average", "Compression", "DistError", "DistributedOptimizer", "broadcast_optimizer_state",
           "broadcast_parameters", "flat_like", "Max", "Min", "Product", "ProcessSet", "Sum", "allgather",
           "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
           "allreduce_async_", "alltoall", "alltoall_async", "barrier", "barrier_async", "broadcast",
           "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "cross_rank", "cross_size",
           "global_process_set", "init", "is_initialized", "join", "local_rank", "local_size",
           "mpi_threads_supported", "poll", "rank", "reducescatter", "reducescatter_async", "shutdown", "size",
           "synchronize"]
