"""The files a run writes (--save, --metrics, --timeline, --keep-best, --checkpoint-dir),
checked before the first step on the rank that writes them.

A run that trains for hours and then finds it cannot write its result has
lost the result, so every output is tried up front: its directory exists and
takes a new file (a real file is created and removed: access() says yes to
root on a read-only mount's files), it is not a directory, and no two flags
name the same file.

Temporary files (the parameters file, a checkpoint, the metrics file being
rewritten on resume) are made by files.temp_name_next_to: created exclusively (O_EXCL)
in the target's own directory, so the rename into place stays on
one filesystem, named `.<name>.tmp-<pid>-<random>`: nobody can predict the
name (a planted symlink is never followed) and the pid tells the next start
whether its writer is gone. The writer removes its file on every exit path it
controls (try/finally: errors, disk full, Ctrl-C); what a killed writer left
behind is swept at the next start (`sweep_stale_temporaries`, from
check_outputs on the chief): only names of our own patterns, only files last
written before this process started, and only when their writer's pid is no
longer running (names without a pid, from older versions: when untouched for
an hour). One job per output file and checkpoint directory, as always; a pid
is checked on this node only.

No output may overwrite one of the run's inputs, however the path is spelt
(hpctrain/base/overwrites.py, the one check: run_inputs and run_outputs list a
training run's). The one-process commands' outputs (predict's --out,
evaluate's and plot's pictures) are checked the same way by
`check_output_file`, and written whole by files.write_atomically (a temporary file renamed).

    python -c "from hpctrain.run.outputs import check_outputs"   # used by run/startup.py
"""
import os
import re
import shutil
import stat
import tempfile

from ..checkpoints import file as checkpoint_file
from ..base.errors import HpctrainError
from ..base.files import abandoned, process_start_time
from ..flags.model_names import is_model_file
from ..base.overwrites import Input, Output, check_not_inputs

FILE_FLAGS = ("save", "metrics", "timeline", "keep_best")
# A checkpoint's name in --checkpoint-dir, which no other output may take
CHECKPOINT_NAME = checkpoint_file.ANY_NAME_RE


def check_outputs(args, data_dir=None):
    """Raise HpctrainError (one line naming the flag) unless every output the
    flags name can be written and none would overwrite the run's inputs
    (data_dir: the --data folder the run reads). Creates --checkpoint-dir
    if missing."""
    seen = {}
    files = [(getattr(args, name, None), f"--{name.replace('_', '-')}") for name in FILE_FLAGS]
    for path, flag in filter(lambda f: f[0], files):
        real = os.path.realpath(path)
        if real in seen:
            raise HpctrainError(f"{flag} and --{seen[real]} both name {path}: give each its own file")
        seen[real] = flag[2:]
    if args.checkpoint_dir and os.path.realpath(args.checkpoint_dir) in seen:
        raise HpctrainError(f"--checkpoint-dir and --{seen[os.path.realpath(args.checkpoint_dir)]} both name "
                            f"{args.checkpoint_dir}")
    check_not_inputs(run_outputs(args), run_inputs(args, data_dir))
    for path, flag in filter(lambda f: f[0], files):
        _check_writable(path, flag)
    if args.checkpoint_dir:
        d = args.checkpoint_dir
        real = os.path.realpath(d)
        if os.path.exists(real) and not os.path.isdir(real):
            raise HpctrainError(f"--checkpoint-dir {d}: exists and is not a directory")
        try:
            os.makedirs(real, exist_ok=True)
        except OSError as e:
            raise HpctrainError(f"--checkpoint-dir {d}: cannot create ({e.strerror})") from None
        _try_write(real, f"--checkpoint-dir {d}")
    sweep_stale_temporaries(args)


def _check_writable(path, flag):
    """path can take a file renamed into place: not a directory, nor a
    device or FIFO, in a directory that exists and takes a new file."""
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise HpctrainError(f"{flag} {path}: is a directory; name a file in it")
    _check_kind(path, flag)
    parent = os.path.dirname(real)
    if not os.path.isdir(parent):
        raise HpctrainError(f"{flag} {path}: directory {parent} does not exist")
    _try_write(parent, f"{flag} {path}")
    if os.path.exists(real) and not os.access(real, os.W_OK):
        raise HpctrainError(f"{flag} {path}: exists and is not writable")


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"))


