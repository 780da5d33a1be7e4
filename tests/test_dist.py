"""hpctrain.dist (Horovod's API over hpctrain's ring) against the
definitions: every collective, the handles, process sets, objects without
pickle, the fingerprint's mismatch line, join() with uneven batches, the
NumPy DistributedOptimizer.

    mpirun -n 3 python -m mpi4py -m pytest -q --only-mpi tests/test_dist.py
    python -m pytest -q tests/test_dist.py          # the jobs: exit codes and lines

Expectations are computed from rank and size: the file passes at any world size.
"""
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

import hpctrain.dist as hvd
from conftest import MPIRUN, REPO, run_job, under_mpirun
from hpctrain.dist.objects import decode, encode
from hpctrain.dist.runtime import runtime
from hpctrain.run.cluster import child_env, cores_available, oversubscribed, throttle_idle_mpi


@pytest.fixture(scope="module")
def dist():
    from mpi4py import MPI
    hvd.init(MPI.COMM_WORLD, timeout=60)   # the test runner's MPI: not finalized by hvd
    return hvd


def test_objects_round_trip_without_pickle():
    obj = {"lr": 0.1, "step": 3, "m": np.arange(6, dtype=np.float32).reshape(2, 3), 0: (1, np.int64(2)),
           "groups": [{"betas": (0.9, 0.99)}], "none": None}
    back = decode(encode(obj))
    assert back["lr"] == 0.1 and back["step"] == 3 and back["groups"] == [{"betas": (0.9, 0.99)}]
    assert back[0] == (1, 2) and back[0][1].dtype == np.int64 and back["none"] is None
    assert back["m"].dtype == np.float32 and np.array_equal(back["m"], obj["m"])
    with pytest.raises(hvd.DistError, match="function cannot be sent"):
        encode({"f": lambda: 0})


