"""Compressed gradient exchanges (--compression fp16|bf16|powersgd): what a
fused bucket becomes on the wire, behind the two calls the fused allreduce
makes for a bucket [lo, hi) of its buffer, `allreduce(lo, hi)` and
`reduce_scatter(lo, hi)` (comm/fusion.py; a pipeline stage's replicas,
pipeline/engine.py). Like DDP's communication hooks: the engine around it
does not know. The arithmetic (codecs, orthogonalisation, which tensors)
is optim/compression_math.py's; this module (and comm/powersgd.py, PowerSGD's
exchange) moves the bytes.

fp16 / bf16 (`HalfExchange`): each bucket crosses the wire as 16-bit words,
half the bytes, and is summed in float32: hpctrain's ring (comm/ring_allreduce.py)
with 16-bit messages (`HalfRing`), where a rank decodes what it receives,
adds it to its float32 partial sum and encodes that for the next hop. The
rank that owns a chunk at the end of the reduce-scatter rounds the sum once
to 16 bits and the allgather passes those words on unchanged, so every rank
decodes the same bits. `HalfHier` is the hierarchical allreduce (comm/hier.py)
with its inter-node ring a HalfRing: 16 bits where the bytes cross nodes,
float32 inside a node (shared memory: no bytes to save, conversions to
spare); the inter-node ring's owner rounds. fp16 divides what it puts on
the wire by the number of ranks before the sum and multiplies the result
back after it (Horovod's and DDP's fp16 compression divide before the
sum): no partial sum can then exceed the largest gradient element of a
single rank, where an undivided sum of W gradients near 65504 / W
overflows to inf (tests/test_compression.py shows both). bf16 has
float32's range and is not divided. The buffer is gradients only: the
loss and the stop flag are summed apart (comm/step_gradient.py). MPI's and NCCL's collectives have no 16-bit sum in float32: --allreduce mpi
and nccl are refused with fp16 and bf16 (cli.validate).

PowerSGD (`PowerSgd`: rank-R factors with error feedback, Vogels et al.
2019) is comm/powersgd.py's; make_exchange picks one or the other.

Sharded (--shard-optimizer on): reduce_scatter(lo, hi) leaves this rank's
part summed, as a strategy's does; fp16/bf16 compress the reduce-scatter
(its part rounded as unsharded, so the same bits), PowerSGD exchanges the
whole bucket (comm/powersgd.py) and returns this rank's part, and the parameters'
allgather stays float32 (comm/fusion.py). On hier across several nodes the
shards are the node ring's (`NodeShards`): the compressed sum crosses the
nodes, the parameters' allgather stays inside them. A flat ring across
nodes allgathers float32 parameters over the links: fp16 sends 3/4 of
the bytes there, PowerSGD about half of them (docs/ring.md).

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_compression.py
"""
import numpy as np
from mpi4py import MPI

from ..base.chunks import chunk_bounds
from ..base.device import Scratch, all_finite
from ..optim.compression_math import HALF_KINDS, Half
from .device_buffers import BoundToDevice
from .hier import HierAllreduce
from .powersgd import PowerSgd
from .ring_allreduce import SEGMENT_BYTES, RingAllreduce, _device_sync
from .staged import StagedAllreduce

# A reduce-scatter chunk travels in messages of this many 16-bit words, so
# the decode and add of one overlaps the transfer of the next (ring.py's
# segments, the same bytes).
SEGMENT_WORDS = SEGMENT_BYTES // 2


