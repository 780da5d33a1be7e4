"""One parameter server: the request loop, and carrying out what the round
decides. What to do with each push is decided in round.py (Sync, Async: a
Round state and a Decision); this file carries decisions out: the update's
arithmetic (aggregate.py), the leader's decisions to the other servers
(leader.py), the buffers and requests (exchange.py), replies, the end. The
checkpoint side (snapshot, restore, data positions) is snapshot.py.

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
import json
import time

import numpy as np
from mpi4py import MPI

from ..deadline import NO_WATCHDOG
from ...base.precision import FLOAT32
from .aggregate import Update
from .exchange import Exchange
from .leader import RoundLink
from .protocol import (F_PREEMPTED, F_STOP_REQUEST, F_WANT_STATE, H_EPOCH, H_FLAGS, H_LOSS, H_OFFSET, H_OP,
                       H_VERSION, OP_FINAL, OP_PULL, OP_PUSH, OP_RELEASE, OP_RESTORE, OP_SNAPSHOT, ProtocolError,
                       loss_field)
from .round import Async, Push, Round, Sync
from .silence import SilenceWatch
from .snapshot import CutHold, DataPositions, receive_restore, receive_text, text_buffer
from .stats import ServerStats
from ..waits import Waits


def reply_buffers_needed(sync, replicas, num_workers):
    """Each worker's reply from a buffer of its own (async, backup workers),
    rather than from the server's params. From params when every round needs
    every worker (sync without backups: no copy); otherwise an update never
    waits for a reply that a stopped or slow worker is not receiving."""
    return not sync or replicas < num_workers


class Server:
    """One parameter server: serve_until_done() until every worker sent OP_FINAL.

    It owns its slice of the parameters and their optimizer state and so
    takes, beyond a communicator and 1-D arrays, the objects that update
    them: `optimizer` (sized to the slice: `step(params, grads, lr,
    grad_scale)`, `state()`, `t`), `lr_fn` (version -> learning rate), `clip`
    (sync --clip-norm: a hpctrain.clipping.Clip on each round's aggregate),
    and `stop_requested` (polled: a stop signal arrived). ranges: this
    server's (lo, hi); worker_ranks / server_ranks: ranks in `comm`
    (server_ranks[0] leads); steps: the step budget; nap: wait without
    busy-polling (comm/waits.py); servers_comm: the servers' communicator, where
    the slices' sums of squares meet (clip, several servers); shared: the
    node's SharedExchange (shared.py) or None; write: `write(folder,
    params, states)` writes this server's slice and optimizer state into a
    checkpoint's folder and returns what it wrote (JSON-able: the writer is
    the loop's, loops/ps.py, which knows the model's tensors); read:
    `read(folder, params, states)`, the other way (a resume).
    """

    def __init__(self, comm, ranges, worker_ranks, server_ranks, optimizer, lr_fn, *, steps,
                 sync=True, replicas=None, max_staleness=None, dc_lambda=0.0, watchdog=NO_WATCHDOG,
                 stop_requested=None, nap=False, clip=None, servers_comm=None, shared=None, dtype=FLOAT32.params,
                 write=None, read=None):
        self.comm, self.rank = comm, comm.Get_rank()
        self.workers, self.servers = list(worker_ranks), list(server_ranks)
        self.leader = self.rank == self.servers[0]
        W = self.num_workers = len(self.workers)
        self.opt, self.watchdog, self.stop_requested = optimizer, watchdog, stop_requested
        self.waits = Waits(nap)
        self.shared = shared
        replicas = replicas or W                # default: all workers
        if sync and not 1 <= replicas <= W:
            raise ValueError(f"replicas {replicas} must be in 1..{W}")
        self.stats = ServerStats(W)
        self.ex = ex = Exchange(comm, ranges, self.workers, shared, reply_buffers_needed(sync, replicas, W),
                                self.waits, watchdog, self.stats.times, dtype)
        coordinated = sync and len(self.servers) > 1
        self.rule = Sync(replicas, self.leader, coordinated) if sync else Async(max_staleness)
        self.link = RoundLink(comm, self.servers, W, self.waits, watchdog) if coordinated else None
        self.follower = coordinated and not self.leader   # applies the rounds the leader decides
        self.holds_for_cut = self.leader or not sync      # a sync follower must still apply decided rounds
        self.round = Round(self.rank, W, int(steps))
        self.update = Update(optimizer, lr_fn, ex.params, ex.grads, self.stats.times,
                             many=sync and replicas > 1, clip=clip if sync else None, servers_comm=servers_comm,
                             peers=self.servers, dc_lambda=0.0 if sync else dc_lambda, w_bak=ex.reply_bufs,
                             watchdog=watchdog)
        self.initialized = False
        self.final_version = 0                  # the leader version workers ended at (from OP_FINAL)
        self.want = np.full(W, -1, np.int64)    # pending reply: minimum version, -1 none
        self.done = np.zeros(W, bool)
        self.final_state = None                 # OP_FINAL with F_WANT_STATE: (worker, the folder to write it to)
        self._write, self._read = write, read
        self.left_behind = np.zeros(W, bool)    # silent past the deadline after the run
        self.positions = DataPositions(W)
        self.cut = CutHold(self)                # a checkpoint cut being taken
        self.silence = None
        self.heard = lambda w: None             # serve_until_done: the leader's SilenceWatch

    # --- main loop ----------------------------------------------------------
    def serve_until_done(self):
        """Serve until every worker is done; returns the statistics array."""
        W, ex = self.num_workers, self.ex
        MPI.Prequest.Startall(ex.req_hdr)
        for w in range(W):
            self.repost(w)
        others = []                             # besides the workers' headers and gradients
        if self.follower:
            self.link.listen()
            others.append((self.link.request, self._on_decision))
        # Workers gone silent: ps 0 names them; at the deadline they are left
        # behind if the run is over, else ps 0 ends the job.
        if self.watchdog.timeout is not None:
            self.silence = SilenceWatch(self, self.watchdog)
            self.heard = self.silence.heard
            others.append((self.silence.request, self._leave_behind))
        # All at once: a worker stopped halfway through sending holds up nobody.
        waits = list(ex.req_hdr) + list(ex.req_grad) + [req for req, _ in others]
        times, clock, silence = self.stats.times, time.perf_counter, self.silence
        t_start = clock()
        while not (self.done.all() and self._caught_up()):
            with self.watchdog.waiting("requests from workers", peer=self._awaited):
                if silence:
                    silence.idle = True
                t0 = clock()
                ready = self.waits.some(waits)
                times["idle"] += clock() - t0
                if silence:
                    silence.idle = False
            if ready is None:
                raise ProtocolError(f"ps rank {self.rank}: nothing left to wait for at version {self.round.version}")
            for i in sorted(ready):
                if i < W:
                    self._on_header(i)
                elif i < 2 * W:
                    self._on_gradient(i - W)
                else:
                    others[i - 2 * W][1]()
            self.cut.answer_if_due()
            if self.stop_requested is not None and not self.round.stop_seen and self.stop_requested():
                self.round.request_stop(self.leader)
        times["total"] += clock() - t_start
        return self._finish()

    def _caught_up(self):
        # A follower must apply every round the leader decided before it is done.
        return not self.follower or self.round.version >= self.final_version

    def _awaited(self):
        if not self.initialized:
            return [self.workers[0]]
        out = [r for w, r in enumerate(self.workers) if not self.done[w] and self.round.waiting_on(w)]
        servers = [self.servers[0]] if self.follower and self.round.decided is None else []
        return servers + out or "its peers"

    # --- messages -----------------------------------------------------------
    def _on_header(self, w):
        self.heard(w)
        header, ex = self.ex.hdr_in[w], self.ex
        op = int(header[H_OP])
        if header[H_FLAGS] & F_STOP_REQUEST:
            self.round.request_stop(self.leader)
        if op == OP_PUSH:   # it waits for its gradient
            self._push_complete(ex.push_header(w, Push(w, self.workers[w], int(header[H_VERSION]),
                                                       float(loss_field(header)[H_LOSS]), int(header[H_EPOCH]),
                                                       int(header[H_OFFSET]))))
        elif op == OP_PULL:
            self.want[w] = int(header[H_VERSION])
            ex.req_hdr[w].Start()
            self.reply(w)
        elif op == OP_FINAL:
            self._on_final(w, header)
        elif op == OP_SNAPSHOT:
            self.cut.on_snapshot(w, int(header[H_VERSION]), self._folder_from(w))
            ex.req_hdr[w].Start()
        elif op == OP_RELEASE:
            ex.req_hdr[w].Start()
            for push in self.cut.release():
                self._on_push(push)
        elif op == OP_RESTORE:
            receive_restore(self, w, header)
            ex.req_hdr[w].Start()
        else:
            raise ProtocolError(f"ps rank {self.rank}: unknown op {op} from rank {self.workers[w]}")

    def _on_gradient(self, w):
        self._push_complete(self.ex.gradient_arrived(w))

    def _push_complete(self, push):
        if push is not None:   # header and gradient both here
            self.positions.record(push.worker, push.version, push.epoch, push.offset)
            self._on_push(push)

    def _on_push(self, push):
        if not self.initialized:
            raise ProtocolError(f"ps rank {self.rank}: push from rank {push.rank} before initialization")
        if self.cut.holds(push):
            return
        self.stats.pushes[push.worker] += 1
        self.carry_out(self.rule.on_push(self.round, push), push.worker)

    def _on_decision(self):
        """The leader's round decision arrived (followers only)."""
        self.carry_out(self.rule.on_decision(self.round, *self.link.read(self.rank)))

    def carry_out(self, decision, pusher=None):
        """Do what `decision` says (round.Decision), then answer the pusher."""
        d, stats = decision, self.stats
        if pusher is not None:
            self.want[pusher] = d.reply_at
        if d.members:
            if d.announce:
                self.link.announce(d.version, self.round.stop_version, self.round.preempted, d.members)
            self.quiesce()
            self.round.last_norm = self.update.apply(d.members, d.version)
            stats.applied(d.staleness, count=len(d.members))
            stats.updates += 1
        for w, stale in d.rejected:
            stats.drop(w, stale)
        for w in d.repost:
            self.repost(w)
        if d.members and self.follower:
            self.link.listen()
        if d.reply_all:
            for w in range(self.num_workers):
                self.reply(w)
        if pusher is not None:
            self.reply(pusher)

    def _leave_behind(self):
        """The run is over but for workers silent past the deadline: finish
        without them (their requests stay as they are: they never complete)."""
        for w in self.silence.gone():
            self.done[w] = self.left_behind[w] = True
            self.ex.sending[w] = False
            self.stats.abandoned[w] = 1

    def _on_final(self, w, header):
        self.done[w] = True
        self.final_version = max(self.final_version, int(header[H_VERSION]))
        if header[H_FLAGS] & F_WANT_STATE:
            self.final_state = (w, self._folder_from(w))
        if header[H_FLAGS] & F_PREEMPTED:
            self.round.preempted = True
        self.ex.cancel_gradient(w)

    def _folder_from(self, w):
        """The checkpoint folder the chief sends right behind its request."""
        with self.watchdog.waiting("checkpoint folder from the chief", peer=self.workers[w]):
            return receive_text(self.comm, self.workers[w])

    def written(self, folder):
        """This server's slice and optimizer state written into `folder`: what `write` says of it."""
        if self._write is None:
            raise ProtocolError(f"ps rank {self.rank}: asked for a checkpoint, but it has no writer")
        with self.watchdog.busy():   # others wait for the file: busy, not stalled
            return self._write(folder, self.ex.params, self.opt.state())

    def read(self, folder, states):
        """This server's slice and optimizer state (`states`: opt.state()'s) read from a checkpoint folder."""
        if self._read is None:
            raise ProtocolError(f"ps rank {self.rank}: asked to read a checkpoint, but it has no reader")
        with self.watchdog.busy():   # the chief waits for the acknowledgement: busy, not stalled
            self._read(folder, self.ex.params, states)

    def repost(self, w):
        if not self.done[w]:
            self.ex.post_gradient(w)

    # --- replies ------------------------------------------------------------
    def quiesce(self):
        """Params is about to change: wait for the replies sent from it (none
        when every worker has a reply buffer of its own)."""
        if self.ex.reply_bufs is None:
            self.ex.wait_replies()

    def fill_reply(self, header, w=None):
        """A reply header from this server's round (w: the worker it answers)."""
        self.round.reply_header(header, self.leader, self.opt.t, w)

    def reply(self, w):
        """Answer worker w's pending request if the version it wants is here."""
        want, r, ex = self.want[w], self.round, self.ex
        if want < 0 or not self.initialized or self.done[w]:
            return
        if r.version < want and not r.stopped:
            return
        self.want[w] = -1
        ex.wait_reply(w)
        t1 = time.perf_counter()
        self.fill_reply(ex.hdr_out[w], w)
        self.heard(w)
        r.rejected[w] = False
        ex.send_reply(w)
        self.stats.times["reply"] += time.perf_counter() - t1

    # --- the end ------------------------------------------------------------
    def _finish(self):
        ex = self.ex
        ex.wait_replies()   # each worker received its last reply
        if self.shared is not None:
            self.shared.sync()
        if self.link is not None:
            self.link.finish()
        stats = self.stats.to_array(self.round.version, ex.size)
        positions = self.positions.at(self.round.version)
        asked, folder = self.final_state or (None, None)
        written = None if folder is None else text_buffer(json.dumps(self.written(folder)))
        present = [w for w in range(self.num_workers) if not self.left_behind[w]]
        reqs = []
        for w in present:
            self.fill_reply(ex.hdr_out[w], w)
            reqs += ex.final_sends(w, stats, [written, positions] if w == asked else [])
        with self.watchdog.waiting("final replies", peer=[self.workers[w] for w in present]):
            MPI.Request.Waitall(reqs)
        if self.silence:
            self.silence.stop()
        if self.link is not None:
            self.link.free()
        ex.free(present)
        return stats
