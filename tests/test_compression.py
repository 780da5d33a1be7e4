"""Gradient compression (--compression, issue 31): the 16-bit codecs against
NumPy's casts, PowerSGD's pieces, and the exchanges on every rank: fp16/bf16
buckets give every rank the same bits close to the float32 sum, fp16
divides before the sum so a sum past 65504 does not overflow, PowerSGD is
exact for a gradient of rank <= R, and error feedback loses nothing (what
each rank sent + its new error = its gradient + its old error, and the
ranks' sends sum to what everyone applies).

    python -m pytest -q tests/test_compression.py
    mpirun -n 3 python -m mpi4py -m pytest -q --only-mpi tests/test_compression.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from collectives import ring_step
from gpu_fakes import LazyCopier
from test_hier import fake_gpu  # noqa: F401 (a fixture)
from hpctrain.comm.compressed_exchange import HalfExchange, HalfRing
from hpctrain.comm.powersgd import PowerSgd
from hpctrain.comm.hier import HierAllreduce
from hpctrain.comm.ring_allreduce import SEGMENT_BYTES, RingAllreduce
from hpctrain.comm.staged import StagedAllreduce
from hpctrain.comm.topology import Topology
from hpctrain.base.device import array_module
from hpctrain.optim.compression_math import Half, compressed_rank, initial_q, matrix_shape, orthogonalise, powersgd_layout


# The codec's two directions, one format each, over whole arrays: what these tests check word by word.
def to_bf16(x, out):
    """out (uint16) = the bfloat16 words of x (float32), rounded to nearest
    even: add 0x7FFF plus the lowest kept bit, keep the top 16 bits. A NaN
    (whose rounding could carry into inf or past the sign) is BF16_NAN."""
    return Half("bf16").encode(x, out)


def from_bf16(words, out):
    """out (float32) = the bfloat16 words as float32 (exact: their low 16 bits zero)."""
    return Half("bf16").decode(words, out)


def to_fp16(x, out):
    """out (uint16) = the binary16 words of x: NumPy's cast, word for word
    (nearest even, subnormals, inf past 65504, NaN a NaN)."""
    return Half("fp16").encode(x, out)


def from_fp16(words, out):
    return Half("fp16").decode(words, out)


def roundtrip(kind, x):
    """x (float32) through the 16-bit format and back, as a new array."""
    xp = array_module(x)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    return Half(kind).round_(x.copy(), xp.empty(x.shape, xp.uint16))


# Every float32 class: zeros, subnormals, normals around 1, fp16's edge
# (65504 and the halfway point 65520 above it), float32's extremes, inf, NaN.
SPECIAL = np.array([0.0, -0.0, 1e-45, -1e-40, 1.17549435e-38, 5.96e-8, 6.1e-5, 0.1, 1.0, -1.0, 1.00390625,
                    1.005859375, 3.14159265, 65504.0, 65519.0, 65520.0, 1e5, 3.3895314e38, 3.4028235e38,
                    np.inf, -np.inf, np.nan], np.float32)


def samples(n=200_000, seed=0):
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)   # every exponent
    normal = rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)   # gradient-like
    return np.concatenate([SPECIAL, bits.view(np.float32), normal])


# --- the codecs -------------------------------------------------------------------

def test_fp16_words_are_numpys_cast_both_ways():
    x = samples()
    words = np.empty(x.size, np.uint16)
    to_fp16(x, words)
    want = x.astype(np.float16)
    number = ~np.isnan(want)
    assert np.array_equal(words[number], want.view(np.uint16)[number])
    assert np.isnan(words[~number].view(np.float16)).all()
    back = roundtrip("fp16", x)
    assert np.array_equal(back, want.astype(np.float32), equal_nan=True)
    assert back.dtype == np.float32
    every = np.arange(2 ** 16, dtype=np.uint16)   # and every word back: NumPy's values, bit for bit
    values = from_fp16(every, np.empty(every.size, np.float32))
    numpys = every.view(np.float16).astype(np.float32)
    number = ~np.isnan(numpys)
    assert np.array_equal(values.view(np.uint32)[number], numpys.view(np.uint32)[number])
    assert np.isnan(values[~number]).all()


def nearest_bf16(x):
    """The reference: the float32 values whose low 16 bits are zero nearest
    to x, by float64 arithmetic, ties to the even word; NaN stays NaN."""
    u = x.view(np.uint32)
    down = (u & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    up_bits = (u & np.uint32(0xFFFF0000)) + np.uint32(0x10000)
    up = up_bits.view(np.float32).astype(np.float64)   # the next word away from zero (may be inf)
    with np.errstate(invalid="ignore", over="ignore"):
        xd = x.astype(np.float64)
        d_down, d_up = np.abs(xd - down), np.abs(up - xd)
        # the first bf16 past the largest one is inf: it is where float32's
        # next exponent would start, 2**128, as IEEE rounding says
        d_up = np.where(np.isinf(up), np.abs(2.0 ** 128 - np.abs(xd)), d_up)
    even_down = ((u >> 16) & 1) == 0
    pick_up = (d_up < d_down) | ((d_up == d_down) & ~even_down)
    out = np.where(pick_up, up_bits >> 16, u >> 16).astype(np.uint16)
    exact = (u & 0xFFFF) == 0
    out = np.where(exact, (u >> 16).astype(np.uint16), out)
    return np.where(np.isnan(x), np.uint16(0x7FC0), out)


def test_bf16_words_are_float32_rounded_to_nearest_even():
    x = samples()
    words = np.empty(x.size, np.uint16)
    to_bf16(x, words)
    want = nearest_bf16(x)
    finite = ~np.isnan(x)
    assert np.array_equal(words[finite], want[finite])
    assert np.isnan(from_bf16(words[~finite], np.empty((~finite).sum(), np.float32))).all()
    # ties: exactly halfway between two words goes to the even one
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x3F807FFF], np.uint32).view(np.float32)
    to_bf16(ties, words[:5])
    assert [hex(w) for w in words[:5]] == ["0x3f80", "0x3f82", "0xbf80", "0x3f81", "0x3f80"]


def test_every_bf16_word_decodes_to_a_float32_that_encodes_back_to_it():
    words = np.arange(2 ** 16, dtype=np.uint16)
    values = from_bf16(words, np.empty(words.size, np.float32))
    assert np.array_equal(values.view(np.uint32) >> 16, words.astype(np.uint32))   # the top 16 bits, exactly
    again = to_bf16(values, np.empty(words.size, np.uint16))
    nan = np.isnan(values)
    assert np.array_equal(again[~nan], words[~nan]) and (again[nan] == 0x7FC0).all()


def test_bf16_keeps_every_nan_and_rounds_past_the_largest_to_inf():
    nans = np.array([0x7F800001, 0x7FFFFFFF, 0xFF800001, 0xFFFFFFFF, 0xFFFF8001, 0x7FC00000], np.uint32)
    words = to_bf16(nans.view(np.float32), np.empty(nans.size, np.uint16))
    assert np.isnan(from_bf16(words, np.empty(nans.size, np.float32))).all()
    big = np.array([3.4028235e38, -3.4028235e38, 3.3895314e38], np.float32)
    back = roundtrip("bf16", big)
    assert back[0] == np.inf and back[1] == -np.inf and back[2] == big[2]


def test_bf16_agrees_with_ml_dtypes_where_it_is_installed():
    ml_dtypes = pytest.importorskip("ml_dtypes")   # not a dependency: a second opinion where present
    x = samples(50_000, seed=3)
    ours = to_bf16(x, np.empty(x.size, np.uint16))
    theirs = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    finite = ~np.isnan(x)
    assert np.array_equal(ours[finite], theirs[finite])


def test_decode_add_adds_the_words_values_in_float32():
    rng = np.random.default_rng(1)
    for kind in ("fp16", "bf16"):
        codec = Half(kind)
        x, acc = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
        words = codec.encode(x, np.empty(1000, np.uint16))
        want = acc + roundtrip(kind, x)
        got = codec.decode_add(words, acc.copy())
        assert np.array_equal(got, want), kind


# --- PowerSGD's pieces ------------------------------------------------------------------

def test_which_tensors_powersgd_compresses_follows_ddps_rule():
    assert matrix_shape((500,)) is None and matrix_shape((784, 500)) == (784, 500)
    assert matrix_shape((3, 3, 32, 64)) == (288, 64)           # NHWC: the patch against the filters
    assert compressed_rank((500,), 4, 2.0) == 0                 # 1-D: as it is
    assert compressed_rank((4096, 4096), 4, 2.0) == 4
    assert compressed_rank((4096, 10), 4, 2.0) == 4             # 4106 x 4 x 2 < 40960
    assert compressed_rank((3, 3, 1, 32), 4, 2.0) == 0          # 9 x 32: (41 x 4) x 2 > 288
    assert compressed_rank((100, 3), 8, 1.0) == 0               # rank capped at 3: (103 x 3) > 300
    mats, key = powersgd_layout([("a/W", (20, 30), 0, 600), ("a/b", (30,), 600, 630), ("b/W", (30, 5), 630, 780)],
                                2, 1.0)
    assert [(m.name, m.rows, m.cols, m.rank, m.q_lo, m.q_hi) for m in mats] == [
        ("a/W", 20, 30, 2, 0, 60), ("b/W", 30, 5, 2, 60, 70)]
    assert key == "a/W:20x30r2;b/W:30x5r2"


def test_orthogonalise_gives_orthonormal_columns_and_keeps_a_zero_matrix_zero():
    rng = np.random.default_rng(2)
    for rank in (1, 2, 4):   # of P = M Q: below R, the second pass keeps P orthonormal
        m = (rng.standard_normal((300, rank)) @ rng.standard_normal((rank, 80))).astype(np.float32)
        p = orthogonalise(m @ initial_q(0, 0, 80, 4))
        assert np.abs(p.T @ p - np.eye(4)).max() < 1e-5, rank
    zero = orthogonalise(np.zeros((50, 4), np.float32))
    assert not np.isnan(zero).any() and not zero.any()
    q = initial_q(7, 3, 80, 4)
    assert np.array_equal(q, initial_q(7, 3, 80, 4)) and not np.array_equal(q, initial_q(7, 4, 80, 4))
    assert not np.array_equal(q, initial_q(7, 3, 80, 4, step=5))


def low_rank(rng, rows, cols, rank, common=None):
    """rows x cols of rank `rank`; with `common` (a generator every rank
    seeds alike) in a column and row space shared by every rank, so their sum
    has that rank too."""
    space = common if common is not None else rng
    u, v = space.standard_normal((rows, rank)), space.standard_normal((rank, cols))
    return (u @ rng.standard_normal((rank, rank)) @ v).astype(np.float32)


def power_sgd(comm, shapes, rank=4, min_rate=1.0, **kw):
    """A PowerSgd over a buffer [head(2), tensors...] and the layout's matrices."""
    tensors, at = [], 2
    for i, shape in enumerate(shapes):
        n = int(np.prod(shape))
        tensors.append((f"t{i}", shape, at - 2, at - 2 + n))
        at += n
    buf = np.zeros(at, np.float32)
    mats, _ = powersgd_layout(tensors, rank, min_rate)
    return PowerSgd(RingAllreduce(comm), buf, mats, offset=2, **kw), tensors


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_powersgd_is_exact_for_a_gradient_of_rank_at_most_r(rank):
    exchange, tensors = power_sgd(MPI.COMM_SELF, [(120, 70), (70,)], rank=4)
    rng = np.random.default_rng(rank)
    g = low_rank(rng, 120, 70, rank)
    exchange.buffer[2:2 + g.size] = g.ravel()
    exchange.buffer[2 + g.size:] = rng.standard_normal(70)
    want = exchange.buffer.copy()
    exchange.begin(0)
    exchange.allreduce(0, exchange.buffer.size)
    err = np.abs(exchange.buffer - want).max() / np.abs(want).max()
    assert err < 1e-5, err
    assert np.abs(exchange.error).max() < 1e-5 * np.abs(g).max()   # nothing left behind


