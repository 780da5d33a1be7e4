"""Tensor parallelism (--tensor-parallel T, nn/tensor_parallel.py,
loops/ring_tensor.py) against one process: every split layer's loss,
evaluation sums and gradient slices against the whole model's in float64
(odd sizes: a vocabulary that does not divide by T, widths of 17 T), the
collectives a block costs, the replicated tensors identical over a group
after training; then whole runs: T = 2 and 4 (and T = 2 x R = 2) against
one process at the same global batch, the GPT and the MLP, clipped, with
ZeRO stages 1 and 2 over the replicas; checkpoints that resume at another
T; and the refusals.

    mpirun -n 4 python -m mpi4py -m pytest -q --only-mpi tests/test_tensor_parallel.py
    python -m pytest -q tests/test_tensor_parallel.py
"""
import json
import re
import shutil
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

from collectives import put_local, take_local
from conftest import checkpoint_path, copy_checkpoint, flat_from_named, saved
from test_zero import text_dir   # noqa: F401 (the fixture)
from hpctrain.comm.tensor_group import TensorComm
from hpctrain.nn import Flatten, Linear, ModelSpec, ReLU
from hpctrain.nn.gpt import gpt
from hpctrain.nn.tensor_parallel import TensorGroup
from hpctrain.nn.zoo import mlp


def _group(sequence=False):
    comm = MPI.COMM_WORLD
    return TensorGroup(comm.Get_size(), comm.Get_rank(), sequence=sequence, comm=TensorComm(comm))


def _models(T, dropout=0.0):
    """(name, the whole spec, a batch (x, y)) at odd sizes for T tensor ranks."""
    rng = np.random.default_rng(7)
    vocab = 13 * T + 1   # not a multiple of T: the vocabulary's parts differ by one row
    return [("gpt", gpt(vocab, 3 * T, 2, 2 * T, 4 * T, dropout), rng.integers(0, vocab, (3, 3 * T)),
             rng.integers(0, vocab, (3, 3 * T))),
            ("mlp", mlp((13,), 5, (17 * T, 17 * T, 17 * T)), rng.standard_normal((3, 13)), rng.integers(0, 5, 3))]


@pytest.mark.mpi
@pytest.mark.parametrize("which, sequence, dropout", [(0, False, 0.0), (0, False, 0.1), (0, True, 0.1), (1, False, 0.0)],
                         ids=["gpt", "gpt-dropout", "gpt-sequence-parallel", "mlp"])
def test_every_split_layer_matches_the_whole_model(which, sequence, dropout):
    """Each rank's slice, from the same seed, is the whole model's cut; its
    loss, evaluation sums and gradient slice are the whole model's in float64
    (with dropout: each slice draws the whole layer's mask's part; with
    --sequence-parallel: 3 positions a rank)."""
    group = _group(sequence)
    name, full, x, y = _models(group.size, dropout)[which]
    local = full.split_tensor(group)
    whole, mine = full.build(dtype=np.float64), local.build(dtype=np.float64)
    whole.init(3)
    mine.init(3)
    assert np.array_equal(take_local(full, local.cuts, whole.params, group.rank), mine.params)
    x = x.astype(np.float64)
    noise = (5, 2, np.arange(len(x))) if dropout else None
    loss, loss_t = whole.forward_backward(x, y, noise=noise), mine.forward_backward(x, y, noise=noise)
    assert abs(float(loss) - float(loss_t)) <= 1e-12 * abs(float(loss))
    expected = take_local(full, local.cuts, whole.grads, group.rank)
    assert np.allclose(mine.grads, expected, rtol=1e-10, atol=1e-13), np.abs(mine.grads - expected).max()
    sums, sums_t = whole.evaluate(x, y), mine.evaluate(x, y)
    assert sums["count"] == sums_t["count"] and sums["correct"] == sums_t["correct"]
    assert abs(sums["loss"] - sums_t["loss"]) <= 1e-12 * abs(sums["loss"])
    # the slices put back together are the whole gradient (the file's layout)
    parts = MPI.COMM_WORLD.allgather(mine.grads)
    rebuilt = np.zeros(full.num_params)
    for r, part in enumerate(parts):
        put_local(full, local.cuts, part, r, rebuilt)
    assert np.allclose(rebuilt, whole.grads, rtol=1e-10, atol=1e-13)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sequence", [False, True])