class HalfRing:
    """The ring of `ring` (a RingAllreduce: its communicator, neighbours,
    watchdog and chunks; no new communicator) on float32 buffers with
    16-bit messages of `codec` (optim/compression_math.Half). `ranks`: how many
    gradients the sum adds up (fp16 divides by it before the sum and
    multiplies the result back: hier's inter-node ring sums node sums of
    all the ranks). allreduce and reduce_scatter as a strategy's; no
    allgather: nothing allgathers 16-bit words (a sharded step allgathers
    its parameters in float32, comm/fusion.py)."""

    def __init__(self, ring, codec, ranks=None):
        self.ring, self.codec = ring, codec
        self.size, self.rank = ring.size, ring.rank
        self.name = f"{ring.name} ({codec.kind})"
        self.scale = int(ranks or ring.size) if codec.prescale else 1
        self._scratch = Scratch()

    def shard(self, n):
        return self.ring.shard(n)

    def parts(self, n):
        return self.ring.parts(n)

    def _words(self, xp, n):
        return self._scratch.get("words", xp, np.uint16, n)

    def _round(self, buf, words, lo, hi):
        """The owner's sum rounded to 16 bits: what every rank will decode."""
        self.codec.round_(buf[lo:hi], words[lo:hi])

    def _down(self, buf):
        if self.scale > 1:   # fp16: the mean on the wire, no partial sum past one rank's largest value
            buf *= buf.dtype.type(1.0 / self.scale)

    def _up(self, buf):
        if self.scale > 1:
            buf *= buf.dtype.type(self.scale)

    def _waiting(self, what):
        return self.ring._waiting(f"{self.ring.label} {what} ({self.codec.kind})")

    def reduce_scatter(self, buf):
        lo, hi = self.shard(buf.size)
        if buf.size == 0:
            return lo, hi
        xp, sync = _device_sync(buf)
        self._down(buf)
        if self.size > 1:
            with self._waiting("reduce-scatter"):
                self._reduce_scatter(buf, xp, sync)
        self._round(buf, self._words(xp, buf.size), lo, hi)
        self._up(buf[lo:hi])
        if sync is not None:
            sync()
        return lo, hi

    def allreduce(self, buf):
        if buf.size == 0:
            return buf
        xp, sync = _device_sync(buf)
        words = self._words(xp, buf.size)
        lo, hi = self.shard(buf.size)
        self._down(buf)
        with self._waiting("allreduce"):
            if self.size > 1:
                self._reduce_scatter(buf, xp, sync)
            self._round(buf, words, lo, hi)   # one rank alone: rounded all the same
            if sync is not None:
                sync()
            if self.size > 1:
                self._allgather(buf, words, sync)
        self._up(buf)
        if sync is not None:
            sync()
        return buf

    def _reduce_scatter(self, buf, xp, sync):
        ring, codec = self.ring, self.codec
        n, size, rank = buf.size, self.size, self.rank
        bounds = chunk_bounds(n, size)
        longest = max(bounds[i + 1] - bounds[i] for i in range(size))
        send = self._scratch.get("send", xp, np.uint16, longest)
        recv = self._scratch.get("recv", xp, np.uint16, longest)
        comm, right, left, seg = ring.comm, ring.right, ring.left, SEGMENT_WORDS
        # As ring.py: after step s, chunk (rank - s - 1) holds s+2 ranks' sum.
        for step in range(size - 1):
            s, r = (rank - step) % size, (rank - step - 1) % size
            s_lo, s_hi, r_lo, r_hi = bounds[s], bounds[s + 1], bounds[r], bounds[r + 1]
            ns, nr = s_hi - s_lo, r_hi - r_lo
            codec.encode(buf[s_lo:s_hi], send[:ns])
            if sync is not None:
                sync()   # MPI reads the words the kernel wrote
            # Message counts follow from a chunk's length, the same on both neighbours.
            sends = [comm.Isend(send[a:min(a + seg, ns)], right, 0) for a in range(0, ns, seg)]
            starts = list(range(0, nr, seg))
            recvs = [comm.Irecv(recv[a:min(a + seg, nr)], left, 0) for a in starts]
            for request, a in zip(recvs, starts):
                request.Wait()
                b = min(a + seg, nr)
                codec.decode_add(recv[a:b], buf[r_lo + a:r_lo + b])
            if sync is not None:
                sync()   # the adds read `recv` before the next step receives into it
            MPI.Request.Waitall(sends)

    def _allgather(self, buf, words, sync):
        """The owners' words around the ring, straight into place, each decoded on arrival."""
        ring, size, rank = self.ring, self.size, self.rank
        bounds = chunk_bounds(buf.size, size)
        for step in range(size - 1):
            s, r = (rank + 1 - step) % size, (rank - step) % size
            ring.comm.Sendrecv(words[bounds[s]:bounds[s + 1]], ring.right, 1,
                               words[bounds[r]:bounds[r + 1]], ring.left, 1)
            self.codec.decode(words[bounds[r]:bounds[r + 1]], buf[bounds[r]:bounds[r + 1]])
        if sync is not None:
            sync()


