"""--clip-norm: gradient clipping by global norm.

Units against NumPy (the clip, the norm of parts in any order, the factor
folded into an optimizer step already begun); under mpirun, the ring loop's
arithmetic (fused buckets, deferred updates, the one GradNorm) against one process
over all the samples, and sharded against unsharded bit for bit, on the
ring, MPI's collectives and the staged (GPU without CUDA-aware MPI) path;
then real jobs: sharded == unsharded, sync ps == ring, async ps clips each
push, resume bit-exact, metrics.

    python -m pytest -q tests/test_clip.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_clip.py
"""
import json
import math
import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from collectives import ring_step
from conftest import checkpoint_file, checkpoint_path, remove_checkpoint, same_bytes, saved
from gpu_fakes import LazyCopier
from hpctrain.base import device
from hpctrain.optim.clipping import EPS, Clip, clip_, clip_factor, global_norm, sum_squares
from hpctrain.comm.mpi import MpiAllreduce
from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.comm.staged import StagedAllreduce
from hpctrain.nn import mlp
from hpctrain.optim.optimizers import make_optimizer
from hpctrain.loops.ring_step import RingStep


# --- units ---------------------------------------------------------------------

def reference_clip(g, c):
    """What the docs promise, in float64 NumPy."""
    norm = float(np.sqrt(np.sum(g.astype(np.float64) ** 2)))
    return g * min(1.0, c / (norm + EPS)), norm


@pytest.mark.parametrize("c", [1e-3, 0.5, 3.0, 1e6])
def test_clip_matches_numpy(c):
    g = np.random.default_rng(1).standard_normal(10007).astype(np.float32) * 0.03
    want, norm = reference_clip(g, c)
    got = g.copy()
    assert clip_(got, c) == pytest.approx(norm, rel=1e-12)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    if c > norm:
        assert got.tobytes() == g.tobytes()   # below the threshold: untouched, bit for bit
    else:
        assert float(np.linalg.norm(got.astype(np.float64))) == pytest.approx(c, rel=1e-5)


def test_zero_gradient_is_left_alone():
    g = np.zeros(100, np.float32)
    assert clip_(g, 1.0) == 0.0 and not g.any()
    assert clip_factor(0.0, 1e-9) == pytest.approx(1e-3)   # C / EPS, no division by zero


def test_norm_of_parts_is_the_same_bits_in_any_order_and_split():
    rng = np.random.default_rng(7)
    g = (rng.standard_normal(5000) * 10.0 ** rng.uniform(-6, 2, 5000)).astype(np.float32)
    cuts = sorted(rng.choice(np.arange(1, 5000), 40, replace=False))
    parts = sum_squares(np.split(g, cuts))
    norms = {global_norm(rng.permutation(parts)) for _ in range(20)}
    norms.add(global_norm(list(parts) + [0.0, 0.0]))   # empty parts change nothing
    assert len(norms) == 1
    assert norms.pop() == pytest.approx(float(np.linalg.norm(g.astype(np.float64))), rel=1e-13)


