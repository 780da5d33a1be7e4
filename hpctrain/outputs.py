"""The files a run writes (--save, --metrics, --timeline, --checkpoint-dir),
checked before the first step on the rank that writes them.

A run that trains for hours and then finds it cannot write its result has
lost the result, so every output is tried up front: its directory exists and
takes a new file (a real file is created and removed: access() says yes to
root on a read-only mount's files), it is not a directory, and no two flags
name the same file.

    python -c "from hpctrain.outputs import check_outputs"   # used by train.Run
"""
import os
import tempfile

from .errors import HpctrainError

FILE_FLAGS = ("save", "metrics", "timeline")


def check_outputs(args):
    """Raise HpctrainError (one line naming the flag) unless every output the
    flags name can be written. Creates --checkpoint-dir if missing."""
    seen = {}
    for flag in FILE_FLAGS:
        path = getattr(args, flag)
        if not path:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise HpctrainError(f"--{flag} and --{seen[real]} both name {path}: give each its own file")
        seen[real] = flag
        if os.path.isdir(real):
            raise HpctrainError(f"--{flag} {path}: is a directory; name a file in it")
        parent = os.path.dirname(real)
        if not os.path.isdir(parent):
            raise HpctrainError(f"--{flag} {path}: directory {parent} does not exist")
        _try_write(parent, f"--{flag} {path}")
        if os.path.exists(real) and not os.access(real, os.W_OK):
            raise HpctrainError(f"--{flag} {path}: exists and is not writable")
    if args.checkpoint_dir:
        d = args.checkpoint_dir
        real = os.path.realpath(d)
        if real in seen:
            raise HpctrainError(f"--checkpoint-dir and --{seen[real]} both name {d}")
        if os.path.exists(real) and not os.path.isdir(real):
            raise HpctrainError(f"--checkpoint-dir {d}: exists and is not a directory")
        try:
            os.makedirs(real, exist_ok=True)
        except OSError as e:
            raise HpctrainError(f"--checkpoint-dir {d}: cannot create ({e.strerror})") from None
        _try_write(real, f"--checkpoint-dir {d}")


def _try_write(directory, what):
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".hpctrain-probe-")
    except OSError as e:
        raise HpctrainError(f"{what}: cannot write in {directory} ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)


def rescue_path(step):
    """Where parameters go when --save fails at the end and no checkpoint holds
    them: the system's temporary directory (TMPDIR), a name no one else has."""
    fd, path = tempfile.mkstemp(prefix=f"hpctrain-params-step{step}-", suffix=".h5")
    os.close(fd)
    return path