class HalfHier:
    """comm/hier.py's two levels with 16-bit messages where they cross nodes:
    the node's reduce-scatter in float32 (its ring is shared memory, where
    16 bits would save nothing and cost the conversions), the inter-node
    ring's allreduce of the node chunk as a HalfRing (its owner rounds;
    fp16 divides by all the ranks), the node's allgather of the rounded
    values in float32. Every rank ends with the same bits; no new
    communicator."""

    def __init__(self, hier, codec):
        self.hier = hier
        self.intra, self.inter = hier.intra, HalfRing(hier.inter, codec, ranks=hier.size)
        self.size, self.rank = hier.size, hier.rank
        self.name = f"{hier.name} ({codec.kind} across nodes)"

    def shard(self, n):
        return self.hier.shard(n)

    def parts(self, n):
        return self.hier.parts(n)

    def allreduce(self, buf):
        if buf.size == 0:
            return buf
        a, b = self.intra.reduce_scatter(buf)
        self.inter.allreduce(buf[a:b])   # one node: rounded in place
        self.intra.allgather(buf)
        return buf

    def reduce_scatter(self, buf):
        if buf.size == 0:
            return self.shard(0)
        a, b = self.intra.reduce_scatter(buf)
        c, d = self.inter.reduce_scatter(buf[a:b])
        return a + c, a + d


class NodeShards:
    """hier (a HierAllreduce on several nodes) sharded by its node's ring
    only: each rank owns the node chunk the node's reduce-scatter leaves it,
    summed over every rank by the inter-node allreduce; ranks with the same
    local rank on every node own the same chunk and update it alike (the same
    sums, the same elementwise update, the same bits), and the allgather of
    the parameters stays inside the node. What --shard-optimizer on becomes
    with --compression on several nodes: only the compressed sum crosses
    them (hier's own sharding would allgather float32 parameters across
    them too), the optimizer's work and state 1/L. `shard_comm`: the node's
    communicator, where the shards' norm parts travel (comm/grad_norm.py)."""

    def __init__(self, hier):
        self.hier, self.intra, self.inter = hier, hier.intra, hier.inter
        self.size, self.rank, self.name = hier.size, hier.rank, hier.name
        self.shard_comm = hier.intra.comm

    def shard(self, n):
        return self.intra.shard(n)

    def parts(self, n):
        return self.intra.parts(n)

    def allreduce(self, buf):
        return self.hier.allreduce(buf)

    def reduce_scatter(self, buf):
        a, b = self.intra.reduce_scatter(buf) if buf.size else self.shard(0)
        if buf.size:
            self.inter.allreduce(buf[a:b])
        return a, b

    def allgather(self, buf):
        return self.intra.allgather(buf)


class HalfNodeShards(HalfHier):
    """NodeShards with the inter-node allreduce in 16 bits (HalfHier's)."""

    def __init__(self, shards, codec):
        super().__init__(shards.hier, codec)

    def shard(self, n):
        return self.intra.shard(n)

    def parts(self, n):
        return self.intra.parts(n)

    def reduce_scatter(self, buf):
        if buf.size == 0:
            return self.shard(0)
        a, b = self.intra.reduce_scatter(buf)
        self.inter.allreduce(buf[a:b])
        return a, b


def sharding_for(strategy, compression):
    """The strategy a sharded ring step shards with: `strategy` itself, or
    with --compression on hier across several nodes (host buffers) NodeShards."""
    if compression is not None and compression.kind != "none" and isinstance(strategy, HierAllreduce) \
            and strategy.num_nodes > 1:
        return NodeShards(strategy)
    return strategy


def half_strategy(strategy, codec):
    """`strategy` (comm/__init__.make_allreduce's) with 16-bit messages: the
    ring and hier as HalfRing and HalfHier over the same communicators, a
    device wrapper (staged through host memory, bound to the GPU) around the
    same. MPI's and NCCL's collectives have no such form (cli.validate
    refuses them first)."""
    if isinstance(strategy, BoundToDevice):
        return BoundToDevice(half_strategy(strategy.inner, codec), strategy.xp, strategy.path)
    if isinstance(strategy, StagedAllreduce):
        return StagedAllreduce(half_strategy(strategy.inner, codec), strategy.copier, strategy.chunk_bytes)
    if isinstance(strategy, NodeShards):
        return HalfNodeShards(strategy, codec)
    if isinstance(strategy, RingAllreduce):
        return HalfRing(strategy, codec)
    if isinstance(strategy, HierAllreduce):
        return HalfHier(strategy, codec)
    raise ValueError(f"--compression {codec.kind} needs hpctrain's ring or hier allreduce, not {strategy.name}")