def test_clip_scales_only_clipped_steps_and_keeps_the_norms():
    clip = Clip(1.0)
    parts = np.array([4.0 * 4, 9.0 * 4])   # a summed gradient of 4 ranks whose average has norm sqrt(13)/2
    assert clip.scaled(parts, 0.25) == pytest.approx(0.25 / (math.sqrt(13) / 2 + EPS))
    assert clip.norm == pytest.approx(math.sqrt(13) / 2)
    assert clip.scaled(np.array([0.01]), 0.25) == 0.25       # not clipped: grad_scale itself
    assert clip.mean_norm() == pytest.approx((math.sqrt(13) / 2 + 0.025) / 2)
    assert math.isnan(clip.mean_norm())
    assert clip.totals() == {"clip_norm": 1.0, "clipped_steps": 1, "clip_steps": 2}


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_set_grad_scale_after_begin_is_begin_with_that_scale(name):
    rng = np.random.default_rng(3)
    p0, g = rng.standard_normal((2, 999)).astype(np.float32)
    a, b, c = p0.copy(), p0.copy(), p0.copy()
    one, two = make_optimizer(name, 999, weight_decay=0.1), make_optimizer(name, 999, weight_decay=0.1)
    sharded = make_optimizer(name, 999, weight_decay=0.1, owned=[(0, 500), (500, 999)])
    for _ in range(3):
        one.begin(0.01, 0.5 * 0.37)
        one.update(a, g)
        two.begin(0.01, 0.5)
        two.set_grad_scale(0.5 * 0.37)
        two.update(b, g)
        sharded.begin(0.01, 0.5)
        sharded.set_grad_scale(0.5 * 0.37)
        sharded.update(c, g, 500, 999)
        sharded.update(c, g, 0, 500)
    assert a.tobytes() == b.tobytes() == c.tobytes()


# --- the ring loop's arithmetic, on any number of ranks --------------------------

HIDDEN = (37, 19)
BATCH = 6
STRATEGIES = {"ring": RingAllreduce, "mpi": MpiAllreduce,
              "staged ring": lambda comm: StagedAllreduce(RingAllreduce(comm), device.HostCopier(), chunk_bytes=1024),
              # copies that run only when waited for: a missing wait shows up as NaN
              "lazy staged ring": lambda comm: StagedAllreduce(RingAllreduce(comm), LazyCopier(), chunk_bytes=1024)}


def batches(size, steps):
    """The same samples on every rank: rank r trains on rows [r*B, (r+1)*B)."""
    rng = np.random.default_rng(11)
    return [(rng.random((size * BATCH, 784)).astype(np.float32) * 3, rng.integers(0, 10, size * BATCH))
            for _ in range(steps)]


def clipped_ring_steps(comm, strategy_name, optimizer, sharded, fusion_elems, overlap, c, steps=4, lr=0.05):
    """loop_ring.py's step with --clip-norm c: fused buckets, updates deferred
    until the GradNorm is in, the factor folded into grad_scale."""
    size = comm.size
    strategy = STRATEGIES[strategy_name](comm)
    clip = Clip(c)
    ring = RingStep(mlp(hidden=HIDDEN), strategy, comm, np, (optimizer, {}), fusion_elems, zero=int(sharded),
                    clip=clip, overlap=overlap)
    model, fused = ring.model, ring.fused
    model.init(0)
    norms = []
    for x, y in batches(size, steps):
        rows = slice(comm.rank * BATCH, (comm.rank + 1) * BATCH)
        ring.begin(lr, False)
        ring_step(ring, x[rows], y[rows], 1.0)
        norms.append(clip.norm)
    ring.close()
    getattr(strategy, "inner", strategy).free()
    return model.params.copy(), norms, len(fused.buckets)


def single_process(size, c, steps=4, lr=0.05):
    """One process over all size*BATCH samples, clipped by the NumPy reference."""
    model = mlp(hidden=HIDDEN).build()
    model.init(0)
    norms = []
    for x, y in batches(size, steps):
        model.forward_backward(x, y)
        g, norm = reference_clip(model.grads.astype(np.float64), c)
        model.params[...] = (model.params - lr * g).astype(np.float32)
        norms.append(norm)
    return model.params.copy(), norms


def agree(comm, value):
    """Every rank's bool, and-ed: assert after communicating."""
    return comm.allreduce(bool(value), op=MPI.LAND)


