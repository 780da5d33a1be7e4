"""--compression powersgd's exchange of a bucket, behind the same two calls
as comm/compressed_exchange.py's 16-bit one (allreduce(lo, hi), reduce_scatter(lo, hi)).

PowerSGD (`PowerSgd`, Vogels et al. 2019, Algorithm 1 with error feedback;
DDP's powerSGD_hook), per bucket: every matrix it compresses
(optim/compression_math.powersgd_layout) gets this rank's error added (M = grad +
error), then P = M Q (Q warm-started: the last step's), one float32
allreduce of every P of the bucket together with the bucket's uncompressed
tensors (1-D, small matrices, the loss and stop slots) packed beside them;
P orthogonalised (after the sum, as the paper and DDP do: a sum of
orthonormal bases is not one, and each rank orthogonalises the same summed
P to the same bits); Q = M^T P, this rank's; the new error, what this rank
did not send: M - P Q^T (its Q, before the sum); one allreduce of the Qs;
the bucket's matrices become M_hat = P Q^T (the summed Q), the same bits on
every rank. What rank r sent, P (P^T M_r), summed over the ranks is M_hat:
error feedback loses nothing (sent + new error = gradient + old error, on
every rank). Until --powersgd-start the buckets go as float32, untouched
(today's bits). Works over any strategy (ring, hier, mpi, nccl): P and Q
are plain float32 allreduces.

Sharded (--shard-optimizer on): reduce_scatter(lo, hi) exchanges the whole
bucket as above and returns this rank's part; the parameters' allgather
stays float32 (comm/fusion.py). make_exchange and summary (comm/compressed_exchange.py)
choose it and describe it; the arithmetic (which tensors, the Qs' draw,
orthogonalisation) is optim/compression_math.py's, this module moves the bytes.

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_compression.py
"""
from ..base.device import array_module
from ..optim.compression_math import initial_q, orthogonalise
from ..base.precision import FLOAT32


class _Bucket:
    """PowerSGD's plan of one bucket: its matrices, the uncompressed ranges
    (exact), and the flat float32 buffer of the exact parts and the Ps."""
    __slots__ = ("matrices", "exact", "flat", "p_at", "q_lo", "q_hi")


