"""Set-ups shared by the allreduce tests (test_ring.py, test_staged.py): the
communicators they run on, a buffer whose middle view is reduced, and rank
0's copy of a result (every rank must end with the same bits); and how the
tests of the ring loop's Wire (test_wire.py, test_shard_optimizer.py) read
its stop slot after the allreduce; a tensor rank's slice of a whole
model's flat buffer and back (test_tensor_parallel.py, test_state_layouts.py).
"""
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.nn.tensor_parallel import local_layout

COMMS = [pytest.param(MPI.COMM_SELF, id="self"), pytest.param(MPI.COMM_WORLD, id="world")]


def fives_around_a_view(comm, n, lo, hi):
    """(buf, view): n float32 fives, buf[lo:hi] set to rank + 1 (what an
    allreduce of the view sums; the fives around it must stay)."""
    buf = np.full(n, 5.0, np.float32)
    view = buf[lo:hi]
    view[:] = comm.rank + 1
    return buf, view


def rank0_copy(comm, a):
    """Rank 0's copy of a (collective)."""
    first = a.copy()
    comm.Bcast(first, root=0)
    return first


def ring_step(ring, x, y, loss):
    """One step of the ring loop (loops/ring.py) on a loops/ring_step.RingStep
    after ring.begin(...): forward and backward of (x, y) with the buckets
    exchanged as backprop finishes them, this rank's loss replaced by `loss`
    (a value whose sum over the ranks the test knows) before it goes out.
    Returns ring.summed(): (the loss summed over the ranks, whether any rank
    asked to stop)."""
    def forward_done():
        ring.loss_out[0] = loss
        ring.forward_done()
    ring.model.forward_backward(x, y, on_layer_done=ring.layer_done, loss_out=ring.loss_out,
                                on_forward_done=forward_done)
    ring.fused.wait()
    return ring.summed()

def take_local(full_spec, cuts, full, t):
    """Tensor rank t's slice of the whole model's flat buffer `full`, as the
    rank's buffer lays it out (each tensor cut by its Cut: the oracle the
    tests hold the split model to)."""
    return np.concatenate([(cut.take(full[a0:b0].reshape(shape), t) if cut else full[a0:b0]).reshape(-1)
                           for _, shape, (a0, b0), _, _, cut in local_layout(full_spec, cuts, t)])


def put_local(full_spec, cuts, local, t, full):
    """Tensor rank t's slice `local` into the whole model's flat buffer `full`."""
    for _, shape, (a0, b0), shape_t, (a, b), cut in local_layout(full_spec, cuts, t):
        if cut:
            cut.put(local[a:b].reshape(shape_t), full[a0:b0].reshape(shape), t)
        else:
            full[a0:b0] = local[a:b]
    return full
