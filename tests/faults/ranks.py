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