def test_a_block_costs_two_allreduces_forward_and_two_backward(sequence):
    """Megatron's count: per block one after attention's projection and one
    after the MLP's forward, one for each's input gradient backward; the
    vocabulary one forward (the embedding), one backward (the head's input
    gradient) and two in the loss (the max, then both sums). With
    --sequence-parallel each allreduce is a reduce-scatter and an allgather,
    and the gradients of what every rank holds from its own positions (2
    norms, 2 row biases a block; the position table, the last norm) one
    small allreduce each."""
    group = _group(sequence)
    name, full, x, y = _models(group.size)[0]
    model = full.split_tensor(group).build()
    model.init(1)
    model.forward_backward(x, y)
    layers = 2
    if sequence:
        assert group.comm.calls == (8 + 4) * layers + 2 + 2 + 2 + 2
    else:
        assert group.comm.calls == 4 * layers + 1 + 1 + 2


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sequence", [False, True])
def test_the_replicated_tensors_stay_identical_over_the_group(sequence):
    """LayerNorm's gains, the row-parallel biases, the position table: every
    rank of a group computes their gradients from the same (allreduced)
    activations, so ten SGD steps leave them the same bits everywhere
    (--sequence-parallel: each rank's positions' part, summed over the group)."""
    group = _group(sequence)
    name, full, x, y = _models(group.size)[0]
    local = full.split_tensor(group)
    model = local.build()
    model.init(1)
    for _ in range(10):
        model.forward_backward(x, y)
        model.params -= 0.1 * model.grads
    replicated = np.concatenate([model.params[lo:hi] for name, _, lo, hi in local.tensors if name not in local.cuts])
    everyone = MPI.COMM_WORLD.allgather(replicated.tobytes())
    assert all(b == everyone[0] for b in everyone)


