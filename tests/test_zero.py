"""--zero 2 (ZeRO stage 2 in ring mode): each rank keeps its 1/N shard of
the summed gradient and a few bucket-sized slots, never a full-length
gradient, and gets stage 1's parameters bit for bit (the same
reduce-scatters, the same update on the same shard): with several buckets
so slots are reused, overlapped or not, --clip-norm's norm from the shards,
--accumulate-steps, a tied tensor (the GPT's head and embedding), sizes that
do not divide by the ranks. Jobs: --zero 2 against --zero 1 and 0, and a
resume across stages (the refusals are in tests/test_train.py).

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_zero.py   # the update, at 2, 3, 4 ranks in CI
    python -m pytest tests/test_zero.py                                     # slots; jobs
"""
import json
import shutil

import numpy as np
import pytest
from mpi4py import MPI

from collectives import ring_step
from conftest import flat_from_named, prepared_plays, same_bytes, saved
from test_hier import hier_on_fake_nodes
from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.comm.data_parallel import model_buckets
from hpctrain.nn import mlp
from hpctrain.nn.zoo import resnet, small_cnn
from hpctrain.nn.gpt import gpt
from hpctrain.nn.grad_slots import GradSlots
from hpctrain.loops.ring_step import RingStep
from hpctrain.optim.clipping import Clip
from hpctrain.run.plan import Compression

# every layer its own bucket at 200 elements (slots reused), none of them a multiple of the ranks
MODELS = {"mlp": lambda: mlp((13,), 10, (37, 29, 23, 19)), "gpt": lambda: gpt(13, 8, 4, 2, 12),
          "small_cnn": lambda: small_cnn((12, 12), 10), "resnet": lambda: resnet((12, 12), 10, width=4)}


def batch(name, rng):
    if name == "mlp":
        return rng.random((8, 13)).astype(np.float32), rng.integers(0, 10, 8)
    if name in ("small_cnn", "resnet"):
        return rng.random((4, 12, 12)).astype(np.float32), rng.integers(0, 10, 4)
    return rng.integers(0, 13, (6, 8)), rng.integers(0, 13, (6, 8))


def run_steps(comm, name, stage, fusion_elems, overlap, clip=None, accumulate=1, steps=4, make=RingAllreduce,
              compression=None):
    """Stage 1, 2 or 3 of ring mode's step for a few steps of a fixed random
    batch per (rank, step), over the strategy make(comm): (params, losses,
    the step's model)."""
    rng = np.random.default_rng(100 + comm.rank)
    strategy = make(comm)
    ring = RingStep(MODELS[name](), strategy, comm, np, ("adam", {"weight_decay": 0.1}), fusion_elems,
                    zero=stage, overlap=overlap, clip=Clip(clip) if clip else None,
                    accumulate=accumulate, compression=Compression(compression) if compression else None)
    ring.model.init(0)
    losses = []
    for step in range(steps):
        ring.begin(1e-2, False)
        for _ in range(accumulate - 1):
            ring.accumulate(*batch(name, rng))
        x, y = batch(name, rng)
        losses.append(ring_step(ring, x, y, comm.rank + 1 + step)[0])
    params = gathered(ring)
    ring.close()
    strategy.free()
    return params, losses, ring


