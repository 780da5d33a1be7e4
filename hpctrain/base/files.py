"""Files written whole and safely, for every part of hpctrain that writes
one: training's outputs (--save, --metrics, --timeline, checkpoints, run/outputs
checks them at start-up), the one-process commands' (predict's --out, the
pictures), and `data prepare`'s temporary folder. Nothing here knows a run:
it sits at the bottom, so that checkpoints/, report/, pipeline/ and trained.py
need not import run/ for a temporary file.

- `temp_name_next_to`, `create_new`, `remove_temp`: a new file beside its
  target, in the target's own directory (the rename into place stays on one
  filesystem), named `.<name>.tmp-<pid>-<random>`: nobody can predict the
  name, it is created exclusively (O_EXCL: a planted symlink is never
  followed), and the pid tells the next start whether its writer is gone;
- `write_atomically`: a file written whole or not at all;
- `open_in_place`: the --metrics file, written in place, never through a symlink;
- `abandoned`: whether a temporary file or folder is one a killed writer left
  behind (named with its writer's pid, last written before this process
  started, that pid no longer running on this node), for the sweeps at start
  (run/outputs.sweep_stale_temporaries, data/stopping.py);
- `one_line`, `printable`: an OSError's reason, a name, on one line;
- `rescue_path`: where parameters go when --save fails.

    python -c "from hpctrain.base.files import temp_name_next_to, write_atomically, abandoned"
"""
import errno
import os
import re
import secrets
import stat
import tempfile
import time

from .errors import HpctrainError

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


def open_in_place(path, mode):
    """The --metrics file as a raw fd, opened without following a symlink at
    its name (O_NOFOLLOW) and only if it is a regular file: a FIFO or device
    put there after check_outputs is refused, not used (O_NONBLOCK: opening a
    FIFO with no peer does not block). mode "r": read it; "a": append to
    what it holds; "w": it starts empty. Raises OSError, or HpctrainError for
    a symlink or something that is not a regular file."""
    flags = {"r": os.O_RDONLY, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "w": os.O_WRONLY | os.O_CREAT}[mode]
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise HpctrainError(f"--metrics {path}: is a symbolic link (the metrics file is written in place "
                                f"and does not follow links); name the file itself") from None
        if e.errno == errno.ENXIO:   # a FIFO without a reader, a device without its device
            raise HpctrainError(f"--metrics {path}: is not a regular file; name a file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HpctrainError(f"--metrics {path}: is not a regular file; name a file")
        os.set_blocking(fd, True)
        if mode == "w":
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_atomically(path, write, binary=False):
    """path written whole or not at all: write(f) fills a new temporary file
    beside it (temp_name_next_to), which is flushed to disk, given the mode of the
    file it replaces and renamed onto path. Raises OSError (a directory that
    takes no file, a full disk), the temporary removed and path as it was."""
    tmp = temp_name_next_to(path)
    try:
        with os.fdopen(create_new(tmp), "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        _keep_mode(path, tmp)
        os.replace(tmp, path)
    finally:
        remove_temp(tmp)


def _keep_mode(path, tmp):
    """The new file keeps the permissions of the one it replaces."""
    try:
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
    except FileNotFoundError:
        pass


def printable(text):
    """text for a line of a table or an error: control characters (a class
    folder named with a newline) escaped as Python writes them, so one name
    stays on one line; letters of any script left as they are."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def one_line(error):
    """An OSError's reason on one line: HDF5's messages span several (an
    error line is one line) and bury the system's reason in a report of
    buffers and offsets: where they name an errno, its text is the reason."""
    text = str(getattr(error, "strerror", None) or error)
    found = re.search(r"\berrno = (\d+)", text)
    if found:
        return os.strerror(int(found.group(1)))
    return " ".join(text.split())


def rescue_path(step):
    """Where parameters go when --save fails at the end and no checkpoint holds
    them: the system's temporary directory (TMPDIR), a name no one else has."""
    fd, path = tempfile.mkstemp(prefix=f"hpctrain-params-step{step}-", suffix=".h5")
    os.close(fd)
    return path


def temp_name_next_to(path):
    """A name for `path`'s new content in its own directory (the rename into
    place stays on one filesystem): `.<name>.tmp-<pid>-<random>`, which nobody
    can predict and whose pid says whose it is. Nothing is created: the
    caller holds the name first, then makes the file (create_new) inside
    the try whose finally removes it (remove_temp), so that an interrupt
    (Ctrl-C raises anywhere a Python function starts) between making the file
    and holding its name cannot leave it behind."""
    return os.path.join(os.path.dirname(os.path.abspath(path)),
                        f".{os.path.basename(path)}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def create_new(tmp):
    """Create tmp exclusively (O_EXCL: a planted symlink is never followed),
    with the mode a plain open() gives; return its fd, open for writing."""
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)


def remove_temp(tmp):
    """A temporary that was not renamed into place, removed (if it exists)."""
    if tmp is not None and os.path.lexists(tmp):
        os.unlink(tmp)