@pytest.mark.mpi(min_size=2)
def test_a_warm_sequence_parallel_collective_allocates_nothing():
    """--sequence-parallel's reduce-scatter and allgather keep their host
    buffers per shape: the second call of each allocates no array (both
    made theirs on every call before), and they still sum and gather."""
    comm = MPI.COMM_WORLD
    T, r = comm.Get_size(), comm.Get_rank()
    tensor = TensorComm(comm)
    base = np.arange(4 * 16 * T * 32, dtype=np.float64).reshape(4, 16 * T, 32)
    full, mine, whole = base * (r + 1), np.empty((4, 16, 32)), np.empty_like(base)
    peaks = []
    for _ in range(2):
        tracemalloc.start()
        tensor.reduce_scatter(full, mine)
        tensor.allgather(mine, whole)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert np.array_equal(mine, base[:, 16 * r:16 * (r + 1)] * (T * (T + 1) // 2))
    assert np.array_equal(whole, base * (T * (T + 1) // 2))
    assert peaks[0] >= mine.nbytes > peaks[1], peaks   # a Python object or two, no array


@pytest.mark.mpi(min_size=2)
def test_a_subclass_of_relu_between_two_linears_still_pairs_them():
    """Layer kinds are declarations a subclass inherits (issue 55, 3): a
    user's MyReLU(ReLU) between two Linears built without roles keeps them a
    column/row pair (and the last Linear whole), and the split model gives
    the unsplit one's loss and gradient in float64."""
    class MyReLU(ReLU):
        pass

    group = _group()
    T = group.size
    full = ModelSpec([Flatten(), Linear(6 * T), MyReLU(), Linear(5 * T), Linear(3)], (2, 2), 3)
    local = full.split_tensor(group)
    assert local.split_layers == [1, 3] and [layer.role for layer in local.layers] == [None, "column", None, "row",
                                                                                          None]
    assert [layer.role for layer in full.layers] == [None] * 5   # the whole model's layers are left as built
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((4, 2, 2)), rng.integers(0, 3, 4)
    whole, mine = full.build(dtype=np.float64), local.build(dtype=np.float64)
    whole.init(2)
    mine.init(2)
    loss, loss_t = whole.forward_backward(x, y), mine.forward_backward(x, y)
    assert abs(float(loss) - float(loss_t)) <= 1e-12 * abs(float(loss))
    expected = take_local(full, local.cuts, whole.grads, group.rank)
    assert np.allclose(mine.grads, expected, rtol=1e-10, atol=1e-13), np.abs(mine.grads - expected).max()


@pytest.mark.parametrize("layers, line", [
    (lambda: [Linear(4, role="column"), Linear(2)], "layer 0 (Linear(4)) is column-parallel without a row-parallel"),
    (lambda: [Linear(4, role="column"), ReLU(), Flatten(), Linear(2, role="row")],
     "layer 0 (Linear(4)) is column-parallel without a row-parallel"),
    (lambda: [Linear(4), Linear(2, role="row")], "layer 1 (Linear(2)) is row-parallel without a column-parallel"),
], ids=["column-then-whole", "column-then-flatten", "row-first"])
def test_a_declared_role_without_its_partner_is_one_line(layers, line):
    """A column layer's slice reaches only elementwise layers and then its
    row layer: any other pairing is refused when the spec is split."""
    from hpctrain.nn import LayerError
    with pytest.raises(LayerError, match=re.escape(line)):
        ModelSpec(layers(), (4,), 2).split_tensor(TensorGroup(2, 0))


# --- runs ------------------------------------------------------------------------

def losses(path):
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "step" in r and "loss" in r]


def run(job, ranks, flags, out, name):
    r = job(ranks, *flags, "--save", out / f"{name}.h5", "--metrics", out / f"{name}.jsonl", timeout=180)
    assert r.returncode == 0, r.stderr
    return r, losses(out / f"{name}.jsonl"), saved(out / f"{name}.h5")


def one_process(job, once, flags):
    """(losses, parameters, final record) of flags on one rank: the reference
    that every layout of a test compares with, launched once a session."""
    def make(out):
        _, losses_, params = run(job, 1, flags, out, "one")
        return losses_, params, json.loads((out / "one.jsonl").read_text().splitlines()[-1])
    return once(("test_tensor_parallel one process", *map(str, flags)), make)


def close(a, b, tol):
    assert a.keys() == b.keys()
    for k in a:
        assert np.allclose(a[k], b[k], rtol=tol, atol=tol), (k, np.abs(a[k] - b[k]).max())


def gpt_flags(data):
    return ["--data", data, "--model", "gpt:layers=2,heads=4,width=32", "--block-size", 16, "--steps", 30,
            "--clip-norm", 0.5, "--lr", 3e-3, "--eval-every", 0, "--log-every", 1, "--fusion-mb", 0.01]


@pytest.mark.parametrize("ranks, tensor, zero", [(2, 2, 0), (4, 4, 0), (4, 2, 1), (4, 2, 2), (4, 2, 3)])
def test_tensor_parallel_trains_the_gpt_of_one_process(job, once, tmp_path, text_dir, ranks, tensor, zero):
    """The same global batch (8 windows a step): the loss at every step and
    the parameters after 30 clipped Adam steps within float32 rounding; the
    start-up line says how the vocabulary is cut."""
    replicas = ranks // tensor
    flags = [*gpt_flags(text_dir), "--eval-tokens", 512]   # 32 of the 124 held-out windows, cut over the replicas
    want, whole, one_final = one_process(job, once, [*flags, "--batch-size", 8])
    r, got, split = run(job, ranks, [*flags, "--batch-size", 8 // replicas, "--tensor-parallel", tensor,
                                     "--zero", zero], tmp_path, "split")
    assert f"each layer split over {tensor} consecutive ranks" in r.stdout
    assert "the vocabulary's" in r.stdout and "(not padded)" in r.stdout
    assert len(got) == len(want) == 30
    assert np.allclose(got, want, rtol=2e-5), np.abs(np.subtract(got, want)).max()
    close(split, whole, 2e-4)
    # the final evaluation scored the same sample of the held-out windows (issue 54 N2)
    finals = [one_final, json.loads((tmp_path / "split.jsonl").read_text().splitlines()[-1])]
    assert [f["test_tokens"] for f in finals] == [512, 512], finals
    assert finals[1]["test_loss"] == pytest.approx(finals[0]["test_loss"], rel=2e-4), finals


@pytest.mark.parametrize("ranks, layout", [(4, ["--tensor-parallel", 2]), (4, ["--tensor-parallel", 4]),
                                           (8, ["--tensor-parallel", 2, "--pipeline-stages", 2, "--micro-batches", 2])])
def test_sequence_parallel_with_dropout_trains_the_gpt_of_one_process(job, once, tmp_path, text_dir, ranks, layout):
    """--sequence-parallel, dropout 0.1 (each slice draws its part of the
    whole layer's mask), 16 positions cut over 2 or 4 tensor ranks: the
    losses and parameters of one process at the same global batch."""
    flags = ["--data", text_dir, "--model", "gpt:layers=2,heads=4,width=32,dropout=0.1", "--block-size", 16,
             "--steps", 20, "--clip-norm", 0.5, "--lr", 3e-3, "--eval-every", 0, "--log-every", 1]
    want, whole, _ = one_process(job, once, [*flags, "--batch-size", 8])
    replicas = ranks // (layout[1] * (2 if "--pipeline-stages" in layout else 1))
    micro = 2 if "--micro-batches" in layout else 1
    r, got, split = run(job, ranks, [*flags, "--batch-size", 8 // replicas // micro, *layout, "--sequence-parallel"],
                        tmp_path, "split")
    assert "on 1/T of the positions each (--sequence-parallel)" in r.stdout
    assert np.allclose(got, want, rtol=2e-5), np.abs(np.subtract(got, want)).max()
    close(split, whole, 2e-4)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_compressed_replicas_of_a_split_model_train_as_without_the_split(job, tmp_path, text_dir, kind):
    """--compression over the data axis: each tensor rank's replica ring
    sends its slice in 16 bits; T = 2 x R = 2 against R = 2 alone, the same
    global batch, within the 16-bit rounding of the gradients."""
    flags = [*gpt_flags(text_dir), "--batch-size", 4, "--compression", kind]
    _, want, whole = run(job, 2, flags, tmp_path, "alone")
    _, got, split = run(job, 4, [*flags, "--tensor-parallel", 2], tmp_path, "split")
    assert np.allclose(got, want, rtol=2e-3), np.abs(np.subtract(got, want)).max()
    close(split, whole, 2e-2)


def test_tensor_parallel_trains_the_mlp_of_one_process(job, tmp_path):
    """Dense pairs (column, then row), the last Dense whole on every rank."""
    flags = ["--hidden", "64,64,64", "--steps", 30, "--log-every", 1, "--optimizer", "momentum", "--lr", 0.05]
    _, want, whole = run(job, 1, [*flags, "--batch-size", 32], tmp_path, "one")
    _, got, split = run(job, 2, [*flags, "--batch-size", 32, "--tensor-parallel", 2], tmp_path, "split")
    assert np.allclose(got, want, rtol=2e-5)
    close(split, whole, 2e-4)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_checkpoint_resumes_at_another_tensor_parallel(job, tmp_path, text_dir, zero):
    """The file holds the whole tensors: written at T = 2 x R = 2 with
    --zero 2 or 3, resumed on 2 ranks without tensor parallelism (--zero 1),
    within float32 rounding of the run that never stopped; and from there
    at T = 4 (one replica: the global batch halves, as a resume on fewer
    ranks does). Each rank writes the boxes its slice's shard holds and
    reads its own; with --zero 2 the first resume is from the old flat file
    of the same values (conftest.flat_from_named), through the chief."""
    flags = [*gpt_flags(text_dir), "--batch-size", 4, "--checkpoint-dir", tmp_path / "ckpt"]
    r = job(4, *flags, "--steps", 10, "--tensor-parallel", 2, "--zero", zero, timeout=180)
    assert r.returncode == 0, r.stderr
    if zero == 2:
        flat_from_named(tmp_path / "ckpt" / "ckpt-00000010")
    r, _, resumed = run(job, 2, [*flags, "--steps", 20, "--zero", 1], tmp_path, "resumed")
    assert "resumed from" in r.stdout
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt-one")   # step 20, for the one-process reference
    r, again_losses, again = run(job, 4, [*flags, "--steps", 30, "--tensor-parallel", 4], tmp_path, "again")
    assert "resumed from" in r.stdout
    _, _, straight = run(job, 2, [*flags[:-2], "--steps", 20], tmp_path, "straight")
    close(resumed, straight, 2e-4)
    # T = 4 with one replica is one process (the same 4 windows a step): its values, not only its names
    r, one_losses, one = run(job, 1, [*flags[:-2], "--checkpoint-dir", tmp_path / "ckpt-one", "--steps", 30],
                             tmp_path, "one")
    assert "resumed from" in r.stdout
    assert len(again_losses) == 10 and np.allclose(again_losses, one_losses, rtol=2e-5), (again_losses, one_losses)
    close(again, one, 2e-4)


def test_the_three_axes_together_train_the_gpt_of_accumulation(job, tmp_path, text_dir):
    """8 ranks as 2 stages x 2 tensor ranks x 2 replicas (--zero 1 over the
    replicas) against 2 ranks with --accumulate-steps 4: the same losses
    and parameters within float32 rounding; its checkpoint resumed by a
    tensor-parallel ring without a pipeline (T = 2 x R = 2) and by the same
    3-D layout end where the plain run ends."""
    flags = ["--data", text_dir, "--model", "gpt:layers=2,heads=4,width=32", "--block-size", 16, "--clip-norm", 0.5,
             "--lr", 3e-3, "--eval-every", 0, "--log-every", 1, "--batch-size", 2]
    pipe = ["--micro-batches", 4, "--pipeline-stages", 2, "--tensor-parallel", 2]
    _, want, whole = run(job, 2, [*flags, "--steps", 20, "--accumulate-steps", 4], tmp_path, "plain")
    r, got, split = run(job, 8, [*flags, "--steps", 10, *pipe, "--zero", 1, "--checkpoint-dir", tmp_path / "a"],
                        tmp_path, "three")
    assert "pipeline of 2 stages x 2 replicas" in r.stdout and "split over 2 consecutive ranks" in r.stdout
    assert np.allclose(got, want[:10], rtol=2e-5), (got, want)
    (tmp_path / "b").mkdir()
    copy_checkpoint(checkpoint_path(tmp_path / "a", 10), tmp_path / "b")
    for ranks, layout, ckpt in ((4, ["--accumulate-steps", 4, "--tensor-parallel", 2], "a"), (8, pipe, "b")):
        r, _, resumed = run(job, ranks, [*flags, "--steps", 20, *layout, "--checkpoint-dir", tmp_path / ckpt],
                            tmp_path, f"resumed-{ckpt}")
        assert "resumed from" in r.stdout, r.stdout
        close(resumed, whole, 2e-4)


@pytest.mark.parametrize("ranks, flags, line", [
    (2, ["--model", "gpt:layers=1,heads=3,width=12"], "--tensor-parallel 2: --model gpt:layers=1,heads=3,width=12: "
                                                       "layer 3 (Block(12, heads=3)): CausalSelfAttention(3): 3 heads "
                                                       "are not a multiple of --tensor-parallel 2"),
    (2, ["--model", "cnn"], "--tensor-parallel 2: --model cnn: it has no layer that splits"),
    (2, ["--hidden", "63,64"], "Dense(63): the units 63 is not a multiple of --tensor-parallel 2"),
    (3, [], "--tensor-parallel 2 does not divide the 3 ranks"),
    (3, ["--mode", "ps"], "--tensor-parallel 2 is for --mode ring"),
    (6, ["--pipeline-stages", "2"], "--tensor-parallel 2 x --pipeline-stages 2 does not divide the 6 ranks"),
    (2, ["--model", "resnet"], "--tensor-parallel 2: --model resnet has non-trainable state"),
    (2, ["--sequence-parallel"], "--tensor-parallel 2: --model mlp: --sequence-parallel cuts a language model's "
                                 "positions"),
    (2, ["--model", "gpt:layers=1,heads=2,width=8", "--block-size", "15", "--sequence-parallel"],
     "layer 0 (Embedding(62, 8)): 15 positions are not a multiple of --tensor-parallel 2"),
    (2, ["--compression", "powersgd"], "--compression powersgd with --tensor-parallel 2: not yet"),
])
def test_what_does_not_split_is_one_line(job, text_dir, ranks, flags, line):
    data = ["--data", text_dir] + ([] if "--block-size" in flags else ["--block-size", 16]) \
        if any(f.startswith("gpt:") for f in flags) else []
    r = job(ranks, *data, *flags, "--steps", 2, "--tensor-parallel", 2, timeout=120)
    lines = [s for s in r.stderr.splitlines() if s.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert line in lines[0], lines


def test_a_vocabulary_smaller_than_the_group_is_one_line():
    # Issue 54, 8: a rank without a token's row reached the head's configure
    # ("configure returned (16, 0) ...", an internal contract check).
    from hpctrain.nn import LayerError
    with pytest.raises(LayerError, match=r"^layer 0 \(Embedding\(3, 8\)\): a vocabulary of 3 tokens cannot be cut "
                                         r"over 4 ranks"):
        gpt(3, 16, 1, 4, 8).split_tensor(TensorGroup(4, 3))


def test_sequence_parallel_needs_tensor_parallel(job):
    r = job(2, "--steps", 2, "--sequence-parallel", timeout=120)
    lines = [s for s in r.stderr.splitlines() if s.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--sequence-parallel cuts the positions over a tensor group: it needs --tensor-parallel T > 1" in lines[0]


def test_a_tensor_group_across_nodes_is_named_in_the_warning():
    """Allowed with one warning line: the groups of consecutive ranks whose
    hosts differ (a launcher that placed ranks round-robin)."""
    from hpctrain.run.startup import across_nodes_line, groups_across_nodes
    assert groups_across_nodes(2, ["a", "a", "b", "b"]) == []
    apart = groups_across_nodes(2, ["a", "b", "a", "b"])
    assert apart == [([0, 1], ["a", "b"]), ([2, 3], ["a", "b"])]
    line = across_nodes_line(2, apart, 4)
    assert line.startswith("--tensor-parallel 2: 2 of 2 tensor groups span nodes (ranks 0-1 on a, b, ...)")