def _check_kind(path, flag):
    """Refuse a name that holds something other than a regular file: the
    renamed outputs would replace it (as root, --save /dev/null replaced the
    system's /dev/null), and --metrics, written in place, must not follow a
    symlink planted in a shared directory to a file of someone else's."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise HpctrainError(f"{flag} {path}: cannot look at it ({e.strerror})") from None
    if flag == "--metrics" and stat.S_ISLNK(st.st_mode):
        raise HpctrainError(f"--metrics {path}: is a symbolic link (the metrics file is written in place "
                            f"and does not follow links); name the file itself")
    try:
        st = os.stat(path)
    except OSError:
        return   # a dangling symlink: the rename replaces the link itself
    kind = next((what for test, what in _KINDS if test(st.st_mode)), None)
    if kind:
        raise HpctrainError(f"{flag} {path}: exists and is {kind}, not a regular file; name a file")


def _try_write(directory, what):
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".hpctrain-probe-")
    except OSError as e:
        raise HpctrainError(f"{what}: cannot write in {directory} ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)


def check_output_file(path, flag, inputs=()):
    """Raise HpctrainError (one line naming the flag) unless `path` can take
    a file written whole by write_atomically (predict's --out, evaluate's and
    plot's pictures), checked before anything is read or computed: it is
    none of the command's inputs (overwrites.Input: a file, or anything
    inside a folder such as --data or a checkpoint folder, however the path
    is spelt: overwrites.check_not_inputs), its directory exists and takes
    a new file, and the name holds nothing but a regular file (as root, a
    renamed file would replace a device node such as /dev/null)."""
    real = os.path.realpath(path)
    check_not_inputs([Output(path, flag)], inputs)
    if not os.path.isdir(os.path.dirname(real)):
        raise HpctrainError(f"{flag} {path}: no such directory {os.path.dirname(real)}")
    _check_writable(path, flag)


def run_inputs(args, data_dir):
    """What a training run reads, for check_not_inputs: the --model file,
    the --data folder (its shards and manifest), the checkpoints in
    --checkpoint-dir (which a resume reads), the --config file and the
    --init-from model (file or folder)."""
    inputs = [Input(data_dir, "the --data folder")]
    model, checkpoint_dir = getattr(args, "model", None), getattr(args, "checkpoint_dir", None)
    if model and is_model_file(model):
        inputs.append(Input(model.rpartition(":")[0], "the --model file"))
    if checkpoint_dir:
        inputs.append(Input(checkpoint_dir, "the --checkpoint-dir folder", names=CHECKPOINT_NAME,
                            writer="--checkpoint-dir"))
    if getattr(args, "config", None):
        inputs.append(Input(args.config, "the --config file"))
    if getattr(args, "init_from", None):
        inputs.append(Input(args.init_from, "the --init-from model"))
    return inputs


def run_outputs(args):
    """What a training run writes, for check_not_inputs."""
    outputs = [Output(getattr(args, name, None), f"--{name.replace('_', '-')}") for name in FILE_FLAGS]
    outputs.append(Output(getattr(args, "checkpoint_dir", None), "--checkpoint-dir", folder=True,
                          names=CHECKPOINT_NAME))
    outputs.append(Output(getattr(args, "tensorboard", None), "--tensorboard", folder=True))
    return outputs


# ---------------------------------------------------------------------------
# temporary files

# After "<name>.tmp-": this version's "<pid>-<random>", or what older versions
# wrote: "<pid>" (checkpoints, metrics, timeline) or mkstemp's "<random>" (--save).
_TMP_SUFFIX = r"\.tmp-(?:(?P<pid>\d+)(?:-[a-z0-9_]{8})?|[a-z0-9_]{8})"
# a flat checkpoint's temporary file, or a checkpoint folder's (checkpoints/named.py:
# one being written, or an old one renamed aside to be removed)
_CKPT_TMP_RE = re.compile(r"^\.ckpt-\d{8,}(?:\.h5)?" + _TMP_SUFFIX + "$")


def sweep_stale_temporaries(args, started=None):
    """Remove the temporary files that killed runs left next to --save,
    --metrics, --timeline and in --checkpoint-dir, where a checkpoint
    folder's temporary folders too (see the module's docstring for which). Returns the paths removed. Never raises: a file
    that cannot be removed is left as it was. started: older than this
    (time.time()) counts as left behind; default this process's start
    (--on-failure shrink's rebuild: the recovery's, run/survival.py)."""
    started = process_start_time() if started is None else started
    removed = []
    targets = []
    for flag in FILE_FLAGS:
        path = getattr(args, flag, None)
        if path:
            base = re.escape(os.path.basename(os.path.abspath(path)))
            targets.append((os.path.dirname(os.path.abspath(path)),
                            re.compile(rf"^\.?{base}{_TMP_SUFFIX}$"), False))
    if getattr(args, "checkpoint_dir", None):
        targets.append((os.path.abspath(args.checkpoint_dir), _CKPT_TMP_RE, True))
    for directory, pattern, folders in targets:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            m = pattern.match(name)
            if not m:
                continue
            path = os.path.join(directory, name)
            pid = int(m.group("pid")) if m.group("pid") else None
            try:
                if abandoned(path, pid, started):
                    os.unlink(path)
                    removed.append(path)
                elif folders and abandoned(path, pid, started, kind=stat.S_ISDIR):
                    shutil.rmtree(path)
                    removed.append(path)
            except OSError:
                pass
    return removed
