"""--shard-optimizer on (ZeRO stage 1 in ring mode): each rank updates only its
share of every bucket after the reduce-scatter, and the allgather carries the
updated parameters. Same parameters as unsharded, bit for bit on hpctrain's
ring (the update is per element, the sums are the same); within 1e-6 under
SGD on MPI's native path (another reduction order). Checkpoints are the same
file either way, so each resumes the other.

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_shard_optimizer.py   # the bucket update
    python -m pytest tests/test_shard_optimizer.py                                     # jobs
"""
import json
import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from conftest import checkpoint_floats, checkpoint_path, remove_checkpoint
from collectives import ring_step
from hpctrain import data as data_mod
from hpctrain.base import device
from hpctrain.comm.mpi import MpiAllreduce
from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.comm.staged import StagedAllreduce
from hpctrain.nn import mlp
from hpctrain.optim.optimizers import state_bytes
from hpctrain.loops.ring_step import RingStep

HIDDEN = (37, 19)
STRATEGIES = {"ring": RingAllreduce, "mpi": MpiAllreduce,
              # the staging through host memory a GPU without CUDA-aware MPI takes, with a host stand-in
              "staged ring": lambda comm: StagedAllreduce(RingAllreduce(comm), device.HostCopier(),
                                                          chunk_bytes=1024)}


# --- the sharded bucket update, on any number of ranks ----------------------

def run_steps(comm, strategy_name, optimizer, sharded, fusion_elems, overlap, steps=4):
    """The ring loop's arithmetic for a few steps, without data: gradients of a
    fixed random batch per (rank, step). Returns (params, losses, stops) where
    losses and stops are the summed values every rank read after each step."""
    rng = np.random.default_rng(100 + comm.rank)
    strategy = STRATEGIES[strategy_name](comm)
    ring = RingStep(mlp(hidden=HIDDEN), strategy, comm, np, (optimizer, {}), fusion_elems, zero=int(sharded),
                    overlap=overlap)
    model, opt = ring.model, ring.optimizer
    model.init(0)
    losses, stops = [], []
    for step in range(steps):
        x = rng.random((8, 784)).astype(np.float32)
        y = rng.integers(0, 10, 8)
        # only the last rank asks to stop, at step 2
        ring.begin(1e-2, step == 2 and comm.rank == comm.size - 1)
        loss, stop = ring_step(ring, x, y, comm.rank + 1 + step)   # a loss whose sum each rank can compute
        losses.append(loss)
        stops.append(stop)
    ring.close()
    getattr(strategy, "inner", strategy).free()
    return model.params.copy(), losses, stops, opt


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("fusion_elems, overlap", [(0, False), (300, False), (300, True), (5000, True)])
def test_sharded_bucket_update_is_bit_identical_on_the_ring(optimizer, fusion_elems, overlap):
    comm = MPI.COMM_WORLD
    size = comm.size
    plain, plain_losses, plain_stops, _ = run_steps(comm, "ring", optimizer, False, fusion_elems, overlap)
    shard, losses, stops, opt = run_steps(comm, "ring", optimizer, True, fusion_elems, overlap)
    assert np.array_equal(plain, shard)
    # the same on every rank
    everyone = np.empty((size, shard.size), shard.dtype)
    comm.Allgather(shard, everyone)
    assert all(np.array_equal(row, shard) for row in everyone)
    # the summed loss and the stop flag reach every rank
    expect = [float(sum(r + 1 + step for r in range(size))) for step in range(4)]
    assert losses == plain_losses == expect
    assert stops == plain_stops == [False, False, True, False]
    # state for this rank's share only; all shares together cover the buffer once
    n = opt.full_size
    owned = np.array([opt.size], np.int64)
    comm.Allreduce(MPI.IN_PLACE, owned)
    assert owned[0] == n
    assert opt.size <= n / size + 3   # one chunk of each of at most 3 buckets
    assert state_bytes(opt) == opt.size * 4 * len(opt.state_names)


@pytest.mark.mpi
@pytest.mark.parametrize("fusion_elems, overlap", [(0, False), (300, True)])
def test_sharded_update_staged_through_host_memory_is_bit_identical(fusion_elems, overlap):
    comm = MPI.COMM_WORLD
    plain, plain_losses, _, _ = run_steps(comm, "ring", "adam", False, fusion_elems, overlap)
    shard, losses, stops, _ = run_steps(comm, "staged ring", "adam", True, fusion_elems, overlap)
    assert np.array_equal(plain, shard) and losses == plain_losses
    assert stops == [False, False, True, False]


@pytest.mark.mpi
@pytest.mark.parametrize("fusion_elems", [0, 300])
def test_sharded_update_on_mpi_collectives_is_within_1e_6_under_sgd(fusion_elems):
    comm = MPI.COMM_WORLD
    plain, _, _, _ = run_steps(comm, "ring", "sgd", False, fusion_elems, False)
    shard, losses, _, _ = run_steps(comm, "mpi", "sgd", True, fusion_elems, False)
    assert float(np.abs(plain - shard).max()) <= 1e-6
    assert losses[0] == float(sum(r + 1 for r in range(comm.size)))


# --- jobs ------------------------------------------------------------------

COMMON = ["--steps", "12", "--log-every", "6", "--batch-size", "16", "--hidden", "37,19", "--timeout", "60"]
LR = {"sgd": "0.05", "momentum": "0.01", "adam": "0.001"}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shard") / "mnist"
    data_mod.prepare(data_mod.bundled_sample_dir(), out, shards=4, log=None)
    return out


