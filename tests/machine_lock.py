"""Take turns on something a machine has only one of (tests/test_slurm.py's
single-node SLURM: one /etc/slurm, SLURM's ports on this host).

Two checkouts testing as root at once would otherwise fight over it: the
second session's slurm_up.sh restarts the daemons under the first one's jobs
(its state directory differs) or finds them up and shares them until the
first session stops them at its end. `take_turn` holds an exclusive flock on
a lock file for as long as the caller keeps the returned descriptor open (the
kernel drops it when the process ends, however it ends), and waits a bounded
time for another session's turn, then fails naming the holder.
"""
import fcntl
import os
import time

import pytest


def take_turn(path, wait_s, poll_s=0.5, what="this"):
    """An open descriptor holding an exclusive lock on `path` (close it to
    let the next session in); pytest.fail after `wait_s` seconds of waiting."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                pytest.fail(f"{what} is in use by another test session (pid and checkout: "
                            f"{holder}) after waiting {wait_s} s; lock file {path}")
            time.sleep(poll_s)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {os.getcwd()}\n".encode(), 0)
        return fd