def test_powersgd_of_a_full_rank_gradient_is_not_exact_but_its_error_is_kept():
    exchange, _ = power_sgd(MPI.COMM_SELF, [(120, 70)], rank=4)
    g = np.random.default_rng(9).standard_normal(120 * 70).astype(np.float32)
    exchange.buffer[2:] = g
    exchange.begin(0)
    exchange.allreduce(0, exchange.buffer.size)
    assert np.abs(exchange.buffer[2:] - g).max() > 0.1           # rank 4 of 70: lossy
    np.testing.assert_allclose(exchange.buffer[2:] + exchange.error[2:], g, rtol=0, atol=1e-5)


def test_powersgd_before_its_start_step_is_the_strategy_bit_for_bit():
    exchange, _ = power_sgd(MPI.COMM_SELF, [(40, 30)], start=3)
    g = np.random.default_rng(4).standard_normal(1200).astype(np.float32)
    exchange.buffer[2:] = g
    exchange.begin(2)
    exchange.allreduce(0, exchange.buffer.size)
    assert np.array_equal(exchange.buffer[2:], g) and not exchange.error.any()
    exchange.begin(3)
    exchange.allreduce(0, exchange.buffer.size)
    assert not np.array_equal(exchange.buffer[2:], g)


# --- the exchanges on every rank ------------------------------------------------------