def params(path):
    with h5py.File(path, "r") as f:
        return {f"{g}/{k}": f[g][k][()] for g in f for k in f[g]}


def final(path):
    return json.loads(path.read_text().splitlines()[-1])


def train(job, out, ranks, flags, data_dir, name):
    out.mkdir(parents=True, exist_ok=True)
    r = job(ranks, *COMMON, *flags, "--data", data_dir, "--save", out / f"{name}.h5",
            "--metrics", out / f"{name}.jsonl", timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def flags_of(optimizer):
    return ["--optimizer", optimizer, "--lr", LR[optimizer], "--fusion-mb", "0.003"]


def unsharded(job, once, shards, ranks, optimizer):
    """The folder of the unsharded run of `optimizer` on `ranks` (off.h5,
    off.jsonl): one job for the sharded run it is compared with and the
    resumes that must end where it does."""
    def make(out):
        train(job, out, ranks, [*flags_of(optimizer), "--shard-optimizer", "off"], shards, "off")
        return out
    return once(("test_shard_optimizer unsharded", ranks, optimizer, str(shards)), make)


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_sharded_job_gives_the_same_parameters(job, once, tmp_path, shards, ranks, optimizer):
    whole = unsharded(job, once, shards, ranks, optimizer)
    train(job, tmp_path, ranks, [*flags_of(optimizer), "--shard-optimizer", "on"], shards, "on")
    assert_same(params(whole / "off.h5"), params(tmp_path / "on.h5"))
    off, on = final(whole / "off.jsonl"), final(tmp_path / "on.jsonl")
    assert (off["shard_optimizer"], on["shard_optimizer"]) == ("off", "on")
    assert on["test_loss"] == off["test_loss"]
    # the largest share of the state is about 1/N of all of it
    assert on["optimizer_state_bytes"] <= off["optimizer_state_bytes"] / ranks + 4096
    assert optimizer == "sgd" or on["optimizer_state_bytes"] > 0


@pytest.mark.parametrize("ranks, flags", [
    (1, ["--optimizer", "adam"]),
    (3, ["--optimizer", "adam", "--overlap", "on", "--fusion-mb", "0.003"]),
    (3, ["--optimizer", "momentum", "--lr", "0.01", "--overlap", "off", "--fusion-mb", "0.0001"]),
    (4, ["--optimizer", "adam", "--fusion-mb", "0"]),
])
def test_sharded_job_same_with_overlap_and_buckets(job, tmp_path, shards, ranks, flags):
    train(job, tmp_path, ranks, [*flags, "--shard-optimizer", "off"], shards, "off")
    train(job, tmp_path, ranks, [*flags, "--shard-optimizer", "on"], shards, "on")
    assert_same(params(tmp_path / "off.h5"), params(tmp_path / "on.h5"))


def test_sharded_job_on_mpi_collectives_within_1e_6_under_sgd(job, once, tmp_path, shards):
    whole = unsharded(job, once, shards, 3, "sgd")
    train(job, tmp_path, 3, [*flags_of("sgd"), "--shard-optimizer", "on", "--allreduce", "mpi"], shards, "on")
    a, b = params(whole / "off.h5"), params(tmp_path / "on.h5")
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) <= 1e-6


@pytest.mark.parametrize("first, then", [("on", "off"), ("off", "on")])
def test_checkpoints_resume_across_sharding_bit_exact(job, once, tmp_path, shards, first, then):
    """Checkpoints at 4, 8, 12 written one way; the two newest removed; the
    run resumed from step 4 the other way ends where an uninterrupted run ends."""
    flags = flags_of("adam")
    whole = unsharded(job, once, shards, 3, "adam")
    ckpt = tmp_path / "ckpt"
    every = ["--checkpoint-dir", ckpt, "--checkpoint-every", "4"]
    train(job, tmp_path / "cut", 3, [*flags, *every, "--shard-optimizer", first], shards, "p")
    for step in (8, 12):
        remove_checkpoint(checkpoint_path(ckpt, step))
    r = train(job, tmp_path / "cut", 3, [*flags, *every, "--shard-optimizer", then], shards, "p")
    assert "resumed from" in r.stdout and "at step 4" in r.stdout, r.stdout
    assert_same(params(whole / "off.h5"), params(tmp_path / "cut" / "p.h5"))
    # and the checkpoint at the end holds the same state as an unsharded one
    floats = checkpoint_floats(checkpoint_path(ckpt, 12))   # named tensors: each one's Adam m whole beside it
    tensors = {k: v for k, v in floats.items() if not k.startswith("adam.")}
    assert tensors and all(floats[f"adam.m/{k}"].shape == v.shape for k, v in tensors.items()), list(floats)


@pytest.mark.parametrize("flags, expect", [
    (["--allreduce", "nccl"], "--shard-optimizer on does not work with --allreduce nccl"),
    (["--mode", "ps"], "--shard-optimizer on is for --mode ring"),
])
def test_sharding_where_it_cannot_work_is_one_line_and_exit_2(job, tmp_path, flags, expect):
    r = job(2, *flags, "--shard-optimizer", "on", "--metrics", tmp_path / "m.jsonl", timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("hpctrain: error:") and expect in errors[0], r.stderr
    assert os.listdir(tmp_path) == []
