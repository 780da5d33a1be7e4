"""The watchdog names whom a rank waited for, and stays quiet for short waits."""
import io
import time

from hpctrain.comm.deadline import Watchdog
from hpctrain.base.errors import EXIT_TIMEOUT


def test_fires_after_timeout_naming_the_peer():
    aborted, out = [], io.StringIO()
    dog = Watchdog(0.3, rank=2, abort=aborted.append, out=out)
    with dog.waiting("ring allreduce", peer=1):
        deadline = time.monotonic() + 5
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.05)
    assert aborted == [EXIT_TIMEOUT]
    line = out.getvalue().strip()
    assert line.startswith("hpctrain: error: rank 2 waited") and "for rank 1 (ring allreduce)" in line
    assert len(line.splitlines()) == 1


def test_short_waits_do_not_fire():
    aborted = []
    dog = Watchdog(0.5, rank=0, abort=aborted.append, out=io.StringIO())
    for _ in range(20):
        with dog.waiting("x", peer=[3, 1]):
            time.sleep(0.02)
    time.sleep(0.7)
    assert aborted == [] and dog.fired is None


def test_peer_list_and_callable():
    out = io.StringIO()
    aborted = []
    dog = Watchdog(0.2, rank=0, abort=aborted.append, out=out)
    with dog.waiting("gradients", peer=lambda: [3, 1]):
        time.sleep(0.8)
    assert "ranks 1,3 (gradients)" in out.getvalue()


def test_the_null_watchdog_waits_without_a_deadline():
    """Code given no watchdog (self-checks, unit tests) waits under NO_WATCHDOG:
    its waits and busy work are plain blocks, and there is no timeout to watch."""
    from hpctrain.comm.deadline import NO_WATCHDOG
    from hpctrain.comm.strategy import waiting
    with NO_WATCHDOG.waiting("anything", peer=[1, 2]), NO_WATCHDOG.busy(), waiting(None, "x", peer=3):
        time.sleep(0.01)
    assert NO_WATCHDOG.timeout is None
