"""The step's gradient, loss and stop flag (comm/step_gradient.py): the
micro-batches of a model with a tied tensor summed the ring's way (a layer
at a time), ps's (at once) and a pipeline stage's (into the buffer the
replicas average) give the same bits; the fp16 notes tell a 16-bit overflow
from divergence; and the ring's loss and stop flag travel in their own
small allreduce, so the buffer the buckets exchange is the model's
gradient and nothing else; every rank reads the same summed loss and stop
flag after every step, whoever asked to stop, sharded or not, staged or not,
and from a 'device' whose copies run as late as allowed.

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_step_gradient.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from collectives import ring_step
from gpu_fakes import LazyCopier
from hpctrain.base import device
from hpctrain.comm.step_gradient import StepGradient, wire_overflowed
from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.comm.staged import StagedAllreduce
from hpctrain.loops.ring_step import RingStep
from hpctrain.nn import mlp
from hpctrain.nn.gpt import gpt


def test_the_buckets_exchange_the_gradients_only():
    spec = mlp(hidden=(64, 32))
    ring = RingStep(spec, RingAllreduce(MPI.COMM_SELF), MPI.COMM_SELF, np, ("adam", {}), 3000)
    part = ring.update.parts[0]   # the buckets' one buffer: the model's gradient, nothing in front
    assert part.grads is ring.model.grads and part.grads.size == spec.num_params
    assert ring.buckets[0][1] == spec.num_params and ring.buckets[-1][0] == 0
    assert {lo for lo, _ in ring.buckets} <= {lo for lo, _ in ring.model.layer_ranges}
    ring.close()


def test_ring_ps_and_pipeline_sums_of_a_tied_model_are_the_same_bits():
    spec = gpt(13, 8, 2, 2, 12)   # the head tied to the embedding: its uses summed apart, then combined
    model = spec.build(np)
    model.init(3)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 13, (3, 8)), rng.integers(0, 13, (3, 8))) for _ in range(3)]
    n, grads = spec.num_params, {}

    def summed(last):   # the first two micro-batches summed apart, the last one's ending by `last`
        gradient = StepGradient(np, np.float32, [(np.zeros(n, np.float32), model.extra)])
        gradient.begin()
        for x, y in batches[:-1]:
            gradient.add(model.grads, model.extra, model.forward_backward(x, y, combine=False))
        return gradient, last(gradient, *batches[-1])

    def ring(gradient, x, y):   # added in before each layer's bucket starts
        def layer_done(k):
            gradient.layer_done(model.run, spec.param_layers[k], model.grads, model.extra, *model.layer_ranges[k])
        model.forward_backward(x, y, combine=False, on_layer_done=layer_done)
        return model.grads.copy()

    def ps(gradient, x, y):   # added in at once before the push
        model.forward_backward(x, y, combine=False)
        gradient.into(model)
        return model.grads.copy()

    def pipeline(gradient, x, y):   # every micro-batch into the sum, tied uses combined after the last
        model.forward_backward(x, y, combine=False)
        gradient.add(model.grads, model.extra)
        gradient.combine_tied(model.run, 0, len(spec.layers))
        return gradient.sums[0][0].out.copy()
    for name, last in (("ring", ring), ("ps", ps), ("pipeline", pipeline)):
        _, grads[name] = summed(last)
    assert grads["ring"].tobytes() == grads["ps"].tobytes() == grads["pipeline"].tobytes()
    tied = spec.ties[0]   # the embedding: its gradient holds the head's uses over every micro-batch
    alone = StepGradient(np, np.float32, [(np.zeros(n, np.float32), model.extra)])
    alone.begin()
    for x, y in batches:   # each micro-batch combined first, then summed: the same values up to rounding
        model.forward_backward(x, y)
        alone.add(model.grads, model.extra)
    np.testing.assert_allclose(grads["ring"][tied.lo:tied.hi], alone.sums[0][0].out[tied.lo:tied.hi],
                               rtol=1e-5, atol=1e-7)


class _Wire:
    kind = "fp16"

    def __init__(self, sent_finite):
        self.sent_finite = sent_finite


def _waiting(what):
    import contextlib
    return contextlib.nullcontext()


@pytest.mark.parametrize("replicated", [False, True])
def test_the_fp16_notes_tell_an_overflow_from_divergence(replicated):
    finite, inf = np.ones(4, np.float32), np.array([1, np.inf, 1, 1], np.float32)
    comm = MPI.COMM_SELF
    assert wire_overflowed([inf], _Wire(True), comm, _waiting, replicated)        # the 16-bit sum overflowed
    assert not wire_overflowed([inf], _Wire(False), comm, _waiting, replicated)   # a gradient was not finite
    assert not wire_overflowed([finite], _Wire(True), comm, _waiting, replicated)
    assert not wire_overflowed([inf], None, comm, _waiting, replicated)           # no fp16: no check


@pytest.mark.mpi(min_size=2)
def test_a_shard_that_overflowed_on_one_rank_is_named_on_every_rank():
    comm = MPI.COMM_WORLD
    mine = np.array([np.inf if comm.rank == 1 else 1.0], np.float32)   # --zero 3: rank 1's shard alone
    assert wire_overflowed([mine], _Wire(True), comm, _waiting, replicated=False)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("copier", [device.HostCopier, LazyCopier])
def test_every_rank_reads_the_sums_and_a_late_copy_is_waited_for(copier):
    comm = MPI.COMM_WORLD
    sums = StepGradient(np, np.float32, comm=comm, copier=copier())
    loss = np.zeros(1, np.float32)
    for step in range(4):
        sums.begin(comm.rank == 1 and step == 2)
        loss[0] = 0.5 * comm.rank + step
        sums.loss_ready(loss)   # LazyCopier's copy runs when waited for: summed() must wait for it
        assert sums.summed() == (sum(0.5 * r + step for r in range(comm.size)), step == 2)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("staged", [False, True])
def test_every_rank_stops_after_the_same_step_whoever_asked(sharded, staged):
    comm = MPI.COMM_WORLD
    ring = RingAllreduce(comm)
    # staged: LazyCopier (NaN-filled, lazy copies) standing in for the device; small chunks
    # (8 KiB: each bucket in more than one, 2 and 25 of its 2,410 and 50,240 floats;
    # 256 bytes, some 800 ring allreduces a step, were most of the MPI passes' time)
    strategy = StagedAllreduce(ring, LazyCopier(), chunk_bytes=8192) if staged else ring
    rng = np.random.default_rng(comm.rank)
    for who in range(comm.size):
        step = RingStep(mlp(hidden=(64, 32)), strategy, comm, np, ("sgd", {}), 3000, zero=int(sharded))
        assert len(step.buckets) > 1
        # [first step whose summed stop flag was set, steps whose summed loss was wrong]:
        # every step runs on every rank (communicate first, assert after).
        seen = np.zeros(2, np.int64)
        for k in range(1, 6):
            x, y = rng.random((4, 784)).astype(np.float32), rng.integers(0, 10, 4)
            step.begin(1e-3, comm.rank == who and k == 3)
            loss, stop = ring_step(step, x, y, comm.rank + k)
            seen[1] += loss != sum(r + k for r in range(comm.size))
            if stop and not seen[0]:
                seen[0] = k
        step.close()
        everyone = np.zeros((comm.size, 2), np.int64)
        comm.Allgather(seen, everyone)
        assert everyone.tolist() == [[3, 0]] * comm.size, (who, everyone)
    ring.free()
