"""Parameter-server protocol: where the parameters live (placement), the server
loop, and the worker's client. Takes a communicator and contiguous 1-D float32
arrays; knows nothing about models (the optimizer comes in as an object with
`step(params, grads, lr, grad_scale)`, `state()` and `t`).

    mpirun -n 3 python -m hpctrain.comm.ps      # self-check: 1 ps, 2 workers, sync

Placement. Each server holds a set of contiguous ranges of the ONE flat
parameter vector (`even`: equal slices; `round-robin` / `greedy`: whole
tensors), stored packed in one buffer with the optimizer state of exactly those
elements. Every optimizer is elementwise, so a packed slice updates bit for bit
as the whole buffer would. A worker's message to a server is the concatenation
of that server's ranges: a view of the flat buffer when it is one range (no
copy), a packed copy otherwise.

Wire. Every request and reply starts with one int64 header of HEADER fields
(buffer-form Send/Recv, nothing pickled), followed by raw float32 buffers:

    worker -> server  TAG_HEADER  [op, version, worker, flags, stop, t, nstate, loss, epoch, offset]
                      TAG_GRAD    gradient slice (OP_PUSH only)
    server -> worker  TAG_REPLY   header: op=OP_REPLY, version, flags, stop version, loss
                      TAG_PARAMS  parameter slice
    either way        TAG_BULK    snapshot/restore payloads, final statistics
    ps 0 -> ps k      TAG_ROUND   header + W member flags: who is in round `version` (sync)

`loss` is a float64 stored in the int64 field's bits; (epoch, offset) is the
pushing worker's data position after the batch of this gradient (the leader
keeps them for checkpoints). Ops:

    OP_PULL      reply with the parameters once version >= header version
    OP_PUSH      a gradient computed on `version`; reply with the parameters
                 after it is used or dropped (sync: once version > its version)
    OP_FINAL     the worker is done; reply (parameters + statistics) when all are;
                 with F_WANT_STATE also the optimizer state and data positions
    OP_SNAPSHOT  (chief) reply on TAG_BULK: header (version, t, nstate), the
                 parameter slice, each optimizer state array in order, and the
                 workers' data positions (int64 W x 2) that go with that version
    OP_RESTORE   (chief) header (version, t, nstate) then, on TAG_BULK, the
                 slice, nstate state arrays (0: reset the state) and the data
                 positions (W x 2); ack on TAG_BULK.
                 The chief's first RESTORE is how servers get initial parameters;
                 pulls are answered only after it.

Sync. One update per version from `replicas` distinct workers' gradients
computed on that version, summed in worker order (bit-reproducible), scaled by
1/replicas; a gradient for an older version is dropped and counted. ps 0 (the
leader) decides each round's members (the first `replicas` to arrive) and tells
the other servers, so every slice is updated from the same workers and no
server can wait for a gradient that will never come. Workers tag pushes with
the leader's version.

Async. Each gradient is applied on arrival with staleness = version - its
version recorded per server; `max_staleness` S: a push more than S behind is not
applied, and the reply brings fresh parameters (a re-pull). DC-ASGD
(`dc_lambda` L > 0): the server keeps, per worker, the parameters it last sent
that worker (w_bak) and applies g + L*g*g*(w - w_bak); replies are sent from
w_bak, which doubles as the send buffer.

Stopping. The leader owns the step budget: every reply carries its stop version
and F_STOP once reached. A stop request (F_STOP_REQUEST in any worker's header,
or a signal at the leader) lowers it to version+1, so every worker stops after
the same version; other servers that see a signal set F_STOP_REQUEST in their
replies and workers forward it. Servers return when every worker sent OP_FINAL.

Every blocking wait runs under the watchdog (`--timeout`), naming the peer.
"""
import numpy as np
from mpi4py import MPI

HEADER = 10
H_OP, H_VERSION, H_WORKER, H_FLAGS, H_STOP, H_T, H_NSTATE, H_LOSS, H_EPOCH, H_OFFSET = range(HEADER)

OP_PULL, OP_PUSH, OP_FINAL, OP_SNAPSHOT, OP_RESTORE, OP_REPLY, OP_ROUND = 1, 2, 3, 4, 5, 6, 7
OP_NAMES = {OP_PULL: "PULL", OP_PUSH: "PUSH", OP_FINAL: "FINAL", OP_SNAPSHOT: "SNAPSHOT",
            OP_RESTORE: "RESTORE", OP_REPLY: "REPLY", OP_ROUND: "ROUND"}

F_STOP_REQUEST = 1   # a stop signal was seen: please stop soon
F_STOP = 2           # reply: the leader's version reached its stop version: stop now
F_PREEMPTED = 4      # the stop came from a signal, not from the step budget
F_REJECTED = 8       # reply: your gradient was not applied (stale, too stale, or past the end)
F_WANT_STATE = 16    # OP_FINAL: also send the optimizer state and data positions (a checkpoint)

TAG_HEADER, TAG_GRAD, TAG_REPLY, TAG_PARAMS, TAG_BULK, TAG_ROUND = 101, 102, 103, 104, 105, 106