@pytest.mark.mpi
@pytest.mark.parametrize("fusion_elems, overlap", [(0, False), (300, False), (300, True)])
def test_clipped_ring_equals_one_process_over_all_samples(fusion_elems, overlap):
    comm = MPI.COMM_WORLD
    for sharded in (False, True):
        params, norms, buckets = clipped_ring_steps(comm, "ring", "sgd", sharded, fusion_elems, overlap, c=0.2)
        want, want_norms = single_process(comm.size, c=0.2)
        assert fusion_elems == 0 or buckets > 2
        assert min(want_norms) > 0.2                               # every step clipped
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)  # the loss slot is not in the norm
        assert agree(comm, np.allclose(params, want, rtol=0, atol=2e-6)), float(np.abs(params - want).max())
    unclipped, _, _ = clipped_ring_steps(comm, "ring", "sgd", False, fusion_elems, overlap, c=1e9)
    assert not np.allclose(unclipped, want, rtol=0, atol=1e-4)     # the clip changed the result


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["ring", "staged ring", "lazy staged ring"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("fusion_elems, overlap", [(0, False), (300, False), (300, True), (5000, True)])
def test_clipped_sharded_is_bit_identical_to_unsharded(strategy, optimizer, fusion_elems, overlap):
    # Against the plain ring, unsharded: the staged allreduce goes in chunks
    # (another summation order at 3+ ranks), its reduce-scatter does not.
    comm = MPI.COMM_WORLD
    plain, plain_norms, _ = clipped_ring_steps(comm, "ring", optimizer, False, fusion_elems, overlap, c=0.2)
    shard, norms, _ = clipped_ring_steps(comm, strategy, optimizer, True, fusion_elems, overlap, c=0.2)
    assert norms == plain_norms
    assert np.array_equal(plain, shard)
    everyone = np.empty((comm.size, shard.size), shard.dtype)
    comm.Allgather(shard, everyone)
    assert all(np.array_equal(row, shard) for row in everyone)


@pytest.mark.mpi
def test_clipped_on_mpi_collectives_is_within_1e_6_under_sgd():
    comm = MPI.COMM_WORLD
    plain, plain_norms, _ = clipped_ring_steps(comm, "ring", "sgd", False, 300, False, c=0.2)
    shard, norms, _ = clipped_ring_steps(comm, "mpi", "sgd", True, 300, False, c=0.2)
    np.testing.assert_allclose(norms, plain_norms, rtol=1e-6)
    assert float(np.abs(plain - shard).max()) <= 1e-6


@pytest.mark.mpi
def test_a_threshold_never_reached_changes_no_bit():
    comm = MPI.COMM_WORLD
    clipped, _, _ = clipped_ring_steps(comm, "ring", "adam", True, 300, True, c=1e9)
    # the same steps without clipping: each bucket updated as soon as it is summed
    strategy = RingAllreduce(comm)
    ring = RingStep(mlp(hidden=HIDDEN), strategy, comm, np, ("adam", {}), 300, overlap=True)
    model = ring.model
    model.init(0)
    for x, y in batches(comm.size, 4):
        rows = slice(comm.rank * BATCH, (comm.rank + 1) * BATCH)
        ring.begin(0.05, False)
        model.forward_backward(x[rows], y[rows], on_layer_done=ring.layer_done)
        ring.fused.wait()
    ring.close()
    strategy.free()
    assert np.array_equal(model.params, clipped)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["ring", "mpi", "hier on fake 2-rank nodes"])