def gathered(ring):
    """The model's parameters: its buffer's copy, or (stage 3) each bucket gathered in turn."""
    store = ring.store
    if store is None:
        return ring.model.params.copy()
    out = np.zeros(ring.model.num_params, ring.param_shard.buf.dtype)
    for j, (lo, hi) in enumerate(store.params.buckets):
        store.ensure(j)
        out[lo:hi] = store.params[lo:hi]
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("fusion_elems, overlap", [(0, False), (200, False), (200, True)])
@pytest.mark.parametrize("clip, accumulate", [(None, 1), (0.5, 1), (0.5, 3)])
def test_stage_2_gives_stage_1s_parameters_bit_for_bit(name, fusion_elems, overlap, clip, accumulate):
    comm = MPI.COMM_WORLD
    one, one_losses, _ = run_steps(comm, name, 1, fusion_elems, overlap, clip, accumulate)
    two, losses, ring = run_steps(comm, name, 2, fusion_elems, overlap, clip, accumulate)
    assert np.array_equal(one, two) and losses == one_losses
    assert np.isfinite(two).all() and not np.array_equal(two, MODELS_INIT(name))   # it trained
    grads, n = ring.model.grads, ring.model.num_params
    assert isinstance(grads, GradSlots)
    if fusion_elems:   # several buckets: no full-length gradient anywhere
        assert len(grads.buckets) > 3
        assert len(grads.slots) == (2 if overlap else 1) + (name == "gpt")   # the tied embedding's own
        assert grads.nbytes < n * 4 * (0.75 if overlap else 0.5)
        shard = ring.update.parts[0].shard   # kept for the clip norm only (comm/data_parallel.Summed)
        assert (shard is None) == (clip is None)
        assert shard is None or shard.buf.size <= n / comm.size + len(grads.buckets)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("fusion_elems, overlap", [(200, False), (200, True)])
@pytest.mark.parametrize("compression", [None, "bf16", "fp16"])
def test_stage_2_on_nodes_gives_stage_1s_parameters_bit_for_bit(name, fusion_elems, overlap, compression):
    """hier (two ranks a node where the size allows): its shards are a
    sub-slice of the node's part, as a cluster's are; compressed, the
    node ring's (NodeShards) where there are several nodes."""
    comm = MPI.COMM_WORLD
    one, one_losses, _ = run_steps(comm, name, 1, fusion_elems, overlap, 0.5, make=hier_on_fake_nodes,
                                   compression=compression)
    two, losses, _ = run_steps(comm, name, 2, fusion_elems, overlap, 0.5, make=hier_on_fake_nodes,
                               compression=compression)
    assert np.array_equal(one, two) and losses == one_losses


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
@pytest.mark.parametrize("overlap", [False, True])
def test_stage_2_compressed_gives_stage_1s_parameters_bit_for_bit(name, compression, overlap):
    comm = MPI.COMM_WORLD
    one, one_losses, _ = run_steps(comm, name, 1, 200, overlap, 0.5, compression=compression)
    two, losses, _ = run_steps(comm, name, 2, 200, overlap, 0.5, compression=compression)
    assert np.array_equal(one, two) and losses == one_losses
    plain, _, _ = run_steps(comm, name, 2, 200, overlap, 0.5)
    assert not np.array_equal(plain, two)   # compressed: other bits


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["small_cnn", "resnet"])
@pytest.mark.parametrize("overlap", [False, True])
def test_stage_2_gives_stage_1s_parameters_for_the_cnns(name, overlap):
    """Convolutions, and batch norm's statistics beside the gradient (resnet)."""
    comm = MPI.COMM_WORLD
    one, one_losses, _ = run_steps(comm, name, 1, 300, overlap, 0.5, accumulate=2)
    two, losses, ring = run_steps(comm, name, 2, 300, overlap, 0.5, accumulate=2)
    assert np.array_equal(one, two) and losses == one_losses
    assert len(ring.model.grads.buckets) > 3


def MODELS_INIT(name):
    model = MODELS[name]().build(np)
    model.init(0)
    return model.params


# --- the slots, on one process -----------------------------------------------

def test_buckets_take_the_shared_slots_in_turn_and_a_tied_home_has_its_own():
    buckets = [(90, 100), (60, 90), (40, 60), (10, 40), (0, 10)]
    slots = GradSlots(100, buckets, homes=[(2, 8)], shared=2)
    assert [slots.reuses(i) for i in range(5)] == [None, None, 0, 1, None]
    assert slots.slot_of[4] not in slots.slot_of[:4]
    assert [s.size for s in slots.slots] == [20, 30, 10]   # each shared slot as long as its longest bucket
    slots[12:20][...] = 7
    assert slots[10:40][2:10].tolist() == [7] * 8 and slots.slots[slots.slot_of[3]][2:10].tolist() == [7] * 8
    with pytest.raises(ValueError, match="crosses"):
        slots[35:45]
    with pytest.raises(ValueError, match="cover"):
        GradSlots(100, [(50, 100), (0, 40)])


