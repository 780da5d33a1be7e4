"""A parameter server's round as a value and a decision: `Round` is what one
server knows of the round in progress (its version, the stop version, whose
gradient it holds for which version, who was rejected, the last loss and
norm); `Sync` and `Async` take a Round and a `Push` (or, on a sync follower,
the leader's round decision), update the Round and return a `Decision`:
what the server then carries out (server.py: MPI, the optimizer, replies).
Nothing here sends, receives or computes on parameters (a reply header is
filled from the state, not sent).

    python -m pytest -q tests/test_ps_round.py

Sync (SyncReplicasOptimizer, done right). One update per version from
`replicas` distinct workers' gradients computed on that version, summed in
worker order (bit-reproducible), scaled by 1/members; a gradient for an
older version is rejected (stale). ps 0 (the leader) decides each round's
members (the first `replicas` to arrive) and announces them to the other
servers, so every slice is updated from the same workers and no server can
wait for a gradient that will never come; a follower applies the leader's
members once it holds all of them, and rejects the others it holds for
that version (late at the leader).

Async. Each gradient is applied on arrival with staleness = version - its
version; `max_staleness` S: a push more than S behind is rejected (its
reply brings fresh parameters, a re-pull).

Either way, from the stop version on every push is rejected (not stale:
past the end), and a stop request lowers the leader's stop version to the
version after the one in progress.
"""
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np

from .protocol import (F_PREEMPTED, F_REJECTED, F_STOP, F_STOP_REQUEST, H_FLAGS, H_LOSS, H_NORM, H_OP, H_STOP,
                       H_T, H_VERSION, H_WORKER, OP_REPLY, ProtocolError, loss_field)


class Push(NamedTuple):
    """A worker's gradient, arrived: worker index, its rank (for messages),
    the version it was computed on, its loss, its data position after it."""
    worker: int
    rank: int
    version: int
    loss: float
    epoch: int = -1
    offset: int = -1


@dataclass
class Round:
    """One server's round state. rank: this server's (for messages)."""
    rank: int
    num_workers: int
    stop_version: int
    version: int = 0
    preempted: bool = False          # the stop came from a signal, not from the step budget
    stop_seen: bool = False          # a stop signal or request seen here (followers pass it on)
    last_loss: float = math.nan      # the last update's loss (sync: its members' mean)
    last_norm: float = math.nan      # the last sync round's pre-clip norm (--clip-norm)
    decided: Optional[np.ndarray] = None     # sync follower: the leader's members for `version`
    held: np.ndarray = field(init=False)     # version of the gradient held per worker, -1 none (sync)
    losses: np.ndarray = field(init=False)   # the loss of each held gradient
    rejected: np.ndarray = field(init=False)  # the worker's last push was not applied (its reply says so)

    def __post_init__(self):
        self.held = np.full(self.num_workers, -1, np.int64)
        self.losses = np.zeros(self.num_workers, np.float64)
        self.rejected = np.zeros(self.num_workers, bool)

    @property
    def stopped(self):
        return self.version >= self.stop_version

    def waiting_on(self, worker):
        """This server has no gradient from `worker` for the version in progress."""
        return self.held[worker] < self.version

    def request_stop(self, leader):
        """A stop signal or request: the leader stops after the version in
        progress (a request during the last one changes nothing)."""
        self.stop_seen = True
        if leader and self.version + 1 < self.stop_version:
            self.stop_version = self.version + 1
            self.preempted = True

    def reply_header(self, header, leader, t, worker=None):
        """Fill a reply header (protocol.py) from this state: version, stop
        version, flags (worker: the one it answers, for F_REJECTED), the
        optimizer step t, the last loss and norm."""
        flags = (F_STOP if self.stopped else 0) | (F_PREEMPTED if self.preempted else 0)
        if self.stop_seen and not leader:
            flags |= F_STOP_REQUEST
        if worker is not None and self.rejected[worker]:
            flags |= F_REJECTED
        header[:] = 0
        header[H_OP], header[H_VERSION], header[H_WORKER] = OP_REPLY, self.version, -1
        header[H_FLAGS], header[H_STOP], header[H_T] = flags, self.stop_version, t
        loss_field(header)[H_LOSS] = self.last_loss
        loss_field(header)[H_NORM] = self.last_norm

    def restore(self, version):
        """A checkpoint's `version` is loaded: the gradients held for the old
        state mean nothing now. Returns their workers (to receive again)."""
        dropped = np.flatnonzero(self.held >= 0)
        self.held[dropped] = -1
        self.version = int(version)
        return tuple(int(w) for w in dropped)


