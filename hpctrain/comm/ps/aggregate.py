"""How a server turns workers' gradients into updates: SyncRounds (one update
per version from `replicas` workers, the leader deciding each round's members)
and AsyncApply (each gradient on arrival, bounded staleness, DC-ASGD). The
server (server.py) owns the requests and replies and calls one of these.

    mpirun -n 3 python -m hpctrain.comm.ps      # the package's self-check drives SyncRounds

Sync. One update per version from `replicas` distinct workers' gradients
computed on that version, summed in worker order (bit-reproducible), scaled by
1/replicas; a gradient for an older version is dropped and counted. ps 0 (the
leader) decides each round's members (the first `replicas` to arrive) and tells
the other servers, so every slice is updated from the same workers and no
server can wait for a gradient that will never come.

Async. Each gradient is applied on arrival with staleness = version - its
version; `max_staleness` S: a push more than S behind is not applied, and the
reply brings fresh parameters (a re-pull). DC-ASGD (`dc_lambda` L > 0): the
server keeps, per worker, the parameters it last sent that worker (w_bak) and
applies g + L*g*g*(w - w_bak); w_bak is the server's per-worker reply buffer
(Server.reply_bufs), which holds exactly that.
"""
import time

import numpy as np
from mpi4py import MPI

from ...clipping import sum_squares
from .protocol import F_PREEMPTED, H_FLAGS, H_OP, H_STOP, H_VERSION, HEADER, OP_ROUND, TAG_ROUND, ProtocolError

BLOCK = 32768        # elements per block in the DC-ASGD pass (cache-sized)


def dc_compensate(g, w, w_bak, lam, scratch):
    """DC-ASGD (Zheng et al. 2017), in place: g += lam * g * g * (w - w_bak),
    block by block through `scratch` so nothing is allocated."""
    n = g.size
    for lo in range(0, n, scratch.size):
        hi = min(lo + scratch.size, n)
        delta, gb = scratch[: hi - lo], g[lo:hi]
        np.subtract(w[lo:hi], w_bak[lo:hi], out=delta)
        delta *= gb
        delta *= gb
        delta *= lam
        gb += delta
    return g