def test_parts_are_every_ranks_shard(name):
    from hpctrain.comm.hier import HierAllreduce
    from hpctrain.comm.topology import Topology
    comm = MPI.COMM_WORLD
    if name.startswith("hier"):
        if comm.size % 2:
            pytest.skip("an odd world size makes unequal fake nodes")
        with Topology(comm, node_comm=comm.Split(comm.rank // 2, comm.rank)) as topology:
            strategy = HierAllreduce(topology)   # its rings keep their own communicators
    else:
        strategy = STRATEGIES[name](comm)
    for n in (0, 1, comm.size - 1, 7, 1000):
        mine = np.array(strategy.shard(n), np.int64)
        everyone = np.empty((comm.size, 2), np.int64)
        comm.Allgather(mine, everyone)
        assert sorted(map(tuple, everyone.tolist())) == sorted(strategy.parts(n))
        assert sum(b - a for a, b in strategy.parts(n)) == n
    strategy.free()


# --- jobs ----------------------------------------------------------------------

SMALL = ["--hidden", "64", "--batch-size", "16", "--timeout", "120"]


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def ok(r):
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


@pytest.mark.parametrize("ranks, flags", [
    (3, ["--optimizer", "adam", "--lr", "0.001", "--overlap", "on", "--fusion-mb", "0.003"]),
    (2, ["--optimizer", "momentum", "--lr", "0.01", "--overlap", "off", "--fusion-mb", "0.01"]),
])
def test_clipped_sharded_job_is_bit_identical_to_unsharded(job, tmp_path, ranks, flags):
    common = ["--steps", 16, "--log-every", 8, *SMALL, *flags, "--clip-norm", 0.3]
    for s in ("off", "on"):
        ok(job(ranks, *common, "--shard-optimizer", s, "--save", tmp_path / f"{s}.h5",
               "--metrics", tmp_path / f"{s}.jsonl"))
    ok(job(ranks, *[a for a in common if a not in ("--clip-norm", 0.3)], "--save", tmp_path / "noclip.h5"))
    assert same_bytes(tmp_path / "off.h5", tmp_path / "on.h5")
    assert not same_bytes(tmp_path / "off.h5", tmp_path / "noclip.h5")   # the clip acted
    off, on = records(tmp_path / "off.jsonl"), records(tmp_path / "on.jsonl")
    assert [r["grad_norm"] for r in off[:-1]] == [r["grad_norm"] for r in on[:-1]]
    assert all(r["grad_norm"] > 0.3 for r in off[:-1])
    assert off[-1]["clip_norm"] == 0.3 and off[-1]["clipped_steps"] == 16


@pytest.mark.parametrize("ranks, num_ps, placement", [(3, 1, "even"), (5, 2, "round-robin")])
def test_clipped_sync_ps_equals_ring_under_sgd(job, tmp_path, ranks, num_ps, placement):
    common = ["--optimizer", "sgd", "--lr", 0.05, "--steps", 30, "--log-every", 10, *SMALL, "--clip-norm", 0.3]
    ok(job(ranks, "--mode", "ps", "--num-ps", num_ps, "--placement", placement, "--sync", *common,
           "--save", tmp_path / "ps.h5", "--metrics", tmp_path / "ps.jsonl"))
    ok(job(ranks - num_ps, "--mode", "ring", *common, "--save", tmp_path / "ring.h5",
           "--metrics", tmp_path / "ring.jsonl"))
    ok(job(ranks - num_ps, "--mode", "ring", *common[:-2], "--save", tmp_path / "noclip.h5"))
    a, b, c = saved(tmp_path / "ps.h5"), saved(tmp_path / "ring.h5"), saved(tmp_path / "noclip.h5")
    assert set(a) == set(b)
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-6
    assert max(float(np.abs(c[k] - b[k]).max()) for k in a) > 1e-3      # the clip acted
    ps, ring = records(tmp_path / "ps.jsonl"), records(tmp_path / "ring.jsonl")
    np.testing.assert_allclose([r["grad_norm"] for r in ps[:-1]], [r["grad_norm"] for r in ring[:-1]], rtol=1e-5)
    assert ps[-1]["clip_norm"] == 0.3


def test_clipped_ps_device_gpu_path_equals_host_servers(job, tmp_path):
    """--ps-device gpu (optim.OnDevice; NumPy stands in for CuPy through
    tests/numpy_as_gpu.py) clips to the same bits as host servers."""
    common = ["--mode", "ps", "--num-ps", 2, "--steps", 20, "--log-every", 10, *SMALL, "--clip-norm", 0.3]
    stand_in = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}
    ok(job(4, *common, "--save", tmp_path / "host.h5"))
    ok(job(4, *common, "--ps-device", "gpu", "--save", tmp_path / "dev.h5", env=stand_in, module="numpy_as_gpu"))
    assert same_bytes(tmp_path / "host.h5", tmp_path / "dev.h5")


def test_async_ps_clips_each_push(job, tmp_path):
    """SGD with a tiny C: each applied push moves the parameters by at most
    lr*C, so after S updates they are within S*lr*C of where they started
    (unclipped, each push would move them by lr*||g||, ~1000x more)."""
    lr, c, steps = 0.05, 1e-3, 40
    common = ["--mode", "ps", "--num-ps", 1, "--async", "--optimizer", "sgd", "--lr", lr, "--steps", steps,
              "--log-every", 10, *SMALL]
    ok(job(3, *common, "--clip-norm", c, "--save", tmp_path / "clip.h5", "--metrics", tmp_path / "m.jsonl"))
    ok(job(3, *common, "--save", tmp_path / "free.h5"))
    start = mlp(hidden=(64,)).build()
    start.init(0)
    p0 = {name: np.asarray(view) for name, view in start.tensors()}

    def moved(path):
        p = saved(path)
        assert set(p) == set(p0)
        return math.sqrt(sum(float(np.sum((p[k].astype(np.float64) - p0[k]) ** 2)) for k in p))

    assert 0 < moved(tmp_path / "clip.h5") <= steps * lr * c * (1 + 1e-4)
    assert moved(tmp_path / "free.h5") > 100 * steps * lr * c
    logged = records(tmp_path / "m.jsonl")
    assert all(r["grad_norm"] > c for r in logged[:-1]) and logged[-1]["clipped_steps"] == logged[-1]["clip_steps"]


@pytest.mark.parametrize("mode", ["ring", "ring sharded", "ps"])
def test_clipping_survives_checkpoint_and_resume_bit_exact(job, tmp_path, mode):
    ranks = {"ring": [], "ring sharded": ["--shard-optimizer", "on", "--fusion-mb", "0.01"],
             "ps": ["--mode", "ps", "--num-ps", 2]}[mode]
    n = 4 if mode == "ps" else 2
    ckpt = tmp_path / "ckpt"
    flags = [*ranks, "--steps", 24, "--log-every", 8, *SMALL, "--lr", 0.001, "--clip-norm", 0.5,
             "--checkpoint-dir", ckpt, "--checkpoint-every", 8]
    ok(job(n, *flags, "--save", tmp_path / "full.h5"))
    with h5py.File(checkpoint_file(checkpoint_path(ckpt, 16)), "r") as f:
        assert f.attrs["clip_norm"] == 0.5
    remove_checkpoint(checkpoint_path(ckpt, 24))
    remove_checkpoint(checkpoint_path(ckpt, 16))
    r = ok(job(n, *flags, "--save", tmp_path / "resumed.h5"))
    assert "at step 8" in r.stdout
    assert same_bytes(tmp_path / "full.h5", tmp_path / "resumed.h5")
    ok(job(n, *[a for a in flags if a not in ("--clip-norm", 0.5)], "--checkpoint-dir", tmp_path / "other",
           "--save", tmp_path / "noclip.h5"))
    assert not same_bytes(tmp_path / "full.h5", tmp_path / "noclip.h5")   # the clip acted


@pytest.mark.parametrize("value, expect", [
    ("0", "argument --clip-norm: must be > 0, got 0"),
    ("-1", "argument --clip-norm: must be > 0, got -1"),
    ("inf", "argument --clip-norm: must be a finite number, got inf"),
])
def test_bad_clip_norm_is_refused_by_the_parser_in_one_line(value, expect):
    # In-process: a flag the parser refuses is one line and exit 2 on the
    # whole job the same way for every flag (tests/faults/test_bad_flags.py).
    from hpctrain.base.errors import HpctrainError
    from hpctrain.flags import cli
    with pytest.raises(HpctrainError) as refused:
        cli.parse(["--steps", "5", f"--clip-norm={value}"])
    assert expect in str(refused.value) and "\n" not in str(refused.value)
