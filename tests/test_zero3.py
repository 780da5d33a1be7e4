"""--zero 3 (ZeRO stage 3 in ring mode): each rank keeps its 1/N shard of
the parameters, of the summed gradient and of the optimizer state, each
bucket's parameters gathered into a slot just before its layers run
forward and again before backward, and gets stage 1's parameters bit for
bit: with several buckets so slots are reused, --clip-norm,
--accumulate-steps, a tied tensor (the GPT's head and embedding), batch
norm, compression, sizes that do not divide by the ranks. Jobs: --zero 3
against --zero 1 (the GPT), the memory budget (the refusals are in
tests/test_train.py; every stage's --save file against stage 0's, and
resumes across stages and N, in tests/test_zero.py).

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_zero3.py   # at 2, 3, 4 ranks in CI
    python -m pytest tests/test_zero3.py                                     # jobs
"""
import numpy as np
import pytest
from mpi4py import MPI

from test_zero import refused, run_steps, trained, shards, text_dir   # noqa: F401 (fixtures)
from conftest import same_bytes
from test_hier import hier_on_fake_nodes
from hpctrain.nn import threads
from hpctrain.nn.sharded_store import ShardedStore, tail_homes


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("fusion_elems, overlap", [(0, True), (200, False), (200, True)])
@pytest.mark.parametrize("clip, accumulate", [(None, 1), (0.5, 3)])
def test_stage_3_gives_stage_1s_parameters_bit_for_bit(name, fusion_elems, overlap, clip, accumulate):
    """With overlap the gathers run on the communication thread, each
    posted one bucket ahead, with two shared slots; without, each right
    before its layers, with one."""
    comm = MPI.COMM_WORLD
    one, one_losses, ring1 = run_steps(comm, name, 1, fusion_elems, overlap, clip, accumulate)
    three, losses, ring = run_steps(comm, name, 3, fusion_elems, overlap, clip, accumulate)
    assert losses == one_losses and np.array_equal(one, three)
    # this rank's shards of the last step's summed gradient and of Adam's state: stage 1's owned parts
    owned = ring.update.parts[0].owned
    assert owned == ring1.update.parts[0].owned and ring.optimizer.ranges == ring1.optimizer.ranges
    # with --clip-norm the summed gradient's parts are kept (the norm reads them all): stage 1's;
    # without, each bucket is updated from its slot and no 1/N copy is kept
    assert (ring.update.parts[0].shard is None) == (clip is None)
    for a, b in owned if clip else ():
        assert np.array_equal(ring.update.parts[0].shard[a:b], ring1.model.grads[a:b])
    for key, state in ring.optimizer.state().items():
        assert np.array_equal(state, ring1.optimizer.state()[key])
    store, n = ring.store, ring.model.num_params
    assert isinstance(store, ShardedStore)
    assert ring.param_shard.buf.size <= n / comm.size + len(store.params.buckets)
    if fusion_elems:   # several buckets: no whole model anywhere
        buckets = len(store.params.buckets)
        assert buckets > 3
        shared = 2 if overlap and comm.size > 1 else 1
        # the MLP's buckets (Dense layers) write their gradient over their parameters: no slots of
        # their own; the GPT's blocks do not declare it (grads_may_overwrite_params), and the embedding has its own
        assert len(store.grads.slots) == (shared + 1 if name == "gpt" else 0)
        # the parameters' too, and the small buckets forward gathers last theirs (the GPT's final
        # LayerNorm, 24 elements; the MLP's head is over 1/8 of its largest bucket)
        tail = {store.params.bucket_at(lo) for lo, _ in tail_homes(store.params.buckets)} - \
            {store.params.bucket_at(t.lo) for t in ring.model.spec.ties}
        assert len(tail) == (name == "gpt") and len(store.params.slots) == shared + (name == "gpt") + len(tail)
        assert store.params.nbytes < n * 4 * 0.75 and store.grads.nbytes < n * 4 * 0.75
        assert (store.posted > 0) == (shared == 2) and not store.pending
        # a step's first forward gathers every bucket (the update made them old); then each pass
        # (backward, a micro-batch's next forward) all but those still in the slots from the pass
        # before: the shared slots' last, the GPT's embedding in its own (a prefetch gathers only
        # what the pass reads next); run_steps gathers every bucket once more at the end. The MLP's
        # slots hold its gradients after backward, so each micro-batch's forward gathers every
        # bucket; its first Dense reads no parameters in its backward (no dx): its bucket is not
        # gathered for it
        kept = len(store.params.slots)
        per_step = accumulate * (2 * buckets - kept - 1) if name == "mlp" else \
            buckets + (buckets - kept) * (1 + 2 * (accumulate - 1))
        assert store.gathers == 4 * per_step + buckets