class SyncRounds:
    """Synchronous aggregation for one server (SyncReplicasOptimizer, done right)."""

    def __init__(self, server, replicas):
        self.server = server
        workers = server.num_workers
        self.replicas = replicas
        self.tag = np.full(workers, -1, np.int64)    # version of the gradient held in grads[w], -1 none
        self.loss = np.zeros(workers, np.float64)
        self.acc = np.zeros(server.size, np.float32) if replicas > 1 else None
        # rounds across servers: the leader sends its decision, the others receive it
        self.coordinated = len(server.servers) > 1
        self.round_buf = np.zeros(HEADER + workers, np.int64)
        self.req_round = None
        self.send_round = []
        self.have_decision = False
        self.round_sending = False
        if self.coordinated:
            comm, servers = server.comm, server.servers
            if server.leader:
                self.send_round = [comm.Send_init(self.round_buf, s, TAG_ROUND) for s in servers[1:]]
            else:
                self.req_round = comm.Recv_init(self.round_buf, servers[0], TAG_ROUND)

    # --- what the server asks of a strategy ----------------------------------
    def requests(self):
        """Receives the server waits on besides the workers' headers."""
        return [self.req_round] if self.req_round is not None else []

    def start(self):
        if self.req_round is not None:
            self.req_round.Start()

    def waiting_on(self, worker):
        return self.tag[worker] < self.server.version

    def holds_for_snapshot(self):
        # Only the leader: followers must still apply the rounds it decided.
        return self.server.leader

    def awaited_servers(self):
        srv = self.server
        return [srv.servers[0]] if self.coordinated and not srv.leader and not self.have_decision else []

    def caught_up(self):
        # A follower must apply every round the leader decided before it is done.
        srv = self.server
        return not self.coordinated or srv.leader or srv.version >= srv.final_version

    def after_restore(self):
        for w in np.flatnonzero(self.tag >= 0):   # gradients of the old state mean nothing now
            self.tag[w] = -1
            self.server.repost(w)

    def finish_sends(self):
        if self.round_sending:
            with self.server.waiting("round decision to servers", peer=self.server.servers[1:]):
                MPI.Request.Waitall(self.send_round)

    def free(self):
        if self.req_round is not None:
            self.req_round.Cancel()
            self.req_round.Wait()
            self.req_round.Free()
        for req in self.send_round:
            req.Free()

    # --- gradients and rounds -------------------------------------------------
    def on_push(self, w, version, loss):
        srv = self.server
        srv.want[w] = version + 1
        if version < srv.version:
            srv.drop(w)
        elif srv.version >= srv.stop_version:
            srv.drop(w, stale=False)
        elif version > srv.version and srv.leader:
            raise ProtocolError(f"ps rank {srv.rank}: gradient for version {version} from rank "
                                f"{srv.workers[w]}, ahead of version {srv.version}")
        else:
            if self.tag[w] >= 0:
                raise ProtocolError(f"ps rank {srv.rank}: second gradient from rank {srv.workers[w]}")
            self.tag[w] = version
            self.loss[w] = loss
            self._try_close()
        srv.reply(w)

    def on_message(self):
        """The leader's round decision arrived (followers only)."""
        srv, buf = self.server, self.round_buf
        if int(buf[H_OP]) != OP_ROUND or int(buf[H_VERSION]) != srv.version:
            raise ProtocolError(f"ps rank {srv.rank}: round decision for version {int(buf[H_VERSION])} "
                                f"at version {srv.version}")
        self.have_decision = True
        srv.stop_version = int(buf[H_STOP])
        if buf[H_FLAGS] & F_PREEMPTED:
            srv.preempted = True
        self._try_close()

    def _try_close(self):
        srv = self.server
        if not self.coordinated or srv.leader:
            arrived = np.flatnonzero(self.tag == srv.version)
            if len(arrived) < self.replicas or srv.version >= srv.stop_version:
                return
            members = arrived
            if self.coordinated:
                self._announce(members)
        else:
            if not self.have_decision:
                return
            members = np.flatnonzero(self.round_buf[HEADER:])
            if not np.all(self.tag[members] == srv.version):
                return
        self._apply_round(members)

    def _announce(self, members):
        srv = self.server
        if self.round_sending:
            with srv.waiting("round decision to servers", peer=srv.servers[1:]):
                srv.waits.all(self.send_round)
        buf = self.round_buf
        buf[:] = 0
        buf[H_OP], buf[H_VERSION], buf[H_STOP] = OP_ROUND, srv.version, srv.stop_version
        buf[H_FLAGS] = F_PREEMPTED if srv.preempted else 0
        buf[HEADER + members] = 1
        MPI.Prequest.Startall(self.send_round)
        self.round_sending = True

    def _apply_round(self, members):
        srv = self.server
        srv.quiesce()
        times, t0 = srv.stats.times, time.perf_counter()
        first = members[0]
        if len(members) == 1:
            total = srv.grads[first]
        else:
            total = self.acc
            np.add(srv.grads[first], srv.grads[members[1]], out=total)
            for m in members[2:]:
                total += srv.grads[m]          # worker order, whatever the arrival order
        scale = 1.0 / len(members)
        if srv.clip is not None:
            scale = self._clipped(total, scale)
        t1 = time.perf_counter()
        srv.opt.step(srv.params, total, srv.lr_fn(srv.version), scale)
        times["aggregate"] += t1 - t0
        times["optimizer"] += time.perf_counter() - t1
        srv.last_loss = float(sum(self.loss[m] for m in members) / len(members))
        srv.stats.applied(0, count=len(members))
        round_version = srv.version
        srv.version += 1
        srv.stats.updates += 1
        is_member = np.zeros(srv.num_workers, bool)
        is_member[members] = True
        for w in np.flatnonzero(self.tag == round_version):
            if not is_member[w]:
                srv.stats.drop(w)          # in the round's version, but not among its first arrivals
                srv.rejected[w] = True
            self.tag[w] = -1
            srv.repost(w)
        if self.req_round is not None:
            self.have_decision = False
            self.req_round.Start()
        for w in range(srv.num_workers):
            srv.reply(w)


    def _clipped(self, total, scale):
        """--clip-norm: the round's grad_scale times the clip factor of the
        averaged gradient's norm, from every server's slice of `total` (each
        server's sum of squares, gathered among the servers: they all apply
        every round, in order, so each is here for this one too; fsum makes
        the factor the same bits on every server)."""
        srv = self.server
        partials = sum_squares([total])
        comm = srv.servers_comm
        if comm is not None and comm.Get_size() > 1:
            everyone = np.zeros(comm.Get_size(), np.float64)
            with srv.waiting("clip norm: the servers' sums of squares", peer=srv.servers):
                comm.Allgather(partials, everyone)
            partials = everyone
        scale = srv.clip.scaled(partials, scale)
        srv.last_norm = srv.clip.norm
        return scale


class AsyncApply:
    """Asynchronous updates for one server: staleness recorded, bounded, and
    (dc_lambda > 0) compensated."""

    def __init__(self, server, max_staleness=None, dc_lambda=0.0):
        self.server = server
        self.max_staleness = max_staleness
        self.dc_lambda = float(dc_lambda)
        size = server.size
        # the parameters each worker computes on: what the server last sent it
        self.w_bak = server.reply_bufs if self.dc_lambda > 0 else None
        self.scratch = np.empty(max(1, min(BLOCK, size)), np.float32)

    def requests(self):
        return []

    def start(self):
        pass

    def waiting_on(self, worker):
        return True

    def holds_for_snapshot(self):
        return True

    def awaited_servers(self):
        return []

    def caught_up(self):
        return True

    def after_restore(self):
        pass

    def finish_sends(self):
        pass

    def free(self):
        pass

    def on_message(self):
        raise ProtocolError(f"ps rank {self.server.rank}: a round decision in async mode")

    def on_push(self, w, version, loss):
        srv = self.server
        srv.want[w] = 0
        staleness = srv.version - version
        if srv.version >= srv.stop_version:
            srv.drop(w, stale=False)
        elif self.max_staleness is not None and staleness > self.max_staleness:
            srv.drop(w)
        else:
            srv.stats.applied(staleness)
            grad = srv.grads[w]
            times, t0 = srv.stats.times, time.perf_counter()
            if self.w_bak is not None:
                dc_compensate(grad, srv.params, self.w_bak[w], self.dc_lambda, self.scratch)
            t1 = time.perf_counter()
            srv.opt.step(srv.params, grad, srv.lr_fn(srv.version), 1.0)
            times["aggregate"] += t1 - t0
            times["optimizer"] += time.perf_counter() - t1
            srv.version += 1
            srv.stats.updates += 1
            srv.last_loss = loss
            srv.repost(w)
        srv.reply(w)
