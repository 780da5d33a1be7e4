"""One parameter server: the request loop and what answers each request.
Aggregation (sync rounds or async updates) lives in aggregate.py, the
checkpoint side (snapshot, restore, data positions) in snapshot.py.

    mpirun -n 3 python -m hpctrain.comm.ps      # self-check: 1 ps, 2 workers, sync

The server pre-posts one receive per worker for headers and for gradients
(persistent requests) and serves everyone through Waitsome, handling the
completed requests in worker order, so no worker can starve another.

Stopping. The leader (server_ranks[0]) owns the step budget: every reply
carries its stop version and F_STOP once reached. A stop request
(F_STOP_REQUEST in any worker's header, or a signal at the leader) lowers it
to version+1, so every worker stops after the same version; other servers
that see a signal set F_STOP_REQUEST in their replies and workers forward it.
The server returns when every worker sent OP_FINAL.

Every blocking wait runs under the watchdog (`--timeout`), naming the peer.
"""
import time

import numpy as np
from mpi4py import MPI

from ..deadline import NO_WATCHDOG
from .aggregate import AsyncApply, SyncRounds
from .placement import Slice, slice_size
from .protocol import (F_OWN_BUFFER, F_PREEMPTED, F_REJECTED, F_STOP, F_STOP_REQUEST, F_WANT_STATE, H_EPOCH,
                       H_FLAGS, H_LOSS, H_NORM, H_OFFSET, H_OP, H_STOP, H_T, H_VERSION, H_WORKER, HEADER, OP_FINAL,
                       OP_PULL, OP_PUSH, OP_RELEASE, OP_REPLY, OP_RESTORE, OP_SNAPSHOT, TAG_BULK, TAG_GRAD, TAG_HEADER,
                       TAG_PARAMS, TAG_REPLY, ProtocolError, loss_field)
from .silence import SilenceWatch
from .snapshot import CutHold, DataPositions, receive_restore
from .stats import ServerStats
from .waits import Waits


def reply_buffers_needed(sync, replicas, num_workers):
    """Each worker's reply from a buffer of its own (async, backup workers),
    rather than from the server's params."""
    return not sync or (replicas or num_workers) < num_workers