def test_a_gpt_built_over_slots_binds_every_gradient_into_them():
    spec = gpt(13, 8, 2, 2, 12)
    buckets = model_buckets(spec.layer_ranges, spec.num_params, 200)
    slots = GradSlots(spec.num_params, buckets, homes=[(t.lo, t.hi) for t in spec.ties])
    model = spec.build(np, grads=slots)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 13, (4, 8)), rng.integers(0, 13, (4, 8))
    plain = spec.build(np)
    plain.init(0)
    model.params[...] = plain.params
    plain.forward_backward(x, y)
    # one bucket at a time (as comm/fusion.py consumes them): each layer's
    # gradient read from its slot as the layer is done
    got = np.full(spec.num_params, np.nan, np.float32)

    def done(k):
        lo, hi = spec.layer_ranges[k]
        got[lo:hi] = slots[lo:hi]
    model.forward_backward(x, y, on_layer_done=done)
    assert np.array_equal(got, plain.grads)


# --- jobs ---------------------------------------------------------------------

MLP = ["--hidden", "37,19", "--steps", "12", "--log-every", "6", "--batch-size", "16", "--optimizer", "adam",
       "--lr", "0.001", "--fusion-mb", "0.003", "--clip-norm", "1", "--timeout", "60"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from hpctrain import data
    out = tmp_path_factory.mktemp("zero") / "mnist"
    data.prepare(data.bundled_sample_dir(), out, shards=4, log=None)
    return out


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return prepared_plays(tmp_path_factory, 20_000)


def same_tensors(model, file):
    """A model's {name: tensor} against a --save file's datasets ({group/name: array}), bit for bit."""
    return set(model) <= set(file) and all(model[k].tobytes() == file[k].tobytes() for k in model)


def trained(job, ranks, flags, out, name):
    r = job(ranks, *flags, "--save", out / f"{name}.h5", "--metrics", out / f"{name}.jsonl", timeout=180)
    assert r.returncode == 0, r.stderr
    return json.loads((out / f"{name}.jsonl").read_text().splitlines()[-1])


def zero_1_run_through(job, once, shards):
    """MLP's 12 steps at --zero 1 on 3 ranks, uninterrupted: (folder, final
    metrics); its p.h5 the parameters every stage and every resume on 3
    ranks must end on (one job for this file's tests, not one a test)."""
    def make(out):
        return out, trained(job, 3, [*MLP, "--data", shards, "--zero", 1], out, "p")
    return once(("test_zero", "mlp zero 1 on 3 ranks", str(shards)), make)


def test_every_zero_stage_trains_the_parameters_of_zero_0(job, once, tmp_path, shards):
    """Stages 1, 2 and 3 (tests/test_zero3.py) give stage 0's --save file, bit for bit."""
    one, final = zero_1_run_through(job, once, shards)
    assert final["zero"] == 1
    for z in (0, 2, 3):
        final = trained(job, 3, [*MLP, "--data", shards, "--zero", z], tmp_path, f"z{z}")
        assert final["zero"] == z
        assert same_bytes(one / "p.h5", tmp_path / f"z{z}.h5")


def test_zero_2_trains_the_gpt_of_zero_1_with_accumulation(job, tmp_path, text_dir):
    """The tied head and embedding, dropout on, 2 micro-batches a step, clipped."""
    flags = ["--data", text_dir, "--model", "gpt:layers=3,heads=2,width=16,dropout=0.1", "--block-size", 16,
             "--batch-size", 4, "--steps", 4, "--accumulate-steps", 2, "--clip-norm", 0.5, "--fusion-mb", 0.005,
             "--lr", 1e-3]
    for z in (1, 2):
        trained(job, 2, [*flags, "--zero", z], tmp_path, f"z{z}")
    assert same_bytes(tmp_path / "z1.h5", tmp_path / "z2.h5")


@pytest.mark.parametrize("first, then, ranks, fmt", [(2, 0, 3, "flat"), (0, 2, 3, "named"), (3, 0, 3, "named"),
                                                     (0, 3, 3, "flat"), (3, 3, 2, "named")])
def test_checkpoints_resume_across_stages_and_ranks_bit_exact(job, once, tmp_path, shards, first, then, ranks,
                                                              fmt):
    """Checkpoints at 4, 8, 12 at one stage on 3 ranks, the two newest
    removed, resumed at step 4 at the other stage (or on 2 ranks): where an
    uninterrupted run ends (the checkpoint holds the whole named tensors
    at every stage, each rank's parts written by it, and read back into
    each rank's parts; `flat`: resumed from the old flat file of the same
    values, conftest.flat_from_named). The run that writes the checkpoints
    is one job a first stage, copied for each case that starts from it."""
    def written(out):
        (out / "cut").mkdir()
        trained(job, 3, [*MLP, "--data", shards, "--checkpoint-dir", out / "ckpt", "--checkpoint-every", 4,
                         "--zero", first], out / "cut", "p")
        return out
    made = once(("test_zero", "mlp checkpoints at zero", first, str(shards)), written)
    ckpt, cut = tmp_path / "ckpt", tmp_path / "cut"
    shutil.copytree(made / "ckpt", ckpt)
    shutil.copytree(made / "cut", cut)
    every = ["--checkpoint-dir", ckpt, "--checkpoint-every", 4]
    for step in (8, 12):
        shutil.rmtree(ckpt / f"ckpt-{step:08d}")
    if fmt == "flat":
        flat_from_named(ckpt / "ckpt-00000004")
    final = trained(job, ranks, [*MLP, "--data", shards, *every, "--zero", then], cut, "p")
    assert final["zero"] == then
    # the last checkpoint, read whole by name (evaluate, predict): the --save file's tensors
    from hpctrain.checkpoints.trained import load_checkpoint
    assert same_tensors(dict(load_checkpoint(ckpt).model.tensors()), saved(cut / "p.h5"))
    if ranks == 3:   # on another N the batches are others'
        assert same_bytes(zero_1_run_through(job, once, shards)[0] / "p.h5", cut / "p.h5")


def test_a_model_refused_on_one_rank_trains_at_the_stage_and_on_the_ranks_the_refusal_names(job, tmp_path):
    """--memory-budget refuses the model on one rank (16 bytes a parameter
    with Adam: 0.62 GiB), naming the fewest ranks at stage 2 or 3 that fit:
    2 at stage 3 (0.34 GiB: the Dense buckets' gradients written over their
    gathered parameters, one slot; 0.40 with a gradient slot beside it, when
    stage 2 on 4 ranks, 0.34, was named; 2 at stage 2 would need 0.41);
    there it trains, and every rank's measured peak (363 MB here; 370 at
    stage 2 on 4 ranks) stays under the budget (399 MB). No final
    evaluation: the budget is the training's (its batch's activations), and
    evaluating the 37M parameters on the test set took most of the job's time."""
    big = ["--hidden", "4096,4096,4096", "--steps", "4", "--log-every", "4", "--batch-size", "16",
           "--memory-budget", "0.39", "--final-eval", "off"]
    refused(job, 1, big, "; --zero 3 on 2 ranks would fit (")
    final = trained(job, 2, [*big, "--zero", 3], tmp_path, "z3")
    assert final["peak_rss_mb"] < 0.39 * 1024, final["peak_rss_mb"]   # the largest of any rank


def refused(job, ranks, flags, names):
    """The memory check's one line for `flags` on `ranks`, naming what would fit (`names`)."""
    r = job(ranks, *flags, timeout=120)
    lines = [s for s in r.stderr.splitlines() if s.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "needs at least" in lines[0] and names in lines[0], lines