def same_everywhere(comm, x):
    first = x.copy()
    comm.Bcast(first, root=0)
    agree = np.array([np.array_equal(first, x, equal_nan=True)], np.int64)
    comm.Allreduce(MPI.IN_PLACE, agree, op=MPI.MIN)
    return bool(agree[0])


def fake_nodes(comm):
    """Two ranks per "node": hier's two levels on one machine."""
    return Topology(comm, node_comm=comm.Split(comm.rank // 2, comm.rank))


def strategies(comm):
    out = {"ring": RingAllreduce(comm),
           "staged ring": StagedAllreduce(RingAllreduce(comm), LazyCopier(), chunk_bytes=4096)}
    topology = fake_nodes(comm)
    if topology.equal_nodes:
        out["hier"] = HierAllreduce(topology)
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_16_bit_buckets_give_every_rank_the_same_bits_near_the_float32_sum(kind):
    comm = MPI.COMM_WORLD
    lengths = [1, comm.size - 1, 7, 1001, SEGMENT_BYTES // 2 * comm.size + 5]
    for name, strategy in strategies(comm).items():
        for n in lengths:
            rng = np.random.default_rng([comm.rank, n])
            x = rng.standard_normal(n).astype(np.float32)
            exact = np.zeros(n, np.float64)
            comm.Allreduce(x.astype(np.float64), exact)
            plain, shard = x.copy(), x.copy()
            HalfExchange(strategy, plain, kind).allreduce(0, n)
            a, b = HalfExchange(strategy, shard, kind).reduce_scatter(0, n)
            assert same_everywhere(comm, plain), (name, n)
            if not name.startswith("staged"):   # staged: allreduce by chunks, another order of sums
                assert np.array_equal(shard[a:b], plain[a:b]), (name, n)   # sharded: unsharded's bits
            # each hop rounds a partial sum once, the owner once more: a few units of the last place
            ulp = 2.0 ** -10 if kind == "fp16" else 2.0 ** -7
            err = np.abs(plain - exact).max() / np.abs(exact).max()
            assert err < comm.size * ulp, (name, n, err)
            if kind == "bf16":   # every value is one the words can carry: rounded once, by its owner
                assert np.array_equal(roundtrip(kind, plain), plain), (name, n)


@pytest.mark.mpi(min_size=2)
def test_fp16_divides_before_the_sum_so_a_sum_past_65504_does_not_overflow():
    comm = MPI.COMM_WORLD
    ring = RingAllreduce(comm)
    value = np.float32(40000.0)   # one rank's gradient: fine in fp16; W of them summed: not
    assert np.isinf(roundtrip("fp16", np.array([value * comm.size], np.float32)))[0]
    undivided = np.full(1000, value, np.float32)
    HalfRing(ring, Half("fp16"), ranks=1).allreduce(undivided)   # 16-bit partial sums, nothing divided
    assert np.isinf(undivided).all()
    buf = np.full(1002, value, np.float32)
    HalfExchange(ring, buf, "fp16").allreduce(0, buf.size)
    assert np.isfinite(buf).all()
    np.testing.assert_allclose(buf, value * comm.size, rtol=2.0 ** -10)
    assert same_everywhere(comm, buf)
    # bf16 has float32's range: no division, no overflow
    wide = np.full(1000, np.float32(3e37), np.float32)
    HalfExchange(ring, wide, "bf16").allreduce(0, wide.size)
    assert np.isfinite(wide).all() and np.allclose(wide, 3e37 * comm.size, rtol=2.0 ** -7)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("split", [False, True])
def test_powersgd_is_exact_for_a_summed_gradient_of_rank_at_most_r_on_every_rank(split):
    comm = MPI.COMM_WORLD
    strategy = HierAllreduce(fake_nodes(comm)) if split and comm.size % 2 == 0 else RingAllreduce(comm)
    exchange, _ = power_sgd(comm, [(90, 60), (60,), (60, 10)], rank=4)
    exchange.strategy = strategy
    rng, common = np.random.default_rng(comm.rank), np.random.default_rng(11)
    g0, g1 = low_rank(rng, 90, 60, 3, common), low_rank(rng, 60, 10, 2, common)
    buf = exchange.buffer
    buf[:2] = rng.standard_normal(2)
    buf[2:] = np.concatenate([g0.ravel(), rng.standard_normal(60).astype(np.float32), g1.ravel()])
    want = np.zeros(buf.size, np.float64)
    comm.Allreduce(buf.astype(np.float64), want)
    exchange.begin(0)
    exchange.allreduce(0, buf.size)
    assert same_everywhere(comm, buf)
    assert np.abs(buf - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sharded", [False, True])
def test_error_feedback_loses_nothing_on_every_rank(sharded):
    """sent + new error = gradient + old error on each rank (sent: what its
    P^T M leaves after P), and the ranks' sends sum to what everyone applies;
    the uncompressed tensors are the float32 sums. Three steps, so the old
    error is not zero from the second on."""
    comm = MPI.COMM_WORLD
    exchange, tensors = power_sgd(comm, [(80, 50), (50,), (50, 30)], rank=3)
    buf, n = exchange.buffer, exchange.buffer.size
    rng = np.random.default_rng([comm.rank, 5])
    for step in range(3):
        buf[:] = rng.standard_normal(n).astype(np.float32)
        grad, old = buf.astype(np.float64), exchange.error.astype(np.float64)
        exact = np.zeros(n, np.float64)
        comm.Allreduce(grad, exact)      # what the uncompressed parts must become
        exchange.begin(step)
        if sharded:
            a, b = exchange.reduce_scatter(0, n)
            assert (a, b) == exchange.strategy.shard(n)
        else:
            exchange.allreduce(0, n)
        assert same_everywhere(comm, buf)
        sent = np.zeros(n)
        mats = {m.lo + 2: m for m in exchange.matrices}
        for name, shape, lo, hi in tensors:
            lo, hi = lo + 2, hi + 2
            if lo not in mats:
                assert not exchange.error[lo:hi].any()
                np.testing.assert_allclose(buf[lo:hi], exact[lo:hi], rtol=1e-6, atol=1e-6, err_msg=name)
                continue
            m = mats[lo]
            p = p_factor(exchange, m)
            M = (grad[lo:hi] + old[lo:hi]).reshape(m.rows, m.cols)
            mine = p.astype(np.float64) @ (p.astype(np.float64).T @ M)     # this rank's send
            sent[lo:hi] = mine.ravel()
            np.testing.assert_allclose(mine.ravel() + exchange.error[lo:hi], M.ravel(), rtol=0,
                                       atol=1e-5 * np.abs(M).max(), err_msg=name)
        total = np.zeros(n)
        comm.Allreduce(sent, total)
        for m in exchange.matrices:
            lo, hi = m.lo + 2, m.hi + 2
            np.testing.assert_allclose(buf[lo:hi], total[lo:hi], rtol=0, atol=1e-4 * np.abs(total[lo:hi]).max())
        assert np.abs(exchange.error).max() > 0   # full-rank gradients: something is always left


def p_factor(exchange, m):
    """P of matrix m as the last exchange left it (orthonormal), read where
    the exchange keeps it: its bucket's flat buffer."""
    bucket = next(b for b in exchange._buckets.values() if m in b.matrices)
    at = bucket.p_at[bucket.matrices.index(m)]
    return bucket.flat[at:at + m.p_size].reshape(m.rows, m.rank)


def ring_steps(comm, strategy, kind, sharded, fusion_elems, overlap, clip=None, steps=4):
    """The ring loop's arithmetic (loops/ring_step.RingStep) for a few steps
    with --compression `kind`: the parameters and every step's summed loss."""
    from hpctrain.nn import mlp
    from hpctrain.optim.clipping import Clip
    from hpctrain.run.plan import Compression
    from hpctrain.loops.ring_step import RingStep
    rng = np.random.default_rng(200 + comm.rank)
    ring = RingStep(mlp(hidden=(37, 19)), strategy, comm, np, ("adam", {}), fusion_elems, zero=int(sharded),
                    overlap=overlap, clip=Clip(clip) if clip else None, compression=Compression(kind=kind, start=1))
    model = ring.model
    model.init(0)
    losses = []
    for step in range(steps):
        x, y = rng.random((8, 784)).astype(np.float32), rng.integers(0, 10, 8)
        ring.begin(1e-2, False, step)
        losses.append(ring_step(ring, x, y, comm.rank + 1 + step)[0])
    ring.close()
    return model.params.copy(), losses


def hier_on_two_nodes(comm):
    """hier over a fake split: 2 ranks a node where the size allows, else 1."""
    node = comm.rank // 2 if comm.size % 2 == 0 else comm.rank
    with Topology(comm, node_comm=comm.Split(node, comm.rank)) as topology:
        return HierAllreduce(topology)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["fp16", "bf16", "powersgd"])
@pytest.mark.parametrize("fusion_elems, overlap", [(0, False), (300, True)])
def test_sharded_compressed_steps_are_unsharded_bit_for_bit_on_ring_and_across_nodes(kind, fusion_elems, overlap):
    """Sharded with compression on hier across nodes, each rank owns its
    node chunk (comm/compressed_exchange.NodeShards): the same bits as unsharded, on
    every rank; on the flat ring, the ring's own shards, the same too."""
    comm = MPI.COMM_WORLD
    for make in (RingAllreduce, hier_on_two_nodes):
        plain, plain_losses = ring_steps(comm, make(comm), kind, False, fusion_elems, overlap)
        shard, losses = ring_steps(comm, make(comm), kind, True, fusion_elems, overlap)
        assert np.array_equal(plain, shard), make.__name__
        assert same_everywhere(comm, shard) and losses == plain_losses
        assert losses[0] == float(sum(r + 1 for r in range(comm.size)))   # the loss slot: float32, exact


@pytest.mark.mpi(min_size=2)
def test_clipped_sharded_compression_across_nodes_counts_each_node_chunk_once():
    """--clip-norm with node shards: the norm's parts travel over the node's
    ring, so no chunk counts once per node (the clip would be too strong)."""
    comm = MPI.COMM_WORLD
    plain, _ = ring_steps(comm, hier_on_two_nodes(comm), "bf16", False, 300, False, clip=0.05)
    shard, _ = ring_steps(comm, hier_on_two_nodes(comm), "bf16", True, 300, False, clip=0.05)
    assert same_everywhere(comm, shard)
    np.testing.assert_allclose(shard, plain, rtol=0, atol=1e-6)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["ring", "hier"])
def test_device_wrapped_strategies_compress_as_the_host_ones(fake_gpu, name):
    """The GPU's wiring on NumPy stand-ins (the factory's BoundToDevice, and
    StagedAllreduce with a lazy copier): the 16-bit exchange maps through
    the wrappers (half_strategy) and gives the host strategy's bits;
    PowerSGD's factors go through them as float32 sums."""
    from hpctrain.comm import make_allreduce
    from hpctrain.comm.device_buffers import BoundToDevice
    from test_hier import fake_topology
    comm = MPI.COMM_WORLD
    with fake_topology("blocks of 2" if comm.size % 2 == 0 else "one per node") as topology:
        host = make_allreduce(name, topology, np)
        staged = make_allreduce(name, topology, fake_gpu, cuda_aware="no")
        direct = make_allreduce(name, topology, fake_gpu, cuda_aware="yes")
    assert isinstance(staged, BoundToDevice) and isinstance(staged.inner, StagedAllreduce)
    rng = np.random.default_rng([comm.rank, 8])
    x = rng.standard_normal(20_003).astype(np.float32)
    for kind in ("fp16", "bf16"):
        want = x.copy()
        HalfExchange(host, want, kind).allreduce(0, want.size)
        for strategy in (staged, direct):
            got = x.copy()
            HalfExchange(strategy, got, kind).allreduce(0, got.size)
            assert np.array_equal(got, want), (kind, strategy.path)
    exchange, _ = power_sgd(comm, [(90, 60), (60,)], rank=4)
    results = []
    for strategy in (host, staged, direct):
        exchange.strategy = strategy
        exchange.buffer[:] = x[:exchange.buffer.size]
        exchange.error[:] = 0
        exchange.draw_q()
        exchange.begin(0)
        exchange.allreduce(0, exchange.buffer.size)
        results.append(exchange.buffer.copy())
    assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2])
    assert same_everywhere(comm, results[0])