class HalfExchange:
    """--compression fp16|bf16 over `buffer` (the gradient buffer, or a
    pipeline stage's slice of it): each bucket through half_strategy(strategy).
    fp16: `sent_finite` says whether every value this rank put on the wire
    this step was finite, so that a sum that is not can be told from an
    overflow of the 16-bit words (loops/ring.py)."""

    def __init__(self, strategy, buffer, kind):
        self.kind, self.codec = kind, Half(kind)
        self.strategy, self.buffer = strategy, buffer
        self.half = half_strategy(strategy, self.codec)
        self.size = strategy.size
        self.sent_finite = True

    def begin(self, step):
        """Every bucket of every step is compressed: only the finiteness check starts anew."""
        self.sent_finite = True

    def allreduce(self, lo, hi):
        self._run(lo, hi, self.half.allreduce)
        return 0, hi - lo

    def reduce_scatter(self, lo, hi):
        return self._run(lo, hi, self.half.reduce_scatter)

    def _run(self, lo, hi, op):
        buf = self.buffer[lo:hi]
        if self.codec.prescale and self.sent_finite:   # fp16 (one scan, beside the encode's passes)
            self.sent_finite = all_finite(buf)
        done = op(buf)
        return (0, buf.size) if done is buf else done

    def sent_bytes(self, lo, hi):
        """Bytes of this bucket each rank hands its strategy per step (the
        ring sends 2(N-1)/N of them)."""
        return 2 * (hi - lo)


def make_exchange(compression, strategy, buffer, matrices=(), offset=0):
    """The exchange for run/plan.Compression `compression` over `buffer`,
    or None for --compression none (the strategy as today). matrices and
    offset: PowerSGD's (PowerSgd)."""
    kind = compression.kind
    if kind == "none":
        return None
    if kind in HALF_KINDS:
        return HalfExchange(strategy, buffer, kind)
    return PowerSgd(strategy, buffer, matrices, offset, start=compression.start,
                    warm_start=compression.warm_start, eps=compression.epsilon,
                    error_feedback=compression.error_feedback, seed=compression.seed)


def summary(exchange, buckets, sharded=False):
    """The start-up line for an exchange over `buckets` ([(lo, hi)] of its
    buffer): what goes how, and the bytes against float32's."""
    full = 4 * sum(hi - lo for lo, hi in buckets)
    sent = sum(exchange.sent_bytes(lo, hi) for lo, hi in buckets)
    via = getattr(exchange.strategy, "name", "?")
    if exchange.kind == "powersgd" and not exchange.matrices:
        # a rank at or past a matrix's smaller side (where it is capped) never pays
        what = ("compression powersgd compresses no matrix: at --powersgd-rank R (at most a matrix's smaller "
                "side) no rows x cols matrix is --powersgd-min-rate times the (rows + cols) x R floats of its "
                "factors, so every bucket goes as float32, as with --compression none")
    elif exchange.kind == "powersgd":
        n = sum(m.hi - m.lo for m in exchange.matrices)
        ranks = sorted({m.rank for m in exchange.matrices})
        what = (f"compression powersgd rank {'/'.join(map(str, ranks))} from step {exchange.start}"
                f"{'' if exchange.warm_start else ', no warm start'}"
                f"{'' if exchange.error is not None else ', no error feedback'}: {len(exchange.matrices)} "
                f"matri{'x' if len(exchange.matrices) == 1 else 'ces'} as factors ({n:,} of {full // 4:,} floats), "
                f"the rest as float32; P and Q by the {via} allreduce")
    else:
        what = (f"compression {exchange.kind}: every bucket as 16-bit words over the {exchange.half.name} "
                f"allreduce, summed in float32" + (f", divided by the {exchange.size} ranks first"
                                                   if exchange.codec.prescale and exchange.size > 1 else ""))
    line = f"hpctrain: {what}; {sent / full:.2%} of the float32 bytes"
    if sharded and isinstance(exchange.strategy, NodeShards):
        line += " (--shard-optimizer on: shards of each node, the parameters' allgather inside the nodes)"
    elif sharded:
        # the reduce-scatter is compressed, the parameters' allgather (comm/fusion.py) is not
        line += (f" (--shard-optimizer on: the parameters' allgather float32, {(sent + full) / (2 * full):.2%} "
                 f"of the bytes in all)")
    return line
