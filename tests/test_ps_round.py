"""A ps server's round as a value and a decision (hpctrain/comm/ps/round.py):
sync rounds with backup workers, across servers, stale and late pushes,
async with bounded staleness, the stop version. No MPI: the decisions are
pure functions of a Round and a Push.

    .venv/bin/python -m pytest -q tests/test_ps_round.py
"""
import pytest

from hpctrain.comm.ps import Async, Push, ProtocolError, Round, Sync


def push(worker, version, loss=0.0):
    return Push(worker, 10 + worker, version, loss)


def test_sync_with_a_backup_worker_closes_on_the_first_two_and_rejects_the_third():
    state, rule = Round(rank=0, num_workers=3, stop_version=10), Sync(replicas=2)
    first = rule.on_push(state, push(2, 0, loss=1.0))
    assert first.members == () and first.reply_at == 1 and not first.reply_all and state.version == 0
    assert state.waiting_on(0) and not state.waiting_on(2)
    second = rule.on_push(state, push(0, 0, loss=3.0))
    # worker order, whatever the arrival order; the update of version 0; everyone answered
    assert second.members == (0, 2) and second.version == 0 and second.reply_all and second.repost == (0, 2)
    assert second.rejected == () and not second.announce
    assert state.version == 1 and state.last_loss == 2.0 and list(state.held) == [-1, -1, -1]
    late = rule.on_push(state, push(1, 0))      # the backup's gradient of version 0: stale now
    assert late.members == () and late.rejected == ((1, True),) and late.repost == (1,) and late.reply_at == 1
    assert list(state.rejected) == [False, True, False]


def test_sync_leader_announces_and_a_follower_applies_the_leaders_members_only():
    leader, follower = Round(0, 3, 10), Round(1, 3, 10)
    lead, follow = Sync(2, leader=True, coordinated=True), Sync(2, leader=False, coordinated=True)
    lead.on_push(leader, push(1, 0))
    decided = lead.on_push(leader, push(2, 0))
    assert decided.members == (1, 2) and decided.announce
    # the follower got worker 0's gradient first (worker 0 was late at the leader)
    for w in (0, 1):
        assert follow.on_push(follower, push(w, 0)).members == ()
    assert follower.decided is None and not follower.waiting_on(0)
    waiting = follow.on_decision(follower, 0, 10, False, [1, 2])
    assert waiting.members == () and follower.version == 0       # worker 2's gradient is not here yet
    closed = follow.on_push(follower, push(2, 0))
    assert closed.members == (1, 2) and not closed.announce and closed.rejected == ((0, True),)
    assert closed.repost == (0, 1, 2) and follower.version == 1 and follower.decided is None
    with pytest.raises(ProtocolError, match="round decision for version 0 at version 1"):
        follow.on_decision(follower, 0, 10, False, [1, 2])


def test_sync_protocol_errors_a_gradient_ahead_at_the_leader_and_a_second_one():
    state, rule = Round(0, 2, 10), Sync(2)
    with pytest.raises(ProtocolError, match="gradient for version 1 from rank 10, ahead of version 0"):
        rule.on_push(state, push(0, 1))
    rule.on_push(state, push(0, 0))
    with pytest.raises(ProtocolError, match="second gradient from rank 10"):
        rule.on_push(state, push(0, 0))


def test_async_applies_on_arrival_within_max_staleness():
    state, rule = Round(0, 2, 10), Async(max_staleness=1)
    d = rule.on_push(state, push(1, 0, loss=0.5))
    assert d.members == (1,) and d.version == 0 and d.staleness == 0 and d.repost == (1,) and d.reply_at == 0
    assert state.version == 1 and state.last_loss == 0.5
    d = rule.on_push(state, push(0, 0, loss=0.25))     # one version behind: applied
    assert d.members == (0,) and d.staleness == 1 and state.version == 2
    d = rule.on_push(state, push(1, 0))                # two behind: rejected, a re-pull
    assert d.members == () and d.rejected == ((1, True),) and d.repost == (1,) and state.version == 2
    assert state.rejected[1] and state.last_loss == 0.25
    assert state.waiting_on(0) and state.waiting_on(1)   # async holds no gradient between pushes


@pytest.mark.parametrize("rule", [Sync(1), Async()], ids=["sync", "async"])
def test_at_the_stop_version_every_push_is_rejected_as_past_the_end(rule):
    state = Round(0, 2, stop_version=1)
    assert rule.on_push(state, push(0, 0)).members == (0,) and state.stopped
    d = rule.on_push(state, push(1, 1))
    assert d.members == () and d.rejected == ((1, False),) and state.version == 1


def test_a_stop_request_stops_the_leader_after_the_version_in_progress():
    state = Round(0, 2, stop_version=10)
    state.version = 4
    state.request_stop(leader=False)
    assert state.stop_seen and state.stop_version == 10 and not state.preempted   # followers pass it on
    state.request_stop(leader=True)
    assert state.stop_version == 5 and state.preempted
    last = Round(0, 2, stop_version=5)
    last.version = 4
    last.request_stop(leader=True)            # during the last version: nothing changes
    assert last.stop_version == 5 and not last.preempted


def test_a_restore_drops_the_gradients_held_for_the_old_state():
    state, rule = Round(0, 3, 10), Sync(3)
    rule.on_push(state, push(0, 0))
    rule.on_push(state, push(2, 0))
    assert state.restore(7) == (0, 2) and state.version == 7 and list(state.held) == [-1, -1, -1]