class PowerSgd:
    """--compression powersgd over `buffer`. matrices: the Matrix list
    (optim/compression_math.powersgd_layout) of the tensors it compresses, in
    model (body) coordinates, each at buffer offset lo + `offset`; the Qs of
    matrices[0] ... lie in one flat buffer `q`. start, warm_start, eps,
    error_feedback, seed: --powersgd-start, -warm-start, -epsilon,
    -error-feedback, --seed. `error`: this rank's error, buffer-sized (zero
    outside the matrices)."""

    kind = "powersgd"

    def __init__(self, strategy, buffer, matrices, offset=0, start=0, warm_start=True, eps=0.0,
                 error_feedback=True, seed=0):
        xp = self.xp = array_module(buffer)
        self.strategy, self.buffer, self.offset = strategy, buffer, int(offset)
        self.start, self.warm_start, self.eps, self.seed = int(start), bool(warm_start), float(eps), int(seed)
        self.matrices = list(matrices)
        self.q_base = self.matrices[0].q_lo if self.matrices else 0
        size = (self.matrices[-1].q_hi - self.q_base) if self.matrices else 0
        self.q = xp.zeros(size, FLOAT32.grads)
        self.error = xp.zeros(buffer.size, FLOAT32.grads) if error_feedback else None
        self.active, self.step = False, None
        self._buckets = {}
        self.draw_q()

    # --- state ------------------------------------------------------------------

    def draw_q(self, step=None):
        """Every Q afresh from (seed, its index[, step])."""
        for m in self.matrices:
            self._q(m)[...] = self.xp.asarray(initial_q(self.seed, m.index, m.cols, m.rank, step))

    def begin(self, step):
        """Before step `step` (0-based)'s buckets: compressed from --powersgd-start on."""
        self.step, self.active = int(step), int(step) >= self.start
        if self.active and not self.warm_start:
            self.draw_q(step)

    def _q(self, m):
        return self.q[m.q_lo - self.q_base:m.q_hi - self.q_base].reshape(m.cols, m.rank)

    def _at(self, m):
        return m.lo + self.offset, m.hi + self.offset

    # --- the exchange ---------------------------------------------------------------

    def _bucket(self, lo, hi):
        bucket = self._buckets.get((lo, hi))
        if bucket is not None:
            return bucket
        bucket = _Bucket()
        inside = []
        for m in self.matrices:
            a, b = self._at(m)
            if a < hi and b > lo:
                if not (lo <= a and b <= hi):   # buckets end on layer starts: never
                    raise ValueError(f"{m.name} [{a}, {b}) is split by the bucket [{lo}, {hi})")
                inside.append(m)
        bucket.matrices = inside
        exact, at = [], lo
        for m in inside:
            a, b = self._at(m)
            if a > at:
                exact.append((at, a))
            at = b
        if at < hi:
            exact.append((at, hi))
        bucket.exact = exact
        n_exact = sum(b - a for a, b in exact)
        bucket.p_at, p = [], n_exact
        for m in inside:
            bucket.p_at.append(p)
            p += m.p_size
        bucket.flat = self.xp.zeros(p, FLOAT32.grads)
        if inside:
            bucket.q_lo, bucket.q_hi = inside[0].q_lo - self.q_base, inside[-1].q_hi - self.q_base
        self._buckets[(lo, hi)] = bucket
        return bucket

    def allreduce(self, lo, hi):
        bucket = self._bucket(lo, hi)
        if not self.active or not bucket.matrices:
            self.strategy.allreduce(self.buffer[lo:hi])   # float32, today's bits
            return 0, hi - lo
        xp, buf, flat, error = self.xp, self.buffer, bucket.flat, self.error
        mats = []
        for m, at in zip(bucket.matrices, bucket.p_at):
            a, b = self._at(m)
            grad = buf[a:b].reshape(m.rows, m.cols)
            if error is not None:
                grad += error[a:b].reshape(m.rows, m.cols)    # M = gradient + what was not sent
            p = flat[at:at + m.p_size].reshape(m.rows, m.rank)
            xp.matmul(grad, self._q(m), out=p)
            mats.append((m, grad, p, self._q(m), a, b))
        at = 0
        for a, b in bucket.exact:
            flat[at:at + b - a] = buf[a:b]
            at += b - a
        self.strategy.allreduce(flat)    # the Ps and the uncompressed tensors, float32
        at = 0
        for a, b in bucket.exact:
            buf[a:b] = flat[at:at + b - a]
            at += b - a
        for m, grad, p, q, a, b in mats:
            orthogonalise(p, self.eps)
            xp.matmul(grad.T, p, out=q)                  # this rank's Q
            if error is not None:
                sent = error[a:b].reshape(m.rows, m.cols)
                xp.matmul(p, q.T, out=sent)              # what this rank sends of M
                xp.subtract(grad, sent, out=sent)        # the rest waits for the next step
        self.strategy.allreduce(self.q[bucket.q_lo:bucket.q_hi])
        for m, grad, p, q, a, b in mats:
            xp.matmul(p, q.T, out=grad)                  # M_hat, the same bits on every rank
        return 0, hi - lo

    def reduce_scatter(self, lo, hi):
        bucket = self._bucket(lo, hi)
        if not self.active or not bucket.matrices:
            return self.strategy.reduce_scatter(self.buffer[lo:hi])
        self.allreduce(lo, hi)
        return self.strategy.shard(hi - lo)

    def sent_bytes(self, lo, hi):
        """Bytes of this bucket each rank hands its strategy per step, once compressed."""
        bucket = self._bucket(lo, hi)
        if not bucket.matrices:
            return 4 * (hi - lo)
        return 4 * (bucket.flat.size + bucket.q_hi - bucket.q_lo)
