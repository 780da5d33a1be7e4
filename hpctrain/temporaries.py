"""Whether a temporary file or folder is one a killed writer left behind:
named with its writer's pid, last written before this process started, and
that pid no longer running on this node. Shared by training's outputs
(run/outputs.py: --save, --metrics, checkpoints) and `data prepare`'s
temporary folder (data/prepare.py), which sit at different layers.

    python -c "from hpctrain.temporaries import abandoned, process_start_time"
"""
import os
import stat
import time

# Names without a pid (older versions' files) are swept only when untouched this long.
STALE_AFTER_S = 3600.0


def abandoned(path, pid, started, kind=stat.S_ISREG):
    """True if path (of this kind: a regular file, or stat.S_ISDIR) was left
    by a writer that is gone: last written before `started` (this process's
    start: anything newer may be a running job's, on another node too), and
    its writer's pid not running here (or ours: a pid reused). pid None: when
    untouched for STALE_AFTER_S."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not kind(st.st_mode) or st.st_mtime >= started:
        return False
    if pid is not None:
        return pid == os.getpid() or not pid_running(pid)
    return time.time() - st.st_mtime > STALE_AFTER_S


def pid_running(pid):
    """True if a process with this pid exists on this node."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # someone else's process
    except (OverflowError, ValueError, OSError):
        return False
    return True


def process_start_time():
    """When this process started (seconds since the epoch, to the second at
    worst); now where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])   # field 22, starttime, in clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        # btime is whole seconds: a second earlier, so that nothing written
        # after this process started can look older than it.
        return boot + ticks / os.sysconf("SC_CLK_TCK") - 1.0
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()