@pytest.mark.mpi(min_size=2)
def test_collectives_against_their_definitions(dist):
    r, n = dist.rank(), dist.size()
    x = np.arange(10, dtype=np.float32) + r
    assert np.array_equal(dist.allreduce(x, op=dist.Sum), n * np.arange(10) + n * (n - 1) / 2)
    assert np.allclose(dist.allreduce(x), np.arange(10) + (n - 1) / 2)
    assert np.array_equal(dist.allreduce(x, op=dist.Min), np.arange(10))
    assert np.array_equal(dist.allreduce(x, op=dist.Max), np.arange(10) + n - 1)
    assert np.array_equal(x, np.arange(10) + r)   # not in place
    total = dist.allreduce(x, op=dist.Sum)
    assert np.array_equal(dist.allreduce(x, op=dist.Sum, prescale_factor=2.0), 2 * total)
    assert np.array_equal(dist.allreduce(x, op=dist.Sum, postscale_factor=0.25), total / 4)
    y = np.full((3, 2), r, np.int64)[:, :1]        # not contiguous: reduced through a copy, written back
    dist.allreduce_(y, op=dist.Sum)
    assert np.all(y == n * (n - 1) // 2)
    got = dist.allgather(np.full((r + 1, 2), r, np.int32))
    assert got.shape == (n * (n + 1) // 2, 2) and np.array_equal(got[:, 0], np.repeat(np.arange(n), np.arange(1, n + 1)))
    b = np.full(4, float(r))
    dist.broadcast_(b, root_rank=n - 1)
    assert np.all(b == n - 1)
    rows = dist.reducescatter(np.ones((2 * n + 1, 3)), op=dist.Sum)
    lo, hi = r * (2 * n + 1) // n, (r + 1) * (2 * n + 1) // n
    assert rows.shape == (hi - lo, 3) and np.all(rows == n)
    out, splits = dist.alltoall(np.arange(n) + 100 * r, received_splits=True)
    assert np.array_equal(out, np.arange(n) * 100 + r) and np.array_equal(splits, np.ones(n))
    h = dist.allreduce_async(np.ones(5, np.float64), op=dist.Sum)
    assert np.array_equal(dist.synchronize(h), np.full(5, n)) and dist.poll(h)
    dist.barrier()
    assert dist.local_size() == n and 0 <= dist.local_rank() < n and dist.cross_size() == 1


@pytest.mark.mpi(min_size=2)
def test_fp16_compression_sums_in_float32_with_16_bit_words(dist):
    n = dist.size()
    x = np.full(1000, 0.1, np.float32)
    got = dist.allreduce(x, op=dist.Sum, compression=dist.Compression.fp16)
    assert np.allclose(got, 0.1 * n, rtol=1e-3) and not np.array_equal(got, dist.allreduce(x, op=dist.Sum))
    got = dist.allreduce(x, op=dist.Sum, compression=dist.Compression.bf16)
    assert np.allclose(got, 0.1 * n, rtol=1e-2)
    with pytest.raises(hvd.DistError, match="compresses a floating-point"):
        dist.allreduce(np.ones(3, np.int32), compression="fp16")


def test_a_torch_tensor_is_used_zero_copy():
    """No MPI (the plain pass has torch loaded already; the MPI passes leave torch out)."""
    torch = pytest.importorskip("torch")
    from hpctrain.dist.arrays import host_array, like
    t = torch.arange(4.0, requires_grad=True)
    arr = host_array(t.grad if t.grad is not None else t.detach(), writable=True)
    arr += 1                                   # the tensor's own memory
    assert torch.equal(t.detach(), torch.arange(4.0) + 1)
    assert isinstance(like(t, arr * 2), torch.Tensor)
    with pytest.raises(hvd.DistError, match="in place needs an array"):
        host_array([1, 2], "allreduce_", writable=True)


def test_oversubscribed_nodes_throttle_mpi_before_it_starts():
    cores = cores_available()
    env = {"OMPI_MCA_mpi_yield_when_idle": "0"}   # the user's own: kept
    assert throttle_idle_mpi(cores + 1, env)
    assert env == {"OMPI_MCA_mpi_yield_when_idle": "0", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}
    env = {}
    assert not throttle_idle_mpi(cores, env) and env == {}
    with pytest.raises(hvd.DistError, match="wait_mode='fast' is not one of auto, nap, spin"):
        hvd.init(wait_mode="fast")


@pytest.mark.mpi(min_size=2)
def test_ranks_outnumbering_cores_nap_where_each_call_waits(dist, monkeypatch):
    from hpctrain.comm.waits import Waits
    from mpi4py import MPI
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    here = oversubscribed(node.Get_size())
    node.Free()
    anywhere = dist.allreduce(np.array([int(here)]), op=dist.Max)[0]
    assert runtime().waits.nap == bool(anywhere)   # decided by all: the same calls on every rank
    naps, napped = Waits._naps, []
    monkeypatch.setattr(Waits, "_naps", staticmethod(lambda: napped.append(1) or naps()))
    assert dist.allreduce(np.ones(3), op=dist.Sum)[0] == dist.size()
    # the call's meeting (one Iallreduce) and each of the ring's 2 (size - 1) exchanges
    assert len(napped) == (1 + 2 * (dist.size() - 1)) * int(anywhere)


@pytest.mark.mpi(min_size=2)
def test_the_napping_ring_sums_to_the_same_bits():
    """hpctrain.dist's ring where ranks outnumber cores (Irecv/Isend, napping
    waits) against the program's (Sendrecv): one chunk of a few elements, and
    chunks of several segments (the double-buffered path)."""
    from hpctrain.comm.ring_allreduce import SEGMENT_BYTES, RingAllreduce
    from hpctrain.comm.waits import Waits
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    spin, nap = RingAllreduce(comm), RingAllreduce(comm, waits=Waits(nap=True))
    for n in (5, 3 * SEGMENT_BYTES // 4 * comm.size + 7):
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        a, b = spin.allreduce(x.copy()), nap.allreduce(x.copy())
        assert np.array_equal(a, b) and not np.array_equal(a, x)
    spin.free()
    nap.free()


@pytest.mark.mpi(min_size=2)
def test_objects_and_process_sets(dist):
    r, n = dist.rank(), dist.size()
    state = {"lr": 0.1 * (r + 1), "step": r, "m": np.full(2, float(r)), 7: [np.float32(r)]}
    m = state["m"]
    dist.broadcast_optimizer_state(state, root_rank=1)
    assert state["lr"] == 0.2 and state["step"] == 1 and state["m"] is m and np.all(m == 1) and state[7] == [1]
    assert [o["r"] for o in dist.allgather_object({"r": r})] == list(range(n))
    evens = dist.ProcessSet(range(0, n, 2))
    if evens.included():
        got = dist.allreduce(np.array([float(r)]), op=dist.Sum, process_set=evens)
        assert got[0] == sum(range(0, n, 2))
        assert dist.broadcast_object(r, root_rank=evens.ranks[-1], process_set=evens) == evens.ranks[-1]
    dist.barrier()


@pytest.mark.mpi(min_size=2)
def test_a_mismatched_call_is_one_error_naming_both_ranks_and_calls(dist):
    r = dist.rank()
    with pytest.raises(hvd.DistError) as e:
        dist.allreduce(np.zeros(4 + (r == 1), np.float32), name="w")
    assert str(e.value) == ("rank 0 called allreduce(float32 [4], op=Average, name='w') but rank 1 called "
                            "allreduce(float32 [5], op=Average, name='w'): every rank must make the same "
                            "collective calls, in the same order, with the same shapes and dtypes")
    assert e.value.exit_code == 2 and e.value.collective and e.value.report == (r == 0)
    with pytest.raises(hvd.DistError, match="rank 0 called broadcast.* but rank 1 called barrier"):
        if r == 1:
            dist.barrier()
        else:
            dist.broadcast(np.zeros(2), root_rank=0)
    assert dist.allreduce(np.ones(1), op=dist.Sum)[0] == dist.size()   # in step again


@pytest.mark.mpi(min_size=2)
def test_a_call_refused_on_some_ranks_is_one_line_on_all(dist):
    """A call refused by its own arguments is still made, as a refusal: on
    every rank alike it is the same error, which one rank prints (the job's
    one line), and no rank waits for another; the ranks are in step after."""
    r = dist.rank()
    bad = "Mean" if r == 1 else dist.Sum
    with pytest.raises(hvd.DistError) as e:
        dist.allreduce(np.ones(3), op=bad)
    assert str(e.value) == "rank 1: allreduce_: op='Mean' is not one of Average, Sum, Min, Max, Product"
    assert e.value.collective and e.value.report == (r == 1) and e.value.exit_code == 2
    with pytest.raises(hvd.DistError) as e:   # every rank refuses: the line as one process says it, said once
        dist.allgather_object(len)
    assert str(e.value).startswith("a builtin_function_or_method cannot be sent") and e.value.report == (r == 0)
    with pytest.raises(hvd.DistError, match="^rank 0: a function cannot be sent"):
        dist.broadcast_object((lambda: 0) if r == 0 else None, root_rank=0)   # the root's alone
    with pytest.raises(hvd.DistError) as e:   # an optimizer refused on rank 1: its line at the others' next call
        if r == 1:
            dist.DistributedOptimizer([np.zeros(3)], backward_passes_per_step=0)
        dist.barrier()
    assert str(e.value) == "rank 1: DistributedOptimizer: backward_passes_per_step=0 (at least 1)"
    assert e.value.report == (r == 1)
    assert dist.allreduce(np.ones(1), op=dist.Sum)[0] == dist.size()   # in step again


@pytest.mark.mpi(min_size=2)
def test_distributed_optimizer_sums_buckets_as_backward_finishes(dist):
    r, n = dist.rank(), dist.size()
    shapes = [(3, 4), (4,), (4, 2), (2,)]
    grads = [np.full(s, r + k, np.float32) for k, s in enumerate(shapes)]
    opt = dist.DistributedOptimizer(grads, fusion_mb=40 / (1 << 20))   # 10 floats: three buckets
    assert opt.flats[0].buckets == [(16, 26), (12, 16), (0, 12)]
    # a first bucket of 2 floats (DDP's first-bucket rule): the last tensor alone, the rest under 10;
    # where the ranks nap (more ranks than cores: no idle core for the overlap) the buckets wait for
    # the last tensor, then go together, so the first bucket's cut is not made
    napping = runtime().waits.nap
    first = dist.DistributedOptimizer(grads, fusion_mb=40 / (1 << 20), first_bucket_mb=8 / (1 << 20))
    assert first.flats[0].buckets == ([(16, 26), (12, 16), (0, 12)] if napping else
                                      [(24, 26), (16, 24), (12, 16), (0, 12)])
    for i in (3, 2):
        opt.ready(i)
    # tensors 2 and 3 are ready: bucket [16, 26) is summing, or, napping, waits for the rest
    assert opt.flats[0].launched == (0 if napping else 1)
    opt.ready(1)
    assert opt.flats[0].launched == (0 if napping else 2)
    with pytest.raises(hvd.DistError, match=r"ready\(1\) called 2 times"):
        opt.ready(1)
    opt.ready(0)
    assert opt.flats[0].launched == 3
    opt.synchronize()
    for k, g in enumerate(grads):
        assert np.array_equal(g, np.full(shapes[k], (n - 1) / 2 + k, np.float32))
    fresh = [np.full(s, 2 * r + k, np.float32) for k, s in enumerate(shapes)]   # a new array each step
    for i in (3, 2, 1, 0):
        opt.ready(i, fresh[i])
    opt.synchronize()
    assert all(np.array_equal(g, np.full(shapes[k], n - 1 + k, np.float32)) for k, g in enumerate(fresh))
    flat, views = dist.flat_like(shapes)
    for k, v in enumerate(views):
        v[...] = r + k
    inplace = dist.DistributedOptimizer(views)
    assert inplace.flats[0].inplace is not None
    inplace.allreduce_gradients()
    assert np.array_equal(views[1], np.full(4, (n - 1) / 2 + 1, np.float32))


@pytest.mark.mpi(min_size=2)
def test_powersgd_is_exact_on_low_rank_gradients_and_the_programs_on_others(dist):
    """compression=powersgd: a rank-1 W gradient on every rank (one u, each
    rank its v) averaged exactly at rank 1; full-rank ones, two steps
    (error feedback, warm Q), the bits of the program's PowerSgd over the
    same layout, divided by the ranks; the bias exact; and compressed."""
    from hpctrain.comm.powersgd import PowerSgd
    from hpctrain.optim.compression_math import powersgd_layout
    r, n = dist.rank(), dist.size()
    settings = dist.Compression.PowerSGD(rank=1, start=0)
    flat, (w, b) = hvd.flat_like([(16, 8), (8,)])
    u = np.random.default_rng(7).standard_normal(16).astype(np.float32)
    vs = [np.random.default_rng(10 + q).standard_normal(8).astype(np.float32) for q in range(n)]
    w[...], b[...] = np.outer(u, vs[r]), r
    dist.DistributedOptimizer([w, b], compression=settings).synchronize()
    assert np.allclose(w, np.mean([np.outer(u, v) for v in vs], axis=0), rtol=1e-4, atol=1e-5)
    assert np.all(b == (n - 1) / 2)
    opt = dist.DistributedOptimizer([w, b], compression=settings)
    program_flat = np.zeros_like(flat)
    layout = powersgd_layout([("w", (16, 8), 0, 128), ("b", (8,), 128, 136)], 1, settings.min_rate)[0]
    program = PowerSgd(runtime().world.strategy, program_flat, layout, start=0)
    for step in range(2):
        flat[...] = program_flat[...] = np.random.default_rng([step, r]).standard_normal(136).astype(np.float32)
        mean = dist.allreduce(flat, op=dist.Average)
        opt.synchronize()
        program.begin(step)
        program.allreduce(0, 136)
        assert np.array_equal(flat, program_flat / np.float32(n))
        assert np.allclose(b, mean[128:], rtol=1e-6) and not np.allclose(w.reshape(-1), mean[:128], atol=1e-2)


@pytest.mark.mpi(min_size=3)
def test_join_with_10_7_and_3_batches_equals_one_process_over_them(dist):
    """Ranks 0, 1, 2 hold 10, 7, 3 batches (more ranks: 3 each); a linear
    least-squares model trained with SGD; the joined ranks contribute
    zeros, not counted in the average: each step is one process's step
    over the batches still there."""
    r, n = dist.rank(), dist.size()
    counts = [10, 7, 3] + [3] * (n - 3)
    rng = np.random.default_rng(0)
    data = [[(rng.standard_normal((4, 3)), rng.standard_normal(4)) for _ in range(c)] for c in counts]

    def grad(w, x, y):
        return 2 * x.T @ (x @ w - y) / len(y)

    w = np.zeros(3)
    g = np.zeros(3)
    opt = dist.DistributedOptimizer([g])
    for x, y in data[r]:
        g[...] = grad(w, x, y)
        opt.synchronize()
        w -= 0.1 * g
    last = dist.join()
    w = dist.broadcast(w, root_rank=0)   # rank 0 took every step
    ref = np.zeros(3)
    for step in range(max(counts)):
        here = [grad(ref, *data[k][step]) for k in range(n) if step < counts[k]]
        ref -= 0.1 * sum(here) / len(here)
    assert last == 0 and np.allclose(w, ref, rtol=1e-12, atol=1e-14)


# --- jobs: the one-line endings, and the example against the program ---------------------------

def error_lines(stderr):
    return [s for s in stderr.splitlines() if s.startswith("hpctrain: error:")]


def test_a_stopped_rank_is_named_within_the_deadline(job):
    t0 = time.monotonic()
    r = job(2, "stop", 2, module="tests.dist_calls", timeout=60)
    took = time.monotonic() - t0
    lines = error_lines(r.stderr)
    assert r.returncode == 3 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hpctrain: error: rank 1 stopped responding") and "(--timeout 2)" in lines[0]
    assert "the job went on" not in r.stdout and took < 30


def test_a_call_with_another_shape_is_one_line_and_exit_2(job):
    r = job(2, "mismatch", 30, module="tests.dist_calls", timeout=60)
    assert r.returncode == 2, r.stderr
    assert error_lines(r.stderr) == [
        "hpctrain: error: rank 0 called allreduce(float64 [4], op=Average, name='w') but rank 1 called "
        "allreduce(float64 [5], op=Average, name='w'): every rank must make the same collective calls, in "
        "the same order, with the same shapes and dtypes"]
    assert "Traceback" not in r.stderr


def test_a_mismatch_inside_a_process_set_leaves_through_the_set(job):
    """Ranks 0 and 1 disagree in their set while rank 2 waits in a world
    barrier: one line, exit 2, at once (not the world's barrier before
    MPI_Finalize, which rank 2 never reaches: the deadline, exit 3)."""
    t0 = time.monotonic()
    r = job(3, "set_mismatch", 60, module="tests.dist_calls", timeout=90)
    assert r.returncode == 2, r.stderr
    assert error_lines(r.stderr) == [
        "hpctrain: error: rank 0 called allreduce(float64 [4], op=Average, name='w') but rank 1 called "
        "allreduce(float64 [5], op=Average, name='w'): every rank must make the same collective calls, in "
        "the same order, with the same shapes and dtypes"], r.stderr
    assert time.monotonic() - t0 < 40


EXAMPLE = os.path.join(REPO, "examples", "numpy_mlp.py")
STEPS, BATCH, LR = 20, 64, 0.1


@pytest.fixture(scope="module")
def trained(tmp_path_factory, bundled_shards):
    """python -m hpctrain.train's parameters, and the example's at 1, 2 and 4
    ranks, all at the same global batch."""
    if under_mpirun():
        pytest.skip("launches its own jobs: runs in the plain pytest pass")
    out = tmp_path_factory.mktemp("numpy_mlp")
    flags = ["--data", bundled_shards, "--steps", STEPS, "--batch-size", BATCH, "--lr", LR]
    r = run_job(1, *flags, "--model", "mlp", "--hidden", "32,32", "--optimizer", "sgd", "--save", out / "train.h5",
                module="hpctrain.train")
    assert r.returncode == 0, r.stderr
    with h5py.File(out / "train.h5") as f:
        reference = {name: f[name][...] for name in ("layer0/W", "layer0/b", "layer1/W", "layer1/b",
                                                     "layer2/W", "layer2/b")}
    runs = {}
    for n in (1, 2, 4):
        save = out / f"example{n}.npz"
        cmd = [sys.executable, EXAMPLE, *map(str, flags), "--save", str(save)]
        r = subprocess.run(cmd if n == 1 else [MPIRUN, "-n", str(n), *cmd], capture_output=True, text=True,
                           timeout=120, env=child_env(), cwd=REPO)
        assert r.returncode == 0, r.stderr
        with np.load(save) as z:
            runs[n] = dict(z)
    return reference, runs


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_numpy_example_trains_the_programs_parameters(trained, ranks):
    reference, runs = trained
    got = runs[ranks]
    assert sorted(got) == sorted(reference)
    # float32 rounding: the sums of 1, 2 or 4 ranks' means in another order (measured: at most 1.8e-7)
    worst = max(float(np.abs(got[k] - reference[k]).max()) for k in reference)
    assert worst < 1e-6, worst
    assert any(not np.array_equal(reference[k], np.zeros_like(reference[k])) for k in reference)