@pytest.mark.parametrize("compute_threads", [1, 2])
def test_a_dense_layers_gradient_is_written_over_its_gathered_weights(compute_threads):
    """One rank, in-process: each Dense bucket's gradient lives in its
    gathered parameters' slot (no gradient slot: one slot a bucket, not two),
    its backward computing dx before it writes dW over W (on two compute
    threads too, where stage 1 runs the two products at once: nn/threads.pair),
    and the steps give stage 1's parameters bit for bit (dW written first,
    dx would read it)."""
    comm = MPI.COMM_SELF
    if threads.configure(compute_threads) != compute_threads:
        pytest.skip("no per-thread BLAS thread count here (nn/threads.py)")
    try:
        one, one_losses, _ = run_steps(comm, "mlp", 1, 200, False, steps=2)
        three, losses, ring = run_steps(comm, "mlp", 3, 200, False, steps=2)
    finally:
        threads.configure(1)
    assert losses == one_losses and np.array_equal(one, three)
    store, dense = ring.store, [layer for layer in ring.model.run.layers if layer.param_shapes()]
    assert store.grads.slots == [] and len(store.params.slots) == 1 and len(store.params.buckets) > 3
    assert all(np.shares_memory(layer.grads["W"], layer.params["W"]) for layer in dense)
    assert all(np.shares_memory(layer.grads["W"], store.params.slots[0]) for layer in dense)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["small_cnn", "resnet"])
def test_stage_3_gives_stage_1s_parameters_for_the_cnns(name):
    """Convolutions, and batch norm's statistics beside the shards (resnet)."""
    comm = MPI.COMM_WORLD
    one, one_losses, ring1 = run_steps(comm, name, 1, 300, True, 0.5, accumulate=2)
    three, losses, ring = run_steps(comm, name, 3, 300, True, 0.5, accumulate=2)
    assert losses == one_losses and np.array_equal(one, three)
    assert np.array_equal(ring1.model.state, ring.model.state)
    assert len(ring.store.params.buckets) > 3


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("compression", [None, "bf16", "fp16"])
def test_stage_3_on_nodes_and_compressed_gives_stage_1s_parameters(name, compression):
    """hier on fake nodes of two ranks (its shards a sub-slice of the
    node's part), compressed or not."""
    comm = MPI.COMM_WORLD
    one, one_losses, _ = run_steps(comm, name, 1, 200, True, 0.5, make=hier_on_fake_nodes,
                                   compression=compression)
    three, losses, _ = run_steps(comm, name, 3, 200, True, 0.5, make=hier_on_fake_nodes, compression=compression)
    assert losses == one_losses and np.array_equal(one, three)


# --- jobs ------------------------------------------------------------------------

def test_zero_3_trains_the_gpt_of_zero_1_with_accumulation(job, tmp_path, text_dir):
    """The tied head and embedding, dropout on, 2 micro-batches a step,
    clipped, evaluated on the held-out tail as it trains, its best kept
    (--keep-best)."""
    flags = ["--data", text_dir, "--model", "gpt:layers=3,heads=2,width=16,dropout=0.1", "--block-size", 16,
             "--batch-size", 4, "--steps", 4, "--accumulate-steps", 2, "--clip-norm", 0.5, "--fusion-mb", 0.005,
             "--lr", 1e-3, "--eval-every", 2, "--eval-tokens", 512]
    finals = [trained(job, 2, [*flags, "--zero", z, "--keep-best", tmp_path / f"best{z}.h5"], tmp_path, f"z{z}")
              for z in (1, 3)]
    assert [f["zero"] for f in finals] == [1, 3] and [f["test_tokens"] for f in finals] == [512, 512], finals
    assert same_bytes(tmp_path / "z1.h5", tmp_path / "z3.h5")
    assert same_bytes(tmp_path / "best1.h5", tmp_path / "best3.h5")   # --keep-best: written a bucket at a time
    assert finals[0]["test_loss"] == finals[1]["test_loss"]
    # the stage that ran (the loop's sharded parameters, not the flag): a stage 3 run as 1 fails here
    assert [f["zero"] for f in finals] == [1, 3]


def test_a_model_refused_at_zero_2_on_4_ranks_trains_at_zero_3_there(job, tmp_path):
    """32 layers of 1024 (33.6 M parameters, Adam): --memory-budget 0.25
    refuses it on one rank (0.57 GiB) naming --zero 3 on 4 ranks (about
    0.18 GiB: each bucket one layer, so a rank holds its shards and two
    layers' worth of slots; no copy of the summed gradient without
    --clip-norm), and --zero 2 on 4 ranks (0.27 GiB) naming --zero 3; at
    stage 3 it trains there, every rank's measured peak under the budget
    (256 MB; 243 MB with the gradient's 1/N copy, at 0.28, before)."""
    big = ["--hidden", ",".join(["1024"] * 32), "--fusion-mb", "4", "--steps", "4", "--log-every", "4",
           "--batch-size", "16", "--memory-budget", "0.25"]
    refused(job, 1, big, "; --zero 3 on 4 ranks would fit (")
    refused(job, 4, [*big, "--zero", "2"], "; --zero 3 would fit (")
    final = trained(job, 4, [*big, "--zero", 3], tmp_path, "z3")
    assert final["peak_rss_mb"] < 0.25 * 1024, final["peak_rss_mb"]   # the largest of any rank