class Server:
    """One parameter server: serve_until_done() until every worker sent OP_FINAL.

    ranges: this server's (lo, hi) ranges; worker_ranks / server_ranks: ranks in
    `comm` (server_ranks[0] is the leader); optimizer sized to this server's
    element count; lr_fn(version) -> learning rate; steps: the step budget;
    nap: wait for requests without busy-polling (more ranks than cores: waits.py).
    clip (sync, --clip-norm): a clipping.Clip for each round's aggregate;
    servers_comm: the servers' own communicator, over which the slices'
    sums of squares meet (needed with clip and more than one server).
    shared: the node's SharedExchange (shared.py) or None: this server's
    params and reply buffers are its part of the window, and a worker in
    the window pushes and pulls with a header only.
    """

    def __init__(self, comm, ranges, worker_ranks, server_ranks, optimizer, lr_fn, *, steps,
                 sync=True, replicas=None, max_staleness=None, dc_lambda=0.0, watchdog=NO_WATCHDOG,
                 stop_requested=None, nap=False, clip=None, servers_comm=None, shared=None):
        self.comm, self.rank = comm, comm.Get_rank()
        self.clip, self.servers_comm = clip, servers_comm
        self.workers, self.servers = list(worker_ranks), list(server_ranks)
        self.leader = self.rank == self.servers[0]
        self.ranges = list(ranges)
        self.size = slice_size(self.ranges)
        self.num_workers = len(self.workers)
        self.opt, self.lr_fn = optimizer, lr_fn
        self.watchdog = watchdog
        self.waits = Waits(nap)
        self.stop_requested = stop_requested
        # Replies go out from params when every round needs every worker (sync
        # without backups: no copy). Otherwise each worker's reply has a buffer
        # of its own, so an update never waits for a reply that a stopped or
        # slow worker is not receiving: the others go on.
        own_replies = reply_buffers_needed(sync, replicas, self.num_workers)
        self.shared = shared
        if shared is not None:
            self.params = shared.server_params(self.rank, self.size)
            self.params[...] = 0
            self.reply_bufs = shared.server_reply_bufs(self.rank, self.size, self.num_workers) if own_replies else None
        else:
            self.params = np.zeros(self.size, np.float32)
            self.reply_bufs = np.zeros((self.num_workers, self.size), np.float32) if own_replies else None
        # Where each worker's gradient slice lands: a buffer of ours that MPI
        # receives into, or (a worker in the shared window) the worker's own
        # buffer, read in place (a view for one range, packed for several).
        self.in_window = np.array([shared is not None and shared.on_node(r) for r in self.workers], bool)
        self.grad_views = [Slice(shared.part(r), self.ranges) if self.in_window[w]
                           else None for w, r in enumerate(self.workers)]
        self.grads = [view.buf if view is not None else np.zeros(self.size, np.float32) for view in self.grad_views]
        self._init_state(int(steps))
        if sync:
            replicas = replicas or self.num_workers
            if not 1 <= replicas <= self.num_workers:
                raise ValueError(f"replicas {replicas} must be in 1..{self.num_workers}")
            self.aggregation = SyncRounds(self, replicas)
        else:
            self.aggregation = AsyncApply(self, max_staleness, dc_lambda)
        self._init_requests()

    def _init_state(self, steps):
        workers = self.num_workers
        self.version = 0
        self.initialized = False
        self.stop_version = steps
        self.preempted = False
        self.stop_seen = False                  # a signal or request seen here (followers pass it on)
        self.final_version = 0                  # the leader version workers ended at (from OP_FINAL)
        self.last_loss = float("nan")
        self.last_norm = float("nan")           # the last round's pre-clip norm (--clip-norm)
        self.want = np.full(workers, -1, np.int64)      # pending reply: minimum version, -1 none
        self.rejected = np.zeros(workers, bool)
        self.done = np.zeros(workers, bool)
        self.want_state = np.zeros(workers, bool)       # OP_FINAL asked for the optimizer state
        self.grad_posted = np.zeros(workers, bool)     # a gradient receive is active
        self.grad_arrived = np.zeros(workers, bool)    # ... and completed, its header not yet here
        self.push_pending = [None] * workers           # a push header whose gradient is still coming
        self.left_behind = np.zeros(workers, bool)      # silent past the deadline after the run
        self.sending = np.zeros(workers, bool)
        self.positions = DataPositions(workers)
        self.stats = ServerStats(workers)
        self.cut = CutHold(self)                # a checkpoint cut being taken
        self.heard = lambda w: None             # serve_until_done: the leader's SilenceWatch

    def _init_requests(self):
        comm, workers = self.comm, self.workers
        self.hdr_in = np.zeros((self.num_workers, HEADER), np.int64)
        self.hdr_out = np.zeros((self.num_workers, HEADER), np.int64)
        self.bulk_hdr = np.zeros(HEADER, np.int64)
        self.req_hdr = [comm.Recv_init(self.hdr_in[w], r, TAG_HEADER) for w, r in enumerate(workers)]
        self.req_grad = [comm.Recv_init(self.grads[w], r, TAG_GRAD) for w, r in enumerate(workers)]
        self.send_hdr = [comm.Send_init(self.hdr_out[w], r, TAG_REPLY) for w, r in enumerate(workers)]
        self.send_params = [comm.Send_init(self.params if self.reply_bufs is None else self.reply_bufs[w], r,
                                           TAG_PARAMS) for w, r in enumerate(workers)]
        # What a reply to each worker sends: the header, and the parameters unless they are in the window.
        self.reply_reqs = [[self.send_hdr[w]] + ([] if self.in_window[w] else [self.send_params[w]])
                           for w in range(self.num_workers)]

    def waiting(self, what, peer=None):
        return self.watchdog.waiting(what, peer=peer)

    # --- main loop ----------------------------------------------------------
    def serve_until_done(self):
        """Serve until every worker is done; returns the statistics array."""
        MPI.Prequest.Startall(self.req_hdr)
        for w in range(self.num_workers):
            self.repost(w)
        self.aggregation.start()
        # Workers gone silent: ps 0 names them; at the deadline they are left
        # behind if the run is over, else ps 0 ends the job.
        silence = self.silence = SilenceWatch(self, self.watchdog) if self.watchdog.timeout is not None else None
        self.heard = silence.heard if silence else lambda w: None
        # Headers, gradients, (sync followers) round decisions and the silence
        # watch, all at once: a worker stopped halfway through sending holds up nobody.
        others = [(req, self.aggregation.on_message) for req in self.aggregation.requests()]
        if silence:
            others.append((silence.request, self._leave_behind))
        waits = list(self.req_hdr) + list(self.req_grad) + [req for req, _ in others]
        times, clock = self.stats.times, time.perf_counter
        t_start = clock()
        while not (self.done.all() and self.aggregation.caught_up()):
            with self.waiting("requests from workers", peer=self._awaited):
                if silence:
                    silence.idle = True
                t0 = clock()
                ready = self.waits.some(waits)
                times["idle"] += clock() - t0
                if silence:
                    silence.idle = False
            if ready is None:
                raise ProtocolError(f"ps rank {self.rank}: nothing left to wait for at version {self.version}")
            for i in sorted(ready):
                if i < self.num_workers:
                    self._on_header(i)
                elif i < 2 * self.num_workers:
                    self._on_gradient(i - self.num_workers)
                else:
                    others[i - 2 * self.num_workers][1]()
            self.cut.answer_if_due()
            self._check_signal()
        times["total"] += clock() - t_start
        return self._finish()

    def _awaited(self):
        if not self.initialized:
            return [self.workers[0]]
        out = [r for w, r in enumerate(self.workers) if not self.done[w] and self.aggregation.waiting_on(w)]
        return self.aggregation.awaited_servers() + out or "its peers"

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
        self.heard(w)
        header = self.hdr_in[w]
        op = int(header[H_OP])
        if header[H_FLAGS] & F_STOP_REQUEST:
            self._stop_request()
        if op == OP_PUSH:
            # The header buffer is posted again at once (the worker sends no
            # other until it has our reply); the push waits for its gradient.
            self.push_pending[w] = (int(header[H_VERSION]), float(loss_field(header)[H_LOSS]),
                                    int(header[H_EPOCH]), int(header[H_OFFSET]))
            self.req_hdr[w].Start()
            if self.in_window[w]:   # the gradient is already where the worker wrote it
                self.shared.sync()
                self.grad_views[w].pack()
                self.grad_arrived[w] = True
            self._push_if_complete(w)
        elif op == OP_PULL:
            self.want[w] = int(header[H_VERSION])
            self.req_hdr[w].Start()
            self.reply(w)
        elif op == OP_FINAL:
            self._on_final(w, header)
        elif op == OP_SNAPSHOT:
            self.cut.on_snapshot(w, int(header[H_VERSION]))
            self.req_hdr[w].Start()
        elif op == OP_RELEASE:
            self.req_hdr[w].Start()
            for args in self.cut.release():
                self._on_push(*args)
        elif op == OP_RESTORE:
            receive_restore(self, w, header)
            self.req_hdr[w].Start()
        else:
            raise ProtocolError(f"ps rank {self.rank}: unknown op {op} from rank {self.workers[w]}")

    def _on_gradient(self, w):
        self.grad_posted[w] = False
        self.grad_arrived[w] = True
        self._push_if_complete(w)

    def _push_if_complete(self, w):
        if self.push_pending[w] is None or not self.grad_arrived[w]:
            return
        version, loss, epoch, offset = self.push_pending[w]
        self.push_pending[w], self.grad_arrived[w] = None, False
        self.positions.record(w, version, epoch, offset)
        self._on_push(w, version, loss)

    def _on_push(self, w, version, loss):
        if not self.initialized:
            raise ProtocolError(f"ps rank {self.rank}: push from rank {self.workers[w]} before initialization")
        if self.cut.holds(w, version, loss):
            return
        self.stats.pushes[w] += 1
        self.aggregation.on_push(w, version, loss)

    def _leave_behind(self):
        """The run is over but for workers silent past the deadline: finish
        without them (their requests stay as they are: they never complete)."""
        for w in self.silence.gone():
            self.done[w] = self.left_behind[w] = True
            self.sending[w] = False
            self.stats.abandoned[w] = 1

    def _on_final(self, w, header):
        self.done[w] = True
        self.final_version = max(self.final_version, int(header[H_VERSION]))
        self.want_state[w] = bool(header[H_FLAGS] & F_WANT_STATE)
        if header[H_FLAGS] & F_PREEMPTED:
            self.preempted = True
        if self.grad_posted[w]:
            self.req_grad[w].Cancel()
            self.req_grad[w].Wait()
            self.grad_posted[w] = False

    def repost(self, w):
        if not self.grad_posted[w] and not self.done[w] and not self.in_window[w]:
            self.req_grad[w].Start()
            self.grad_posted[w] = True

    def drop(self, w, stale=True):
        """Worker w's gradient is not applied: stale, or past the end."""
        self.stats.drop(w, stale)
        self.rejected[w] = True
        self.repost(w)

    # --- replies ------------------------------------------------------------
    def quiesce(self):
        """Params is about to change: wait for the replies sent from it (none
        when every worker has a reply buffer of its own)."""
        if self.reply_bufs is None:
            self._wait_replies()

    def _wait_replies(self):
        busy = np.flatnonzero(self.sending)
        if len(busy) == 0:
            return
        t0 = time.perf_counter()
        with self.waiting("parameter replies", peer=[self.workers[w] for w in busy]):
            self.waits.all([req for w in busy for req in self.reply_reqs[w]])
        self.sending[:] = False
        self.stats.times["send_wait"] += time.perf_counter() - t0

    def _flags(self, w=None):
        flags = 0
        if self.version >= self.stop_version:
            flags |= F_STOP
        if self.preempted:
            flags |= F_PREEMPTED
        if self.stop_seen and not self.leader:
            flags |= F_STOP_REQUEST
        if w is not None and self.rejected[w]:
            flags |= F_REJECTED
        return flags

    def fill_reply(self, header, w=None):
        header[:] = 0
        header[H_OP], header[H_VERSION], header[H_WORKER] = OP_REPLY, self.version, -1
        header[H_FLAGS], header[H_STOP], header[H_T] = self._flags(w), self.stop_version, self.opt.t
        loss_field(header)[H_LOSS] = self.last_loss
        loss_field(header)[H_NORM] = self.last_norm

    def reply(self, w):
        """Answer worker w's pending request if the version it wants is here."""
        want = self.want[w]
        if want < 0 or not self.initialized or self.done[w]:
            return
        if self.version < want and self.version < self.stop_version:
            return
        self.want[w] = -1
        times, t0 = self.stats.times, time.perf_counter()
        if self.sending[w]:
            with self.waiting("parameter reply", peer=self.workers[w]):
                self.waits.all(self.reply_reqs[w])
        t1 = time.perf_counter()
        times["send_wait"] += t1 - t0
        self.fill_reply(self.hdr_out[w], w)
        self.heard(w)
        self.rejected[w] = False
        if self.reply_bufs is not None:
            self.reply_bufs[w][...] = self.params
            self.hdr_out[w][H_FLAGS] |= F_OWN_BUFFER
        if self.in_window[w]:   # the worker copies them out of the window once it has the header
            self.shared.sync()
        MPI.Prequest.Startall(self.reply_reqs[w])
        self.sending[w] = True
        times["reply"] += time.perf_counter() - t1

    # --- the end ------------------------------------------------------------
    def stats_array(self):
        return self.stats.to_array(self.version, self.size)

    def _finish(self):
        self._wait_replies()     # every worker is done: each received its last reply
        if self.shared is not None:
            self.shared.sync()
        self.aggregation.finish_sends()
        stats = self.stats_array()
        states = list(self.opt.state().values())
        positions = self.positions.at(self.version)
        reqs = []
        present = [w for w in range(self.num_workers) if not self.left_behind[w]]
        for w in present:
            rank = self.workers[w]
            self.fill_reply(self.hdr_out[w], w)
            reqs.append(self.comm.Isend(self.hdr_out[w], rank, TAG_REPLY))
            if not self.in_window[w]:   # else the worker copies params out of the window (no F_OWN_BUFFER)
                reqs.append(self.comm.Isend(self.params, rank, TAG_PARAMS))
            reqs.append(self.comm.Isend(stats, rank, TAG_BULK))
            if self.want_state[w]:
                reqs += [self.comm.Isend(array, rank, TAG_BULK) for array in states]
                reqs.append(self.comm.Isend(positions, rank, TAG_BULK))
        with self.waiting("final replies", peer=[self.workers[w] for w in present]):
            MPI.Request.Waitall(reqs)
        if self.silence:
            self.silence.stop()
        self.aggregation.free()
        for w in present:
            for req in (self.req_hdr[w], self.req_grad[w], self.send_hdr[w], self.send_params[w]):
                req.Free()
        return stats
