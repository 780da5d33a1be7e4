"""The one data-parallel update (comm/data_parallel.py): the model's
gradient as one part (ring mode) or cut into chunks (a pipeline's), sharded
or not, clipped or not, gives the same parameters bit for bit on every
rank; every part's buckets are ring mode's, cut to its slice.

    python -m pytest -q tests/test_data_parallel.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_data_parallel.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm.data_parallel import DataParallelUpdate, NormScope, Part, cut, model_buckets
from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.nn import mlp
from hpctrain.optim.clipping import Clip

SPEC = mlp(hidden=(37, 19))


def test_a_parts_buckets_are_ring_modes_cut_to_its_slice():
    (_, first), (second, third), (_, n) = SPEC.layer_ranges   # Dense, Dense, Dense
    buckets = model_buckets(SPEC.layer_ranges, n, 300)   # one layer a bucket, last first
    assert buckets == [(third, n), (second, third), (0, second)]
    lo = second + 5   # inside the middle layer: its bucket is cut there
    assert cut(buckets, 0, lo) == [(second, lo), (0, second)]
    assert cut(buckets, lo, n) == [(third - lo, n - lo), (0, third - lo)]


def steps(comm, cuts, sharded, clip, fusion_elems=300, count=3):
    """count updates of gradients drawn from (rank, step) over the model cut at `cuts`."""
    n = SPEC.num_params
    params, grads = np.linspace(-1, 1, n, dtype=np.float32), np.zeros(n, np.float32)
    parts = [Part(params[a:b], grads[a:b], a, c) for c, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    one = len(parts) == 1
    # ring mode's scope for one part; a pipeline stage's (every chunk here, every rank a replica) for more
    scope = NormScope(comm if sharded or not one else None, len(parts), comm.size if sharded or not one else 1,
                      comm.rank if sharded or not one else 0)
    strategy = RingAllreduce(comm)
    update = DataParallelUpdate(parts, model_buckets(SPEC.layer_ranges, n, fusion_elems), strategy, ("adam", {}),
                                np, 1.0 / comm.size, zero=int(sharded), clip=Clip(clip) if clip else None, scope=scope)
    norms = []
    for step in range(count):
        grads[...] = np.random.default_rng([comm.rank, step]).standard_normal(n).astype(np.float32)
        update.begin(1e-2, step)
        update.reduce_all()
        update.update_all()
        update.gather_all()
        norms.append(update.clip.norm if clip else None)
    strategy.free()
    return params, norms


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_one_part_or_a_pipelines_chunks_give_the_same_bits(sharded, clip):
    comm = MPI.COMM_WORLD
    whole, norms = steps(comm, [0, SPEC.num_params], sharded, clip)
    # cut on layer starts (300 elements a bucket: one layer each), so no part of the norm is split
    cuts = [0, SPEC.layer_ranges[1][0], SPEC.layer_ranges[2][0], SPEC.num_params]
    chunked, chunk_norms = steps(comm, cuts, sharded, clip)
    assert np.array_equal(whole, chunked) and norms == chunk_norms
    plain, _ = steps(comm, [0, SPEC.num_params], False, clip)
    assert np.array_equal(whole, plain)   # sharded == unsharded
    everyone = np.empty((comm.size, whole.size), whole.dtype)
    comm.Allgather(whole, everyone)
    assert all(np.array_equal(row, whole) for row in everyone)
    if clip:
        assert any(norm > clip for norm in norms)   # it did clip