@dataclass(frozen=True)
class Decision:
    """What a server does, in this order: (announce, then) apply the sum of
    `members`' gradients as the update of `version` (staleness: how far
    behind the version it was computed on); count `rejected` ((worker,
    stale) pairs, not applied); post the gradient receive of `repost` again;
    reply to every worker whose request the new version satisfies
    (`reply_all`). `reply_at`: the version the pusher's reply waits for
    (-1: no pusher)."""
    reply_at: int = -1
    members: tuple = ()
    version: int = -1
    staleness: int = 0
    announce: bool = False
    rejected: tuple = ()
    repost: tuple = ()
    reply_all: bool = False


def reject(state, push, stale, reply_at):
    state.rejected[push.worker] = True
    return Decision(reply_at=reply_at, rejected=((push.worker, stale),), repost=(push.worker,))


@dataclass(frozen=True)
class Sync:
    """Synchronous rounds of `replicas` workers. leader: this server decides
    the members (ps 0, or the only server); coordinated: there are other
    servers (the leader announces, the others wait for its decisions)."""
    replicas: int
    leader: bool = True
    coordinated: bool = False

    def on_push(self, state, push):
        w, reply_at = push.worker, push.version + 1
        if push.version < state.version:
            return reject(state, push, True, reply_at)
        if state.stopped:
            return reject(state, push, False, reply_at)
        if push.version > state.version and self.leader:
            raise ProtocolError(f"ps rank {state.rank}: gradient for version {push.version} from rank "
                                f"{push.rank}, ahead of version {state.version}")
        if state.held[w] >= 0:
            raise ProtocolError(f"ps rank {state.rank}: second gradient from rank {push.rank}")
        state.held[w] = push.version
        state.losses[w] = push.loss
        return self._close(state, reply_at)

    def on_decision(self, state, version, stop_version, preempted, members):
        """A follower: the leader's members for `version`, its stop version and flag."""
        if version != state.version:
            raise ProtocolError(f"ps rank {state.rank}: round decision for version {version} "
                                f"at version {state.version}")
        state.decided = np.asarray(members, np.int64)
        state.stop_version = int(stop_version)
        state.preempted = state.preempted or bool(preempted)
        return self._close(state, -1)

    def _close(self, state, reply_at):
        """The round's members if it can close now, else nothing but the reply."""
        if not self.coordinated or self.leader:
            members = np.flatnonzero(state.held == state.version)
            if len(members) < self.replicas or state.stopped:
                return Decision(reply_at=reply_at)
        else:
            members = state.decided
            if members is None or not np.all(state.held[members] == state.version):
                return Decision(reply_at=reply_at)
        version = state.version
        used = np.flatnonzero(state.held == version)
        late = [int(w) for w in used if w not in members]   # in the round's version, not among its first
        state.last_loss = float(sum(state.losses[m] for m in members) / len(members))
        state.held[used] = -1
        state.rejected[late] = True
        state.decided = None
        state.version += 1
        return Decision(reply_at=reply_at, members=tuple(int(m) for m in members), version=version,
                        announce=self.coordinated and self.leader, rejected=tuple((w, True) for w in late),
                        repost=tuple(int(w) for w in used), reply_all=True)


@dataclass(frozen=True)
class Async:
    """Asynchronous updates: each gradient on arrival, at most `max_staleness`
    versions behind (None: any)."""
    max_staleness: Optional[int] = None

    def on_push(self, state, push):
        staleness = state.version - push.version
        if state.stopped:
            return reject(state, push, False, 0)
        if self.max_staleness is not None and staleness > self.max_staleness:
            return reject(state, push, True, 0)
        version = state.version
        state.version += 1
        state.last_loss = push.loss
        return Decision(reply_at=0, members=(push.worker,), version=version, staleness=staleness,
                        repost=(push.worker,))