PLACEMENTS = ("even", "round-robin", "greedy")
HIST_BINS = 32       # staleness histogram: 0..30, and 31+ in the last bin
BLOCK = 32768        # elements per block in the DC-ASGD pass (cache-sized)

# Statistics a server sends with its final reply (float64); then W pushes,
# W dropped, HIST_BINS histogram counts.
S_VERSION, S_UPDATES, S_STALE, S_AFTER_STOP, S_ST_SUM, S_ST_COUNT, S_ST_MAX, S_ELEMENTS = range(8)
S_FIXED = 8


class ProtocolError(RuntimeError):
    """A message that the protocol does not allow: a bug, not bad input."""


def stats_length(num_workers):
    return S_FIXED + 2 * num_workers + HIST_BINS


# ---------------------------------------------------------------------------
# placement

def place(tensor_ranges, num_ps, strategy="even"):
    """Ranges of the flat vector held by each of num_ps servers: a list (one per
    server) of sorted, merged (lo, hi) pairs. tensor_ranges: (name, lo, hi) in
    buffer order, covering [0, n) without gaps."""
    if num_ps < 1:
        raise ValueError(f"need at least one server, got {num_ps}")
    owned = [[] for _ in range(num_ps)]
    n = tensor_ranges[-1][2] if tensor_ranges else 0
    if strategy == "even":
        for s in range(num_ps):
            owned[s].append((s * n // num_ps, (s + 1) * n // num_ps))
    elif strategy == "round-robin":
        # replica_device_setter: variables to ps tasks in creation order
        for i, (_, lo, hi) in enumerate(tensor_ranges):
            owned[i % num_ps].append((lo, hi))
    elif strategy == "greedy":
        # GreedyLoadBalancingStrategy: biggest first, to the least-loaded server
        load = [0] * num_ps
        order = sorted(range(len(tensor_ranges)), key=lambda i: (tensor_ranges[i][1] - tensor_ranges[i][2], i))
        for i in order:
            _, lo, hi = tensor_ranges[i]
            s = min(range(num_ps), key=lambda k: (load[k], k))
            owned[s].append((lo, hi))
            load[s] += hi - lo
    else:
        raise ValueError(f"unknown placement {strategy!r} (choose from {', '.join(PLACEMENTS)})")
    return [_merge(r) for r in owned]


def _merge(ranges):
    out = []
    for lo, hi in sorted(ranges):
        if hi <= lo:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def describe(placement, tensor_ranges):
    """Per server: (element count, ["layer0/W[0:1000]", "layer0/b", ...])."""
    out = []
    for ranges in placement:
        parts = []
        for lo, hi in ranges:
            for name, tlo, thi in tensor_ranges:
                a, b = max(lo, tlo), min(hi, thi)
                if a < b:
                    parts.append(name if (a, b) == (tlo, thi) else f"{name}[{a - tlo}:{b - tlo}]")
        out.append((sum(hi - lo for lo, hi in ranges), parts))
    return out


class Slice:
    """One server's ranges of a flat buffer, as one contiguous array: the view
    itself for a single range, else a packed copy (pack/unpack move the data)."""

    def __init__(self, flat, ranges):
        self.flat, self.ranges = flat, list(ranges)
        self.size = sum(hi - lo for lo, hi in self.ranges)
        if len(self.ranges) == 1:
            lo, hi = self.ranges[0]
            self.buf, self.packed = flat[lo:hi], False
        else:
            self.buf, self.packed = np.zeros(self.size, flat.dtype), True

    def pack(self):
        if self.packed:
            off = 0
            for lo, hi in self.ranges:
                self.buf[off: off + hi - lo] = self.flat[lo:hi]
                off += hi - lo

    def unpack(self):
        if self.packed:
            off = 0
            for lo, hi in self.ranges:
                self.flat[lo:hi] = self.buf[off: off + hi - lo]
                off += hi - lo


def dc_compensate(g, w, w_bak, lam, scratch):
    """DC-ASGD (Zheng et al. 2017), in place: g += lam * g * g * (w - w_bak),
    block by block through `scratch` so nothing is allocated."""
    n = g.size
    for lo in range(0, n, scratch.size):
        hi = min(lo + scratch.size, n)
        t, gb = scratch[: hi - lo], g[lo:hi]
        np.subtract(w[lo:hi], w_bak[lo:hi], out=t)
        t *= gb
        t *= gb
        t *= lam
        gb += t
    return g


def _loss_bits(header):
    return header.view(np.float64)


class _NullDog:
    class _Ctx:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    _ctx = _Ctx()

    def waiting(self, what, peer=None):
        return self._ctx


# ---------------------------------------------------------------------------
# server

class Server:
    """One parameter server: serve(comm) until every worker sent OP_FINAL.

    ranges: this server's (lo, hi) ranges; worker_ranks / server_ranks: ranks in
    `comm` (server_ranks[0] is the leader); optimizer sized to this server's
    element count; lr_fn(version) -> learning rate; steps: the step budget.
    """

    def __init__(self, comm, ranges, worker_ranks, server_ranks, optimizer, lr_fn, *, steps,
                 sync=True, replicas=None, max_staleness=None, dc_lambda=0.0, watchdog=None,
                 stop_requested=None, after_update=None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.workers = list(worker_ranks)
        self.servers = list(server_ranks)
        self.leader = self.rank == self.servers[0]
        self.ranges = list(ranges)
        self.n = n = sum(hi - lo for lo, hi in self.ranges)
        self.W = W = len(self.workers)
        self.opt, self.lr_fn = optimizer, lr_fn
        self.sync = sync
        self.replicas = replicas or W
        if not 1 <= self.replicas <= W:
            raise ValueError(f"replicas {self.replicas} must be in 1..{W}")
        self.max_staleness = max_staleness
        self.dc_lambda = float(dc_lambda) if not sync else 0.0
        self.dog = watchdog or _NullDog()
        self.stop_requested = stop_requested
        self.after_update = after_update
        self.steps = int(steps)

        self.params = np.zeros(n, np.float32)
        self.grads = np.zeros((W, n), np.float32)           # one landing buffer per worker
        self.acc = np.zeros(n, np.float32) if sync and self.replicas > 1 else None
        self.w_bak = np.zeros((W, n), np.float32) if self.dc_lambda > 0 else None
        self.scratch = np.empty(max(1, min(BLOCK, n)), np.float32)

        self.version = 0
        self.initialized = False
        self.stop_version = self.steps
        self.preempted = False
        self.stop_seen = False                    # a signal or request seen here (followers pass it on)
        self.final_version = 0                    # the leader version workers ended at (from OP_FINAL)
        self.last_loss = float("nan")
        # per worker
        self.tag = np.full(W, -1, np.int64)       # sync: version of the gradient held in grads[w]
        self.loss = np.zeros(W, np.float64)
        self.want = np.full(W, -1, np.int64)      # pending reply: minimum version, -1 none
        self.rejected = np.zeros(W, bool)
        self.done = np.zeros(W, bool)
        self.want_state = np.zeros(W, bool)     # OP_FINAL asked for the optimizer state
        # data positions for checkpoints: per worker, its last two pushes'
        # (version, epoch, offset), newest first; epoch -1: none
        self.positions = np.full((W, 2, 3), -1, np.int64)
        self.grad_posted = np.zeros(W, bool)
        self.sending = np.zeros(W, bool)
        # statistics
        self.updates = self.stale_dropped = self.after_stop = 0
        self.st_sum = self.st_count = self.st_max = 0
        self.pushes = np.zeros(W, np.int64)
        self.dropped = np.zeros(W, np.int64)
        self.hist = np.zeros(HIST_BINS, np.int64)

        self.hdr_in = np.zeros((W, HEADER), np.int64)
        self.hdr_out = np.zeros((W, HEADER), np.int64)
        self.bulk_hdr = np.zeros(HEADER, np.int64)
        self.req_hdr = [comm.Recv_init(self.hdr_in[w], r, TAG_HEADER) for w, r in enumerate(self.workers)]
        self.req_grad = [comm.Recv_init(self.grads[w], r, TAG_GRAD) for w, r in enumerate(self.workers)]
        self.send_hdr = [comm.Send_init(self.hdr_out[w], r, TAG_REPLY) for w, r in enumerate(self.workers)]
        self.send_params = [comm.Send_init(self.w_bak[w] if self.w_bak is not None else self.params, r, TAG_PARAMS)
                            for w, r in enumerate(self.workers)]
        # sync rounds across servers: the leader sends, the others receive
        self.coordinated = sync and len(self.servers) > 1
        self.round_buf = np.zeros(HEADER + W, np.int64)
        self.req_round = None
        self.send_round = []
        self.have_decision = False
        if self.coordinated:
            if self.leader:
                self.send_round = [comm.Send_init(self.round_buf, s, TAG_ROUND) for s in self.servers[1:]]
            else:
                self.req_round = comm.Recv_init(self.round_buf, self.servers[0], TAG_ROUND)
        self._round_sending = False

    # --- main loop ----------------------------------------------------------
    def serve(self):
        """Serve until every worker is done; returns the statistics array."""
        waits = list(self.req_hdr) + ([self.req_round] if self.req_round is not None else [])
        MPI.Prequest.Startall(self.req_hdr)
        MPI.Prequest.Startall(self.req_grad)
        self.grad_posted[:] = True
        if self.req_round is not None:
            self.req_round.Start()
        while not (self.done.all() and self._caught_up()):
            with self.dog.waiting("requests from workers", peer=self._awaited):
                ready = MPI.Request.Waitsome(waits)
            if ready is None:
                raise ProtocolError(f"ps rank {self.rank}: nothing left to wait for at version {self.version}")
            for i in sorted(ready):
                if i == self.W:
                    self._on_round()
                else:
                    self._on_header(i)
            self._check_signal()
        return self._finish()

    def _caught_up(self):
        # A follower must apply every round the leader decided before it is done.
        return not self.coordinated or self.leader or self.version >= self.final_version

    def _awaited(self):
        if not self.initialized:
            return [self.workers[0]]
        out = [r for w, r in enumerate(self.workers) if not self.done[w] and self.tag[w] < self.version]
        if self.coordinated and not self.leader and not self.have_decision:
            out.insert(0, self.servers[0])
        return out or "its peers"

    def _check_signal(self):
        if self.stop_requested is not None and not self.stop_seen and self.stop_requested():
            self._stop_request()

    def _stop_request(self):
        self.stop_seen = True
        # Stop after the version in progress; a request during the last one changes nothing.
        if self.leader and self.version + 1 < self.stop_version:
            self.stop_version = self.version + 1
            self.preempted = True

    # --- messages -----------------------------------------------------------
    def _on_header(self, w):
        h = self.hdr_in[w]
        op = int(h[H_OP])
        if h[H_FLAGS] & F_STOP_REQUEST:
            self._stop_request()
        if op == OP_PUSH:
            with self.dog.waiting("gradient", peer=self.workers[w]):
                self.req_grad[w].Wait()
            self.grad_posted[w] = False
            version, loss = int(h[H_VERSION]), float(_loss_bits(h)[H_LOSS])
            rec = self.positions[w]
            rec[1] = rec[0]
            rec[0] = version, h[H_EPOCH], h[H_OFFSET]
            self.req_hdr[w].Start()
            self._on_push(w, version, loss)
        elif op == OP_PULL:
            self.want[w] = int(h[H_VERSION])
            self.req_hdr[w].Start()
            self._reply(w)
        elif op == OP_FINAL:
            self.done[w] = True
            self.final_version = max(self.final_version, int(h[H_VERSION]))
            self.want_state[w] = bool(h[H_FLAGS] & F_WANT_STATE)
            if h[H_FLAGS] & F_PREEMPTED:
                self.preempted = True
            if self.grad_posted[w]:
                self.req_grad[w].Cancel()
                self.req_grad[w].Wait()
                self.grad_posted[w] = False
        elif op == OP_SNAPSHOT:
            self._snapshot(w)
            self.req_hdr[w].Start()
        elif op == OP_RESTORE:
            self._restore(w, h)
            self.req_hdr[w].Start()
        else:
            raise ProtocolError(f"ps rank {self.rank}: unknown op {op} from rank {self.workers[w]}")

    def _repost(self, w):
        if not self.grad_posted[w] and not self.done[w]:
            self.req_grad[w].Start()
            self.grad_posted[w] = True

    def _drop(self, w, stale=True):
        if stale:
            self.stale_dropped += 1
            self.dropped[w] += 1
        else:
            self.after_stop += 1
        self.rejected[w] = True
        self._repost(w)

    def _on_push(self, w, version, loss):
        if not self.initialized:
            raise ProtocolError(f"ps rank {self.rank}: push from rank {self.workers[w]} before initialization")
        self.pushes[w] += 1
        if self.sync:
            self.want[w] = version + 1
            if version < self.version:
                self._drop(w)
            elif self.version >= self.stop_version:
                self._drop(w, stale=False)
            elif version > self.version and self.leader:
                raise ProtocolError(f"ps rank {self.rank}: gradient for version {version} from rank "
                                    f"{self.workers[w]}, ahead of version {self.version}")
            else:
                if self.tag[w] >= 0:
                    raise ProtocolError(f"ps rank {self.rank}: second gradient from rank {self.workers[w]}")
                self.tag[w] = version
                self.loss[w] = loss
                self._try_close()
            self._reply(w)
            return
        # async
        self.want[w] = 0
        staleness = self.version - version
        if self.version >= self.stop_version:
            self._drop(w, stale=False)
        elif self.max_staleness is not None and staleness > self.max_staleness:
            self._drop(w)
        else:
            self.st_sum += staleness
            self.st_count += 1
            self.st_max = max(self.st_max, staleness)
            self.hist[min(max(staleness, 0), HIST_BINS - 1)] += 1
            g = self.grads[w]
            if self.w_bak is None:
                self._quiesce()          # params are the send buffer of earlier replies
            else:
                dc_compensate(g, self.params, self.w_bak[w], self.dc_lambda, self.scratch)
            self.opt.step(self.params, g, self.lr_fn(self.version), 1.0)
            self.version += 1
            self.updates += 1
            self.last_loss = loss
            self._repost(w)
            self._updated()
        self._reply(w)

    # --- sync rounds --------------------------------------------------------
    def _try_close(self):
        if not self.coordinated or self.leader:
            arrived = np.flatnonzero(self.tag == self.version)
            if len(arrived) < self.replicas or self.version >= self.stop_version:
                return
            members = arrived
            if self.coordinated:
                self._announce(members)
        else:
            if not self.have_decision:
                return
            members = np.flatnonzero(self.round_buf[HEADER:])
            if not np.all(self.tag[members] == self.version):
                return
        self._apply_round(members)

    def _announce(self, members):
        if self._round_sending:
            with self.dog.waiting("round decision to servers", peer=self.servers[1:]):
                MPI.Request.Waitall(self.send_round)
        b = self.round_buf
        b[:] = 0
        b[H_OP], b[H_VERSION], b[H_STOP] = OP_ROUND, self.version, self.stop_version
        b[H_FLAGS] = F_PREEMPTED if self.preempted else 0
        b[HEADER + members] = 1
        MPI.Prequest.Startall(self.send_round)
        self._round_sending = True

    def _on_round(self):
        b = self.round_buf
        if int(b[H_OP]) != OP_ROUND or int(b[H_VERSION]) != self.version:
            raise ProtocolError(f"ps rank {self.rank}: round decision for version {int(b[H_VERSION])} "
                                f"at version {self.version}")
        self.have_decision = True
        self.stop_version = int(b[H_STOP])
        if b[H_FLAGS] & F_PREEMPTED:
            self.preempted = True
        self._try_close()

    def _apply_round(self, members):
        self._quiesce()
        first = members[0]
        if len(members) == 1:
            g = self.grads[first]
        else:
            g = self.acc
            np.add(self.grads[first], self.grads[members[1]], out=g)
            for m in members[2:]:
                g += self.grads[m]          # worker order, whatever the arrival order
        self.opt.step(self.params, g, self.lr_fn(self.version), 1.0 / len(members))
        self.last_loss = float(sum(self.loss[m] for m in members) / len(members))
        self.st_count += len(members)
        self.hist[0] += len(members)
        round_version = self.version
        self.version += 1
        self.updates += 1
        is_member = np.zeros(self.W, bool)
        is_member[members] = True
        for w in np.flatnonzero(self.tag == round_version):
            if not is_member[w]:
                self.stale_dropped += 1      # in the round's version, but not among its first arrivals
                self.dropped[w] += 1
                self.rejected[w] = True
            self.tag[w] = -1
            self._repost(w)
        if self.req_round is not None:
            self.have_decision = False
            self.req_round.Start()
        self._updated()
        for w in range(self.W):
            self._reply(w)

    def _updated(self):
        if self.after_update is not None:
            self.after_update(self.version)

    # --- replies ------------------------------------------------------------
    def _quiesce(self):
        """Wait for outgoing parameter messages: their buffer is about to change."""
        busy = np.flatnonzero(self.sending)
        if len(busy) == 0:
            return
        with self.dog.waiting("parameter replies", peer=[self.workers[w] for w in busy]):
            for w in busy:
                self.send_hdr[w].Wait()
                self.send_params[w].Wait()
        self.sending[:] = False

    def _flags(self, w=None):
        f = 0
        if self.version >= self.stop_version:
            f |= F_STOP
        if self.preempted:
            f |= F_PREEMPTED
        if self.stop_seen and not self.leader:
            f |= F_STOP_REQUEST
        if w is not None and self.rejected[w]:
            f |= F_REJECTED
        return f

    def _fill_reply(self, h, w=None):
        h[:] = 0
        h[H_OP], h[H_VERSION], h[H_WORKER] = OP_REPLY, self.version, -1
        h[H_FLAGS], h[H_STOP], h[H_T] = self._flags(w), self.stop_version, self.opt.t
        _loss_bits(h)[H_LOSS] = self.last_loss

    def _reply(self, w):
        want = self.want[w]
        if want < 0 or not self.initialized or self.done[w]:
            return
        if self.version < want and self.version < self.stop_version:
            return
        self.want[w] = -1
        if self.sending[w]:
            with self.dog.waiting("parameter reply", peer=self.workers[w]):
                self.send_hdr[w].Wait()
                self.send_params[w].Wait()
        self._fill_reply(self.hdr_out[w], w)
        self.rejected[w] = False
        if self.w_bak is not None:
            self.w_bak[w][...] = self.params   # what this worker will compute on
        self.send_hdr[w].Start()
        self.send_params[w].Start()
        self.sending[w] = True

    # --- checkpoint support -------------------------------------------------
    def positions_at(self, version):
        """(W, 2) int64: each worker's data position that goes with parameters
        of `version`: after the batch of its newest push computed on an older
        version (sync: the push of round version-1, even if the worker already
        pushed for `version`). (-1, -1) where there is none."""
        out = np.full((self.W, 2), -1, np.int64)
        for w in range(self.W):
            for tag, epoch, offset in self.positions[w]:
                if epoch >= 0 and tag < version:
                    out[w] = epoch, offset
                    break
        return out

    def _snapshot(self, w):
        rank = self.workers[w]
        states = self.opt.state()
        h = self.bulk_hdr
        self._fill_reply(h)
        h[H_NSTATE] = len(states)
        with self.dog.waiting("snapshot to the chief", peer=rank):
            self.comm.Send(h, rank, TAG_BULK)
            self.comm.Send(self.params, rank, TAG_BULK)
            for array in states.values():
                self.comm.Send(array, rank, TAG_BULK)
            self.comm.Send(self.positions_at(self.version), rank, TAG_BULK)

    def _restore(self, w, h):
        rank = self.workers[w]
        states = self.opt.state()
        nstate = int(h[H_NSTATE])
        if nstate not in (0, len(states)):
            raise ProtocolError(f"ps rank {self.rank}: restore with {nstate} state arrays, "
                                f"the optimizer has {len(states)}")
        self._quiesce()
        with self.dog.waiting("restore from the chief", peer=rank):
            self.comm.Recv(self.params, rank, TAG_BULK)
            for array in states.values():
                if nstate:
                    self.comm.Recv(array, rank, TAG_BULK)
                else:
                    array[...] = 0
            positions = np.empty((self.W, 2), np.int64)
            self.comm.Recv(positions, rank, TAG_BULK)
        self.opt.t = int(h[H_T])
        self.version = int(h[H_VERSION])
        self.positions[...] = -1
        self.positions[:, 0, 0] = self.version - 1
        self.positions[:, 0, 1:] = positions
        if self.w_bak is not None:
            self.w_bak[...] = self.params
        for v in np.flatnonzero(self.tag >= 0):   # gradients of the old state mean nothing now
            self.tag[v] = -1
            self._repost(v)
        self.initialized = True
        ack = self.bulk_hdr
        self._fill_reply(ack)
        with self.dog.waiting("restore acknowledgement", peer=rank):
            self.comm.Send(ack, rank, TAG_BULK)
        for v in range(self.W):
            self._reply(v)

    # --- the end ------------------------------------------------------------
    def stats(self):
        s = np.zeros(stats_length(self.W), np.float64)
        s[S_VERSION], s[S_UPDATES], s[S_STALE], s[S_AFTER_STOP] = (self.version, self.updates,
                                                                  self.stale_dropped, self.after_stop)
        s[S_ST_SUM], s[S_ST_COUNT], s[S_ST_MAX], s[S_ELEMENTS] = self.st_sum, self.st_count, self.st_max, self.n
        W = self.W
        s[S_FIXED: S_FIXED + W] = self.pushes
        s[S_FIXED + W: S_FIXED + 2 * W] = self.dropped
        s[S_FIXED + 2 * W:] = self.hist
        return s

    def _finish(self):
        self._quiesce()
        if self._round_sending:
            with self.dog.waiting("round decision to servers", peer=self.servers[1:]):
                MPI.Request.Waitall(self.send_round)
        stats = self.stats()
        states = list(self.opt.state().values())
        positions = self.positions_at(self.version)
        reqs = []
        for w, r in enumerate(self.workers):
            self._fill_reply(self.hdr_out[w], w)
            reqs += [self.comm.Isend(self.hdr_out[w], r, TAG_REPLY), self.comm.Isend(self.params, r, TAG_PARAMS),
                     self.comm.Isend(stats, r, TAG_BULK)]
            if self.want_state[w]:
                reqs += [self.comm.Isend(a, r, TAG_BULK) for a in states] + [self.comm.Isend(positions, r, TAG_BULK)]
        with self.dog.waiting("final replies", peer=self.workers):
            MPI.Request.Waitall(reqs)
        if self.req_round is not None:
            self.req_round.Cancel()
            self.req_round.Wait()
        for req in self.req_hdr + self.req_grad + self.send_hdr + self.send_params + self.send_round:
            req.Free()
        if self.req_round is not None:
            self.req_round.Free()
        return stats


# ---------------------------------------------------------------------------
# worker

class Client:
    """A worker's side: pull parameters into `params`, push `grads` (both the
    flat buffers of the model), all servers at once."""

    def __init__(self, comm, server_ranks, placement, params, grads, worker, num_workers, *,
                 sync=True, watchdog=None):
        self.comm = comm
        self.servers = list(server_ranks)
        self.P = len(self.servers)
        self.worker, self.W = worker, num_workers
        self.sync = sync
        self.dog = watchdog or _NullDog()
        self.placement = [list(r) for r in placement]
        self.params, self.grads = params, grads
        self.p_slices = [Slice(params, r) for r in self.placement]
        self.g_slices = [Slice(grads, r) for r in self.placement]
        self.hdr_out = np.zeros((self.P, HEADER), np.int64)
        self.hdr_in = np.zeros((self.P, HEADER), np.int64)
        self.stats = np.zeros((self.P, stats_length(num_workers)), np.float64)
        s = self.servers
        self.send_hdr = [comm.Send_init(self.hdr_out[k], s[k], TAG_HEADER) for k in range(self.P)]
        self.send_grad = [comm.Send_init(self.g_slices[k].buf, s[k], TAG_GRAD) for k in range(self.P)]
        self.recv_hdr = [comm.Recv_init(self.hdr_in[k], s[k], TAG_REPLY) for k in range(self.P)]
        self.recv_params = [comm.Recv_init(self.p_slices[k].buf, s[k], TAG_PARAMS) for k in range(self.P)]
        self.replies = [[self.recv_hdr[k], self.recv_params[k]] for k in range(self.P)]
        self.recvs = self.recv_hdr + self.recv_params
        self.pushes = self.send_hdr + self.send_grad
        self.versions = np.zeros(self.P, np.int64)
        self.version = 0            # the leader's
        self.stop = False
        self.preempted = False
        self.stop_seen = False      # some server saw a stop signal: ask the leader to stop
        self.loss = float("nan")    # leader: mean loss of the last round (sync) / last gradient (async)
        self.rejected = 0           # pushes the leader did not apply

    def _exchange(self, op, flags, loss=0.0, grads=False, what="parameters", position=(0, 0)):
        MPI.Prequest.Startall(self.recvs)
        for k in range(self.P):
            h = self.hdr_out[k]
            h[H_OP], h[H_WORKER], h[H_FLAGS] = op, self.worker, flags
            h[H_EPOCH], h[H_OFFSET] = position
            # sync: one version for all servers (the leader's), so rounds line up
            h[H_VERSION] = self.version if (self.sync or op != OP_PUSH) else self.versions[k]
            _loss_bits(h)[H_LOSS] = loss
        if grads:
            for sl in self.g_slices:
                sl.pack()
            MPI.Prequest.Startall(self.pushes)
        else:
            MPI.Prequest.Startall(self.send_hdr)
        for k in range(self.P):
            with self.dog.waiting(what, peer=self.servers[k]):
                MPI.Request.Waitall(self.replies[k])
        with self.dog.waiting("sending to the servers", peer=self.servers):
            MPI.Request.Waitall(self.pushes if grads else self.send_hdr)
        for k in range(self.P):
            self.p_slices[k].unpack()
            h = self.hdr_in[k]
            self.versions[k] = h[H_VERSION]
            if h[H_FLAGS] & F_STOP_REQUEST:
                self.stop_seen = True
        lead = self.hdr_in[0]
        self.version = int(lead[H_VERSION])
        self.stop = bool(lead[H_FLAGS] & F_STOP)
        self.preempted = bool(lead[H_FLAGS] & F_PREEMPTED)
        self.loss = float(_loss_bits(lead)[H_LOSS])
        if lead[H_FLAGS] & F_REJECTED:
            self.rejected += 1

    def pull(self, min_version=0):
        """Parameters of version >= min_version (the first pull waits for the chief's restore)."""
        self.version = min_version
        self._exchange(OP_PULL, 0, what="pull parameters")

    def push_pull(self, loss, stop_request=False, position=(0, 0)):
        """Push the gradient (computed on the last pulled version) with the data
        position after its batch; receive new parameters."""
        flags = F_STOP_REQUEST if (stop_request or self.stop_seen) else 0
        self._exchange(OP_PUSH, flags, loss, grads=True, what="push gradients, pull parameters",
                       position=position)

    def final(self, state_names=None):
        """Say done; once every worker is, receive the final parameters and each
        server's statistics (rows of self.stats, returned). With state_names
        (the optimizer's, in order), also the final optimizer state and data
        positions: self.final_state = (t, {name: full flat array}, positions)."""
        reqs = [self.comm.Irecv(self.stats[k], self.servers[k], TAG_BULK) for k in range(self.P)]
        flags = (F_PREEMPTED if self.preempted else 0) | (F_WANT_STATE if state_names is not None else 0)
        self._exchange(OP_FINAL, flags, what="final parameters")
        with self.dog.waiting("final statistics", peer=self.servers):
            MPI.Request.Waitall(reqs)
        if state_names is not None:
            states, positions = self._receive_state(state_names, "final state")
            self.final_state = (int(self.hdr_in[0][H_T]), states, positions)
        for req in self.pushes + self.recvs:
            req.Free()
        return self.stats

    def _receive_state(self, state_names, what):
        """Each server's optimizer state slices and data positions (TAG_BULK),
        assembled into full flat arrays; the positions are the leader's."""
        n = self.params.size
        states = {name: np.zeros(n, np.float32) for name in state_names}
        positions = np.zeros((self.W, 2), np.int64)
        scratch = np.zeros((self.W, 2), np.int64)
        for k, rank in enumerate(self.servers):
            with self.dog.waiting(what, peer=rank):
                for flat in states.values():
                    sl = Slice(flat, self.placement[k])
                    self.comm.Recv(sl.buf, rank, TAG_BULK)
                    sl.unpack()
                self.comm.Recv(positions if k == 0 else scratch, rank, TAG_BULK)
        return states, positions

    # --- checkpoint support (chief) ----------------------------------------
    def restore(self, version, t, params, states=None, positions=None):
        """Load every server: its slice of `params` (full flat array) and, when
        `states` (name -> full flat array, in the optimizer's state order) is
        given, of each optimizer state; version, optimizer step t, and the
        workers' data positions (W x 2, default zeros) that go with them."""
        states = states or {}
        positions = np.zeros((self.W, 2), np.int64) if positions is None else \
            np.ascontiguousarray(positions, np.int64).reshape(self.W, 2)
        for k, rank in enumerate(self.servers):
            h = self.hdr_out[k]
            h[:] = 0
            h[H_OP], h[H_VERSION], h[H_WORKER], h[H_T], h[H_NSTATE] = OP_RESTORE, version, self.worker, t, len(states)
            with self.dog.waiting("restore servers", peer=rank):
                self.comm.Send(h, rank, TAG_HEADER)
                for flat in [params, *states.values()]:
                    sl = Slice(np.ascontiguousarray(flat, np.float32), self.placement[k])
                    sl.pack()
                    self.comm.Send(sl.buf, rank, TAG_BULK)
                self.comm.Send(positions, rank, TAG_BULK)
                self.comm.Recv(self.hdr_in[k], rank, TAG_BULK)
            self.versions[k] = self.hdr_in[k][H_VERSION]
        self.version = int(version)

    def snapshot(self, state_names):
        """(versions per server, optimizer t, params, {name: state}, positions)
        from every server, as full flat arrays, and the leader's data
        positions (W x 2) that go with its version: a checkpoint."""
        n = self.params.size
        params = np.zeros(n, np.float32)
        states = {name: np.zeros(n, np.float32) for name in state_names}
        positions = np.zeros((self.W, 2), np.int64)
        scratch = np.zeros((self.W, 2), np.int64)
        versions, t = [], None
        for k, rank in enumerate(self.servers):
            h = self.hdr_out[k]
            h[:] = 0
            h[H_OP], h[H_WORKER] = OP_SNAPSHOT, self.worker
            with self.dog.waiting("snapshot", peer=rank):
                self.comm.Send(h, rank, TAG_HEADER)
                reply = self.hdr_in[k]
                self.comm.Recv(reply, rank, TAG_BULK)
                if int(reply[H_NSTATE]) != len(state_names):
                    raise ProtocolError(f"ps rank {rank} sent {int(reply[H_NSTATE])} state arrays, "
                                        f"expected {len(state_names)}")
                for flat in [params, *states.values()]:
                    sl = Slice(flat, self.placement[k])
                    self.comm.Recv(sl.buf, rank, TAG_BULK)
                    sl.unpack()
                self.comm.Recv(positions if k == 0 else scratch, rank, TAG_BULK)
            versions.append(int(reply[H_VERSION]))
            t = int(reply[H_T]) if t is None else t
        return versions, t, params, states, positions


def summarize(stats, num_workers):
    """Final statistics of all servers (rows from Client.final) as a dict: the
    leader's counts (each gradient counted once, as its worker sees it) plus
    per-server lists."""
    W = num_workers
    lead = stats[0]
    hist = lead[S_FIXED + 2 * W:].astype(np.int64).tolist()
    while len(hist) > 1 and hist[-1] == 0:
        hist.pop()
    count = lead[S_ST_COUNT]
    return {
        "updates": int(lead[S_UPDATES]),
        "stale_dropped": int(lead[S_STALE]),
        "after_stop_dropped": int(lead[S_AFTER_STOP]),
        "staleness_mean": round(float(lead[S_ST_SUM] / count), 4) if count else 0.0,
        "staleness_max": int(lead[S_ST_MAX]),
        "staleness_histogram": hist,
        "pushes_by_worker": lead[S_FIXED: S_FIXED + W].astype(np.int64).tolist(),
        "dropped_by_worker": lead[S_FIXED + W: S_FIXED + 2 * W].astype(np.int64).tolist(),
        "ps_versions": stats[:, S_VERSION].astype(np.int64).tolist(),
        "ps_updates": stats[:, S_UPDATES].astype(np.int64).tolist(),
        "ps_stale_dropped": stats[:, S_STALE].astype(np.int64).tolist(),
        "ps_elements": stats[:, S_ELEMENTS].astype(np.int64).tolist(),
    }


if __name__ == "__main__":
    # Sync self-check: every worker pushes full(n, w+1) each round with SGD lr 1;
    # after R rounds params = -R * mean(1..W), on every element of every server.
    class SGD:  # the protocol takes any optimizer object; no hpctrain.optim import here
        t = 0

        def __init__(self, size):
            pass

        def state(self):
            return {}

        def step(self, params, grads, lr, grad_scale=1.0):
            self.t += 1
            params -= grads * np.float32(lr * grad_scale)

    world = MPI.COMM_WORLD
    num_ps = 1 if world.size < 4 else 2
    assert world.size > num_ps, "run with at least 2 ranks"
    servers, workers = list(range(num_ps)), list(range(num_ps, world.size))
    n, rounds = 1003, 5
    ranges = [("a", 0, 600), ("b", 600, n)]
    layout = place(ranges, num_ps, "even")
    if world.rank < num_ps:
        mine = layout[world.rank]
        size = sum(hi - lo for lo, hi in mine)
        Server(world, mine, workers, servers, SGD(size), lambda v: 1.0, steps=rounds).serve()
    else:
        w = world.rank - num_ps
        p, g = np.zeros(n, np.float32), np.zeros(n, np.float32)
        client = Client(world, servers, layout, p, g, w, len(workers))
        if w == 0:
            client.restore(0, 0, p)
        client.pull()
        while not client.stop:
            g[:] = w + 1
            client.push_pull(0.0)
        client.final()
        expect = -rounds * (len(workers) + 1) / 2
        assert client.version == rounds and np.allclose(p, expect), (client.version, p[:3], expect)
        if w == 0:
            print(f"ps protocol OK: {num_ps} ps, {len(workers)} workers, {rounds} sync rounds")
