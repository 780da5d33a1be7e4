"""A rank's way out, bounded from outside the rank: a small watcher process
that kills the rank when it stops moving after the run ended.

The watchdog (deadline.py) bounds every wait a rank's own threads can see,
MPI_Finalize included, and the others' roll call names a rank that stops
while they still need it. What neither can bound is a rank whose whole
process stands still once the others have left: stopped (SIGSTOP), stuck in
the kernel or a driver, or in C code that holds the GIL, after the shutdown
barrier. Its watchdog thread stands still with it, and under plain mpirun
the launcher then waits for it forever, the job's results already written.

So each rank starts, before MPI_Init (no fork once an interconnect has
pinned memory), one watcher: `python -I -S` running `_WATCH` below, in a
session of its own (a Ctrl-C at the terminal is the rank's to take), with
the read end of a pipe and none of the rank's output: the launcher ends a
rank when its pipes close, so the watcher holds none of them, and writes its
line through /proc/PID/fd/2, the rank's own standard error. The rank's watchdog thread writes a heartbeat into
it a few times a second; `arm()`, called before the shutdown barrier, tells
the watcher that from now on a silence of --timeout means the rank is stuck
on its way out: the watcher prints one line naming the rank, its pid and
host, and kills it (SIGKILL: the only signal a stopped process cannot
defer), so the launcher sees that rank end and ends the job. The rank's
exit closes the pipe, which ends the watcher. This works the same under
MPICH's and Open MPI's mpirun and under srun, since it needs nothing of the
launcher; jobs/launch.sh keeps its own bound as well.

    mpirun -n 2 python -m hpctrain.mnist --timeout 10    # then kill -STOP a rank after its last step line
"""
import os
import socket
import subprocess
import sys

# The watcher: argv = rank pid, rank, host, timeout, read fd. Bytes: H a
# heartbeat, A armed, F armed after the results were written; end of file:
# the rank has exited.
_WATCH = r"""
import os, select, signal, sys, time
pid, rank, host, timeout, fd = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
armed, finished, last = False, False, time.monotonic()
while True:
    ready, _, _ = select.select([fd], [], [], 0.5)
    if ready:
        data = os.read(fd, 4096)
        if not data:
            sys.exit(0)
        last = time.monotonic()
        armed = armed or b"A" in data or b"F" in data
        finished = finished or b"F" in data
    elif armed and time.monotonic() - last > timeout:
        done = "; the run had finished and its results are written" if finished else ""
        line = (f"hpctrain: error: rank {rank} (pid {pid} on {host}) has not moved for --timeout {timeout:g} s "
                f"on its way out, after the shutdown barrier (stopped, or stuck in the kernel, a driver or "
                f"MPI_Finalize); killed it{done}\n")
        try:   # the rank's own standard error: the launcher's pipe (kept open by the rank alone)
            err = os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_APPEND)
            os.write(err, line.encode())
            os.close(err)
        except OSError:
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(0)
"""


class ExitGuard:
    """This rank's watcher (start() makes it); every method is safe to call
    from any thread, and does nothing once the watcher is gone."""

    def __init__(self, fd, process):
        self._fd, self._process = fd, process   # the Popen kept: nothing reaps or warns about it meanwhile

    def _say(self, byte):
        if self._fd is None:
            return
        try:
            os.write(self._fd, byte)
        except (BlockingIOError, InterruptedError):
            pass   # the watcher is behind (or stopped): a heartbeat more or less changes nothing
        except OSError:
            self._fd = None   # the watcher is gone

    def heartbeat(self):
        self._say(b"H")

    def arm(self, finished=False):
        """From now on the rank is leaving: a silence of --timeout ends it."""
        self._say(b"F" if finished else b"A")


class NoGuard:
    """Where no watcher could be started: nothing is bounded from outside."""

    def heartbeat(self):
        pass

    def arm(self, finished=False):
        pass


def start(rank, timeout):
    """The watcher of this process (rank: as the launcher numbers it, for the
    line), or NoGuard when it cannot be started (the rank goes on without)."""
    read_fd, write_fd = os.pipe()
    try:
        process = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCH, str(os.getpid()), str(rank),
                                    socket.gethostname(), repr(float(timeout)), str(read_fd)],
                         pass_fds=(read_fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        return NoGuard()
    os.close(read_fd)
    os.set_blocking(write_fd, False)
    os.set_inheritable(write_fd, False)
    return ExitGuard(write_fd, process)
