"""--pipeline-stages P --micro-batches M: the layers cut into P stages on P x R
ranks end with the parameters of --accumulate-steps M on R ranks, bit for
bit (every schedule, even and uneven cuts, R = 1, 2 and 3, an MLP and a CNN
with dropout, with --clip-norm; the interleaved one with V = 1, 2 and 3 chunks
a stage at P = 2, 3 and 4, R = 1, 2 and 3, with batch norm); under SGD M = 1, 2, 4, 8 agree within 1e-6; flags a pipeline cannot run
with are one line, exit 2, on the whole job.

    .venv/bin/python -m pytest -q tests/test_pipeline.py
"""
import json
import os

import numpy as np
import pytest

from conftest import REPO, saved, same_bytes
from hpctrain.base.errors import HpctrainError
from hpctrain.flags import cli
from hpctrain.nn import mlp, spec_for
from hpctrain.pipeline import schedule as sched
from hpctrain.pipeline.stages import cuts_for

TINY = os.path.join(REPO, "tests", "models", "tiny_cnn.py")
MLP = ["--hidden", "64,32,16"]   # Flatten, then Dense/ReLU x 3, Dense: 8 layers, 4 with parameters
SHORT = ["--steps", "6", "--batch-size", "8", "--log-every", "3"]


def ok(r):
    assert r.returncode == 0, r.stderr
    return r


