"""Find the process of one rank of a running mpirun job (for SIGSTOP/SIGCONT
fault tests): the child of mpirun whose environment says PMI_RANK=r."""
import os
import signal
import subprocess
import time


def _children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def rank_pid(launcher, rank, module=b"hpctrain.mnist", within=60.0, poll=0.02):
    """The pid of `rank` under the mpirun process `launcher` (a Popen), or None."""
    deadline = time.monotonic() + within
    want = f"PMI_RANK={rank}".encode()
    while time.monotonic() < deadline and launcher.poll() is None:
        todo = _children(launcher.pid)
        while todo:
            pid = todo.pop()
            todo += _children(pid)
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if want in env and module in cmdline:
                return pid
        time.sleep(poll)
    return None


def blocked_opening_a_fifo(pid, within=60.0, poll=0.02):
    """Wait until a thread of process `pid` sleeps in the kernel opening a FIFO
    that has no writer (wchan wait_for_partner): the state a fault test wants
    to signal it in, waited for rather than guessed with a sleep. True once
    seen; False at `within` seconds or when the process is gone."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if any(open(f"/proc/{pid}/task/{t}/wchan").read() == "wait_for_partner"
                   for t in os.listdir(f"/proc/{pid}/task")):
                return True
        except OSError:   # a thread ended between the listing and the read, or the process did
            if not os.path.exists(f"/proc/{pid}"):
                return False
        time.sleep(poll)
    return False


class Stopped:
    """with Stopped(pid): the process is SIGSTOPped, and continued on exit."""

    def __init__(self, pid):
        self.pid = pid

    def __enter__(self):
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        return False
