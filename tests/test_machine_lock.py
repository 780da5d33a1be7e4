"""Sessions take turns on the machine's one SLURM (tests/machine_lock.py):
a second session waits for the first one's lock, fails naming the holder
after its wait, and gets the lock once the holder is gone. About 2 s.
"""
import os
import subprocess
import sys

import pytest

from machine_lock import take_turn

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, b"%d /some/other/checkout\\n" % os.getpid(), 0)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_second_session_waits_then_fails_naming_the_holder(tmp_path):
    lock = tmp_path / "slurm.lock"
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "held\n"
        with pytest.raises(pytest.fail.Exception) as failed:
            take_turn(lock, wait_s=0.5, poll_s=0.1, what="the single-node SLURM")
        message = str(failed.value)
        assert f"{other.pid} /some/other/checkout" in message, message
        assert "the single-node SLURM is in use by another test session" in message, message
    finally:
        other.communicate("", timeout=30)  # the holder ends: its lock goes with it
    fd = take_turn(lock, wait_s=5, poll_s=0.1)
    try:
        assert lock.read_text() == f"{os.getpid()} {os.getcwd()}\n"
    finally:
        os.close(fd)