# One BLAS thread on both sides of a comparison: a 1024-wide product split
# over threads sums in another order.
ONE_THREAD = {var: "1" for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def accumulated(job, once, ranks, flags, micro):
    """(--save file, final record) of flags with --accumulate-steps micro on
    `ranks` ranks: the run a pipeline of these flags must end as, launched
    once for every test of the session that compares with it."""
    def make(out):
        ok(job(ranks, *flags, "--accumulate-steps", micro, "--save", out / "acc.h5", "--metrics", out / "acc.jsonl",
               env=ONE_THREAD))
        return out / "acc.h5", json.loads((out / "acc.jsonl").read_text().splitlines()[-1])
    return once(("test_pipeline accumulated", ranks, micro, *map(str, flags)), make)


@pytest.mark.parametrize("ranks, stages, micro, schedule, split, model", [
    (2, 2, 3, "1f1b", "", MLP),
    (2, 2, 3, "gpipe", "", MLP),
    (4, 2, 2, "1f1b", "", MLP),              # R = 2 replicas per stage
    (3, 3, 4, "gpipe", "2,6", MLP),          # uneven: 1, 2 and 1 layers with parameters
    (3, 3, 2, "1f1b", "4,7", MLP),           # M < P
    (4, 4, 4, "1f1b", "", MLP),
    (4, 4, 3, "gpipe", "", MLP),
    (2, 2, 2, "1f1b", "", ["--model", f"{TINY}:without_batch_norm"]),   # convolutions, dropout
    # R = 3: a sum of three is order-dependent; with buckets of one layer each
    # the stages average ring mode's buckets, in its order (pipeline/stages.py)
    (6, 2, 2, "gpipe", "", [*MLP, "--fusion-mb", "0.0001"]),           # (auto: --shard-optimizer on)
    (6, 2, 2, "1f1b", "", [*MLP, "--fusion-mb", "0.0001", "--shard-optimizer", "off"]),
], ids=["p2-1f1b", "p2-gpipe", "p2r2", "p3-uneven-gpipe", "p3-m<p", "p4-1f1b", "p4-gpipe", "p2-cnn", "p2r3", "p2r3-unsharded"])
def test_pipeline_equals_accumulation_on_one_stage(job, once, tmp_path, ranks, stages, micro, schedule, split,
                                                   model):
    flags = [*SHORT, *model]
    pipe = ["--pipeline-stages", stages, "--micro-batches", micro, "--pipeline-schedule", schedule,
            *(["--pipeline-split", split] if split else [])]
    r = ok(job(ranks, *flags, *pipe, "--save", tmp_path / "pipe.h5", "--metrics", tmp_path / "m.jsonl",
               env=ONE_THREAD))
    acc, _ = accumulated(job, once, ranks // stages, flags, micro)
    assert same_bytes(tmp_path / "pipe.h5", acc)
    final = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert (final["pipeline_stages"], final["micro_batches"], final["schedule"], final["replicas"]) == \
        (stages, micro, schedule, ranks // stages), final
    assert final["global_batch"] == 8 * micro * (ranks // stages), final
    assert "step      6/6" in r.stdout, r.stdout


DEEP = ["--hidden", "64,32,16,16,16"]   # 12 layers, 6 with parameters: P x V = 6 chunks


@pytest.mark.parametrize("ranks, stages, virtual, micro, model", [
    (2, 2, 2, 4, MLP),                      # 4 chunks of one layer with parameters each, round the 2 stages
    (2, 2, 2, 2, ["--model", f"{TINY}:without_batch_norm"]),   # convolutions, dropout
    (2, 2, 2, 2, ["--model", f"{TINY}:build"]),               # batch norm's state
    (4, 2, 2, 4, MLP),                      # R = 2 replicas per stage (auto: --shard-optimizer on)
    (4, 2, 2, 2, [*MLP, "--shard-optimizer", "off", "--optimizer", "momentum"]),
    (2, 2, 3, 2, DEEP),                     # V = 3
    (3, 3, 2, 3, DEEP),                     # P = 3: chunk 2 on stage 2 hands on to stage 0's second chunk
    (2, 2, 1, 2, MLP),                      # V = 1: the interleaved order over one chunk a stage
    (4, 4, 2, 4, ["--hidden", "64,32,16,16,16,16,16"]),      # P = 4: 8 chunks
    (6, 2, 2, 2, [*MLP, "--fusion-mb", "0.0001"]),           # R = 3: ring mode's one-layer buckets, in its order
    # 256 KB activations a message, past MPI's eager limit: each send waits for its receive
    (2, 2, 2, 4, ["--hidden", "1024,1024,1024", "--batch-size", "64", "--steps", "2"]),
], ids=["p2v2", "p2v2-cnn", "p2v2-cnn-bn", "p2v2r2", "p2v2r2-unsharded", "p2v3", "p3v2", "p2v1", "p4v2",
        "p2v2r3", "p2v2-large-messages"])
def test_interleaved_equals_accumulation_on_one_stage(job, once, tmp_path, ranks, stages, virtual, micro, model):
    """--pipeline-schedule interleaved --virtual-stages V: each stage holds V
    chunks of the layers (chunk c on stage c mod P), activations go chunk to
    chunk round the stages; the parameters end bit-identical to
    --accumulate-steps M on R ranks, and the evaluation through the chunks
    gives the one-stage run's test loss and accuracy."""
    flags = [*SHORT, *model]
    pipe = ["--pipeline-stages", stages, "--micro-batches", micro, "--pipeline-schedule", "interleaved",
            "--virtual-stages", virtual]
    r = ok(job(ranks, *flags, *pipe, "--save", tmp_path / "pipe.h5", "--metrics", tmp_path / "m.jsonl",
               env=ONE_THREAD))
    acc, alone = accumulated(job, once, ranks // stages, flags, micro)
    assert same_bytes(tmp_path / "pipe.h5", acc)
    final = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert (final["pipeline_stages"], final["micro_batches"], final["schedule"], final["virtual_stages"],
            final["replicas"]) == (stages, micro, "interleaved", virtual, ranks // stages), final
    assert (final["test_loss"], final["test_accuracy"]) == (alone["test_loss"], alone["test_accuracy"])
    assert f"interleaved, {virtual} chunks a stage" in r.stdout or virtual == 1, r.stdout


def test_each_stage_reads_only_what_it_uses(job, tmp_path):
    """From the training shards the first stage reads the images alone, the
    last the labels alone, the middle one nothing (h5py's reads, recorded per
    rank by tests/record_reads.py); the test set is every rank's, for the
    evaluation of the whole model at the end."""
    reads = tmp_path / "reads"
    reads.mkdir()
    ok(job(3, *SHORT, *MLP, "--pipeline-stages", 3, "--micro-batches", 2, module="record_reads",
           env={"PYTHONPATH": os.path.dirname(os.path.abspath(__file__)), "RECORD_READS": str(reads)}))
    train = {}
    for rank in range(3):
        lines = (reads / f"{rank}.txt").read_text().split("\n") if (reads / f"{rank}.txt").exists() else []
        train[rank] = {line.split()[1] for line in lines if line.startswith("train-")}
    assert train == {0: {"images"}, 1: set(), 2: {"labels"}}, train


def test_batches_through_the_gpu_prefetcher_change_no_bit(job, tmp_path):
    """The GPU batch path on NumPy (tests/prefetched_batches.py: the
    prefetcher over deferred, NaN-fresh stand-in copies): every stage's
    batches, positions and dropout draws as the plain run's, bit for bit."""
    flags = [*SHORT, "--model", f"{TINY}:without_batch_norm", "--pipeline-stages", 3, "--micro-batches", 2]
    ok(job(3, *flags, "--save", tmp_path / "plain.h5"))
    ok(job(3, *flags, "--save", tmp_path / "prefetched.h5", module="prefetched_batches",
           env={"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}))
    assert same_bytes(tmp_path / "plain.h5", tmp_path / "prefetched.h5")


def max_diff(a, b):
    a, b = saved(a), saved(b)
    assert set(a) == set(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def test_micro_batch_count_changes_nothing_but_rounding(job, tmp_path):
    """Under SGD, M = 1, 2, 4, 8 micro-batches of 16 / M samples (the same 16
    a step) end within 1e-6 of each other, absolute, in every parameter (the
    sums of M gradients and of M losses are taken in other orders); training
    moved the parameters by more than 1e-2 from their start, so that is
    within 1e-4 of what the 12 steps did (pytorch#55036: a pipeline whose
    result moves with M beyond that)."""
    flags = [*MLP, "--optimizer", "sgd", "--lr", "0.05", "--steps", "12", "--log-every", "6",
             "--pipeline-stages", "2"]
    for m in (1, 2, 4, 8):
        ok(job(2, *flags, "--micro-batches", m, "--batch-size", 16 // m, "--save", tmp_path / f"m{m}.h5"))
    for m in (2, 4, 8):
        assert max_diff(tmp_path / "m1.h5", tmp_path / f"m{m}.h5") < 1e-6, m
    spec = mlp(hidden=(64, 32, 16))
    start = spec.build(np)
    start.init(0)   # --seed 0
    moved = max(float(np.abs(saved(tmp_path / "m1.h5")[name] - start.params[lo:hi].reshape(shape)).max())
                for name, shape, lo, hi in spec.tensors)
    assert moved > 1e-2, moved


@pytest.mark.parametrize("ranks, fusion, optimizer", [
    (4, ["--fusion-mb", "0.0001"], []),                                   # one layer a bucket: bit for bit
    (4, ["--fusion-mb", "0.0001", "--shard-optimizer", "off"], []),      # (auto: sharded over the R = 2)
    (2, [], ["--optimizer", "sgd", "--lr", "0.05"]),                      # one bucket across the cut
], ids=["per-layer-buckets-r2-sharded", "per-layer-buckets-r2-unsharded", "one-bucket"])
def test_clip_norm_spans_the_stages_as_accumulation_clips(job, tmp_path, ranks, fusion, optimizer):
    """--clip-norm: the norm of the whole averaged gradient, from each stage's
    sums of squares over ring mode's parts (pipeline/norm.py). With buckets of
    one layer no part crosses the cut, the sums are ring mode's own and the
    parameters bit-identical to --accumulate-steps 3 --clip-norm 0.3. With one
    bucket across the cut (the default --fusion-mb here) a part is summed in
    two pieces: the float64 norm moves by ~1e-15 relative (a pairwise sum of
    exact float32 squares), which reaches the float32 grad scale the optimizer
    multiplies by only at a rounding boundary, and then by one ulp (6e-8
    relative). Under SGD a step moves a parameter by at most lr x 0.3 = 0.015,
    so 6 steps differ by ~6 x 0.015 x 6e-8 = 5e-9 at most: held to 1e-7."""
    flags = [*SHORT, *MLP, *fusion, *optimizer, "--clip-norm", "0.3"]
    ok(job(ranks, *flags, "--pipeline-stages", 2, "--micro-batches", 3, "--save", tmp_path / "pipe.h5",
           "--metrics", tmp_path / "pipe.jsonl"))
    ok(job(ranks // 2, *flags, "--accumulate-steps", 3, "--save", tmp_path / "acc.h5",
           "--metrics", tmp_path / "acc.jsonl"))
    pipe, acc = ([json.loads(line) for line in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
                 for n in ("pipe", "acc"))
    assert pipe[-1]["clipped_steps"] == acc[-1]["clipped_steps"] == 6, pipe[-1]   # the clip acted
    np.testing.assert_allclose([r["grad_norm"] for r in pipe[:-1]], [r["grad_norm"] for r in acc[:-1]], rtol=1e-12)
    if fusion:
        assert same_bytes(tmp_path / "pipe.h5", tmp_path / "acc.h5")
    else:
        assert max_diff(tmp_path / "pipe.h5", tmp_path / "acc.h5") < 1e-7


@pytest.mark.parametrize("ranks, flags", [
    (2, ["--fusion-mb", "0.0001"]),                                    # one layer a bucket: bit for bit
    (4, ["--fusion-mb", "0.0001"]),                                    # R = 2 (auto: sharded)
    (4, ["--fusion-mb", "0.0001", "--shard-optimizer", "off"]),
], ids=["p2v2", "p2v2r2-sharded", "p2v2r2-unsharded"])
def test_clip_norm_spans_the_chunks_as_accumulation_clips(job, tmp_path, ranks, flags):
    """--clip-norm with the interleaved schedule: each stage sums the squares
    of its chunks' pieces of ring mode's parts, one slot a (part, chunk,
    replica), and every chunk's update takes the one clip factor: with
    buckets of one layer the parameters of --accumulate-steps 2 --clip-norm
    0.3, bit for bit, the same norm every step."""
    flags = [*SHORT, *MLP, *flags, "--clip-norm", "0.3"]
    ok(job(ranks, *flags, *INTERLEAVED, "--micro-batches", 2, "--save", tmp_path / "pipe.h5",
           "--metrics", tmp_path / "pipe.jsonl"))
    ok(job(ranks // 2, *flags, "--accumulate-steps", 2, "--save", tmp_path / "acc.h5",
           "--metrics", tmp_path / "acc.jsonl"))
    pipe, acc = ([json.loads(line) for line in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
                 for n in ("pipe", "acc"))
    assert pipe[-1]["clipped_steps"] == acc[-1]["clipped_steps"] == 6, pipe[-1]   # the clip acted
    assert [r["grad_norm"] for r in pipe[:-1]] == [r["grad_norm"] for r in acc[:-1]]
    assert same_bytes(tmp_path / "pipe.h5", tmp_path / "acc.h5")


def test_epochs_count_the_replicas_batches(job, tmp_path):
    # 4500 training samples at 1 replica x 2 micro-batches x 8 = 16 a step
    r = ok(job(2, *MLP, "--pipeline-stages", "2", "--micro-batches", "2", "--batch-size", "8", "--epochs", "0.1",
               "--log-every", "100", "--metrics", tmp_path / "m.jsonl"))
    assert "1 worker x 16 = 29 steps" in r.stdout, r.stdout
    final = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert final["steps"] == 29 and final["workers"] == 1 and final["global_batch"] == 16, final


INTERLEAVED = ["--pipeline-stages", "2", "--pipeline-schedule", "interleaved"]


BAD_FLAGS = [
    (3, ["--pipeline-stages", "2"], "--pipeline-stages 2 does not divide the 3 ranks"),
    (3, ["--pipeline-stages", "3", "--hidden", "64"], "the model has 2 layers with parameters"),
    (2, ["--pipeline-stages", "2", "--pipeline-split", "9"], "cut points must be layer indices in 1..7"),
    (3, ["--pipeline-stages", "3", "--pipeline-split", "6,2"], "cut points must increase"),
    (2, ["--pipeline-stages", "2", "--pipeline-split", "1"], "stage 0 (layers 0..0) has no layer with parameters"),
    (2, ["--pipeline-stages", "2", "--pipeline-split", "2,4"], "2 stages need 1 cut points, got 2"),
    (3, ["--pipeline-stages", "2", "--mode", "ps"], "--pipeline-stages is for --mode ring"),
    (2, ["--pipeline-stages", "2", "--accumulate-steps", "2"], "use --micro-batches M instead"),
    (2, ["--pipeline-stages", "2", "--overlap", "on"], "with --overlap on: a stage averages its gradient after"),
    (2, ["--micro-batches", "2"], "--micro-batches needs --pipeline-stages P > 1"),
    (2, ["--pipeline-split", "2"], "--pipeline-split needs --pipeline-stages P > 1"),
    (2, ["--pipeline-stages", "2", "--virtual-stages", "2"],
     "--virtual-stages 2 needs --pipeline-schedule interleaved (the 1f1b schedule runs one chunk per stage)"),
    (2, ["--pipeline-stages", "2", "--pipeline-schedule", "gpipe", "--virtual-stages", "1"],
     "--virtual-stages 1 needs --pipeline-schedule interleaved"),
    (1, ["--pipeline-schedule", "interleaved"], "--pipeline-schedule interleaved needs --pipeline-stages P > 1"),
    (2, [*INTERLEAVED, "--micro-batches", "3"], "needs --micro-batches a multiple of --pipeline-stages "
                                                  "(got --micro-batches 3, --pipeline-stages 2)"),
    (2, [*INTERLEAVED, "--micro-batches", "2", "--virtual-stages", "3"],
     "--pipeline-stages 2 --virtual-stages 3: 6 chunks, but the model has 4 layers with parameters"),
    (2, [*INTERLEAVED, "--micro-batches", "2", "--pipeline-split", "4"],
     "2 stages x 2 virtual stages = 4 chunks need 3 cut points, got 1"),
    (2, [*INTERLEAVED, "--micro-batches", "2", "--pipeline-split", "1,4,6"],
     "chunk 0 (stage 0's chunk 0, layers 0..0) has no layer with parameters"),
    (2, [*INTERLEAVED, "--micro-batches", "7502"], "--virtual-stages 2 x --micro-batches 7502: more than 15000"),
    (2, [*INTERLEAVED, "--micro-batches", "2", "--virtual-stages", "0"], "argument --virtual-stages: must be >= 1"),
    (4, [*INTERLEAVED, "--micro-batches", "2", "--compression", "bf16"],
     "--compression bf16 with --pipeline-schedule interleaved --virtual-stages 2: not built"),
]
BAD_IDS = ["p-not-dividing", "more-stages-than-layers", "cut-out-of-range", "cuts-not-increasing",
           "stage-without-parameters", "too-many-cuts", "ps-mode", "accumulate", "overlap",
           "micro-alone", "split-alone", "virtual-without-interleaved", "virtual-1-gpipe", "interleaved-one-stage",
           "interleaved-m-not-multiple", "more-chunks-than-layers", "chunk-cuts-count", "chunk-without-parameters",
           "interleaved-too-many-tags", "virtual-0", "interleaved-compressed"]
# The whole job for one refusal of each kind: argparse's, a cut that needs the
# world size, a cut that needs the model; the rest in-process below.
ON_THE_JOB = ("p-not-dividing", "more-stages-than-layers", "virtual-0")


@pytest.mark.parametrize("ranks, flags, expect", BAD_FLAGS, ids=BAD_IDS)
def test_bad_pipeline_flags_are_refused_by_the_start_up_checks(ranks, flags, expect):
    """The checks run/startup.py runs on every rank, in its order: the
    parser, then cli.validate and stages.cuts_for at the world size."""
    with pytest.raises(HpctrainError) as refused:
        args = cli.parse([*MLP, "--steps", "2", *flags], quiet=True)
        cli.validate(args, ranks)
        cuts_for(args, ranks, spec_for(args, (28, 28), 10))
    assert expect in str(refused.value)


@pytest.mark.parametrize("ranks, flags, expect", [case for case, name in zip(BAD_FLAGS, BAD_IDS) if name in ON_THE_JOB],
                         ids=[name for name in BAD_IDS if name in ON_THE_JOB])
def test_bad_pipeline_flags_are_one_line_exit_2(job, tmp_path, ranks, flags, expect):
    r = job(ranks, *MLP, "--steps", "2", *flags, "--save", tmp_path / "out.h5")
    errors = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(errors) == 1 and expect in errors[0], (r.returncode, r.stderr)
    assert not (tmp_path / "out.h5").exists()


ACTION_NAMES = {sched.Forward: "forward", sched.Backward: "backward", sched.SendActivation: "send activation",
                sched.RecvActivation: "wait activation", sched.SendGrad: "send gradient",
                sched.RecvGrad: "wait gradient"}


@pytest.mark.parametrize("ranks, schedule", [(2, "gpipe"), (4, "1f1b")], ids=["p2-gpipe", "p2r2-1f1b"])
def test_timeline_shows_every_stage_running_its_schedule(job, tmp_path, ranks, schedule):
    """--timeline: every rank's track holds, step by step, exactly its
    schedule's actions in order (named with the micro-batch), the wait for
    its sends inside the schedule phase, then the replicas'
    allreduce, the update and the loss."""
    steps, micro = 3, 3
    ok(job(ranks, *MLP, "--steps", steps, "--batch-size", "8", "--pipeline-stages", "2", "--micro-batches", micro,
           "--pipeline-schedule", schedule, "--timeline", tmp_path / "t.json"))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"stage {r // (ranks // 2)}, replica {r % (ranks // 2)} (rank {r})" for r in range(ranks)}
    spans = sorted((e for e in events if e["ph"] == "X"), key=lambda e: e["ts"])
    for rank in range(ranks):
        plan = sched.SCHEDULES[schedule](2, micro, rank // (ranks // 2))
        want = [f"{ACTION_NAMES[type(a)]} {a.micro}" for a in plan] + ["wait sends"]
        # 2 replicas: --shard-optimizer auto shards the stage's update over them
        after = ["reduce-scatter", "update", "allgather", "loss and stop"] if ranks == 4 else ["update", "loss and stop"]
        for step in range(1, steps + 1):
            mine = [e for e in spans if e["pid"] == rank and e["args"]["step"] == step]
            phase = [e for e in mine if e["name"] == "schedule"]
            inside = [e["name"] for e in mine if e["name"] != "schedule" and e["ts"] < phase[0]["ts"] + phase[0]["dur"]]
            assert len(phase) == 1 and inside == want, (rank, step, inside)
            assert [e["name"] for e in mine][len(want) + 1:] == after


def test_timeline_names_each_action_with_its_chunk(job, tmp_path):
    """--timeline with the interleaved schedule: each rank's track holds its
    schedule's actions in order, each named with its micro-batch and local
    chunk (`forward 1b`: chunk 1), then one update of them all."""
    steps, micro = 2, 4
    ok(job(2, *MLP, "--steps", steps, "--batch-size", "8", *INTERLEAVED, "--micro-batches", micro,
           "--timeline", tmp_path / "t.json"))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    spans = sorted((e for e in events if e["ph"] == "X"), key=lambda e: e["ts"])
    for rank in range(2):
        plan = sched.interleaved(2, micro, rank, 2)
        want = [f"{ACTION_NAMES[type(a)]} {a.micro}{'ab'[a.chunk]}" for a in plan] + ["wait sends"]
        for step in range(1, steps + 1):
            mine = [e for e in spans if e["pid"] == rank and e["args"]["step"] == step]
            phase = [e for e in mine if e["name"] == "schedule"]
            inside = [e["name"] for e in mine if e["name"] != "schedule" and e["ts"] < phase[0]["ts"] + phase[0]["dur"]]
            assert len(phase) == 1 and inside == want, (rank, step, inside)
            assert [e["name"] for e in mine][len(want) + 1:] == ["update", "loss and stop"]


UNSEEDED = '''import hashlib, os
import numpy as np
from hpctrain.nn import Dense, Flatten, Layer, ReLU


class Scale(Layer):
    """y = x * w, w drawn from an unseeded generator: every process its own."""
    keeps_output = False
    n = 0

    def param_shapes(self):
        return [("w", self.in_shape)]

    def init(self, rng, params, dtype):
        params["w"][...] = 1 + 0.1 * np.random.default_rng().standard_normal(params["w"].shape)

    def forward(self, ctx, x, train):
        if train:
            Scale.n += 1   # this process's training forwards (nothing of a call on the layer)
            with open(os.path.join(os.environ["DIGESTS"], f"{os.getpid()}.txt"), "w") as f:
                f.write(f"{Scale.n} {hashlib.sha256(self.params['w'].tobytes()).hexdigest()}")
        ctx.x = x
        return x * self.params["w"]

    def backward(self, ctx, dy, need_dx):
        self.grads["w"][...] = (dy * ctx.x).sum(axis=0)
        return dy * self.params["w"]


def build(shape, classes):
    return [Flatten(), Scale(), Dense(32), ReLU(), Dense(classes)]
'''


def test_a_stages_replicas_start_from_one_set_of_parameters(job, tmp_path):
    # Issue 27, 5: each rank built its stage's initial slice itself, so an
    # init that ignores its generator gave each replica its own weights,
    # trained apart all run long without --shard-optimizer. Now replica 0's
    # go to the stage's other replicas, as rank 0's to all in ring mode.
    (tmp_path / "m.py").write_text(UNSEEDED)
    digests = tmp_path / "digests"
    digests.mkdir()
    r = job(4, "--pipeline-stages", "2", "--model", f"{tmp_path / 'm.py'}:build", "--steps", "6", "--log-every",
            "6", "--shard-optimizer", "off", "--pipeline-split", "3", env={"DIGESTS": str(digests)}, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = [f.read_text().split() for f in digests.iterdir()]
    trained = [digest for count, digest in seen if int(count) > 4]   # stage 0's replicas (the spec check: 4 forwards)
    assert len(trained) == 2 and trained[0] == trained[1], seen


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "ring"])
def test_timeline_records_its_first_steps_only(job, tmp_path, pipeline):
    # Issue 27, 14: the pipeline's trace grew 3 KB a step with no bound (92 MB
    # at 30,000 steps): --timeline-steps N (default 100) records the first N
    # steps; the pipeline's ranks stop gathering their spans together.
    flags = ["--pipeline-stages", "2", "--micro-batches", "2"] if pipeline else []
    ok(job(2, *MLP, "--steps", 9, "--batch-size", "8", *flags, "--timeline", tmp_path / "t.json",
           "--timeline-steps", 4))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    steps = {e["args"]["step"] for e in events if e["ph"] == "X" and "step" in e.get("args", {})}
    assert steps == {1, 2, 3, 4}, steps
