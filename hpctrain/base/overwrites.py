"""Outputs that would overwrite the run's own inputs, refused before anything
is read or written: the one check every command makes (train's --save,
--metrics, --timeline, --keep-best, --checkpoint-dir, --tensorboard at
start-up, run/outputs.py; predict's --out, evaluate's and plot's pictures;
`data prepare`'s --out), so that a typo cannot replace the user's model code
by HDF5, a prepared set's shard or manifest by a metrics file, or a
checkpoint by --save.

Paths are compared as the file system sees them, whatever their spelling
(relative, `./`, `..`, symbolic links: their real paths; a hard link: the
same inode). An output is refused when it
- is an input file;
- lies inside an input folder: anywhere inside one read whole (--data, a
  checkpoint folder given to predict), or under one of the names that count
  in a folder read in part (a checkpoint's name in --checkpoint-dir, and
  anything inside a checkpoint that is a folder); or is a hard link of a file
  there;
- is a folder that holds an input, where the folder's own writes could touch
  it: any input inside a folder replaced or written whole (prepare's --out,
  --tensorboard), an input of the names it writes (--checkpoint-dir's
  checkpoints).
An input may name the output that writes it too (`writer`: the checkpoints
that --checkpoint-dir both resumes from and writes): that pair is no conflict.

    python -c "from hpctrain.base.overwrites import Input, Output, check_not_inputs"

Standard library only: it sits at the bottom, under data/ and run/.
"""
import os
import re
from typing import NamedTuple, Optional

from .errors import HpctrainError


class Input(NamedTuple):
    """A file or folder the command reads. what: how the line names it ("the
    --model file"); names: for a folder read in part, a compiled pattern of
    the names inside it that count, with all they hold (None: the whole
    folder counts); inside:
    False for a folder whose contents are not themselves the input (prepare's
    --source: only replacing it harms it); writer: the output flag that also
    writes it."""
    path: str
    what: str
    names: Optional[re.Pattern] = None
    inside: bool = True
    writer: Optional[str] = None


class Output(NamedTuple):
    """A file or folder the command writes. folder: it is a folder; names:
    the names it writes in it (a compiled pattern; None: anything, or the
    folder replaced whole)."""
    path: str
    flag: str
    folder: bool = False
    names: Optional[re.Pattern] = None


def check_not_inputs(outputs, inputs):
    """Raise HpctrainError, one line naming the flag and the input
    (`--save X would overwrite the run's input Y (the --model file)`), for
    the first output that would overwrite or write into one of the inputs.
    None paths are skipped on both sides."""
    inputs = [i for i in inputs if i.path]
    for out in outputs:
        if not out.path:
            continue
        for given in inputs:
            if given.writer is not None and given.writer == out.flag:
                continue
            why = conflict(out, given)
            if why:
                raise HpctrainError(f"{out.flag} {out.path} {why}")


def conflict(out, given):
    """The words for how `out` would harm the input `given`, or None."""
    real, top = os.path.realpath(out.path), os.path.realpath(given.path)
    folder = os.path.isdir(top)
    if not folder:
        if _same_file(out.path, given.path):
            return f"would overwrite the run's input {given.path} ({given.what})"
        if out.folder and _within(top, real) and _writes(out, top, real):
            return f"would write over the run's input {given.path} ({given.what}), which it holds"
        return None
    if real == top:
        return f"would write into the run's input {given.path} ({given.what})"
    if out.folder and _within(top, real) and _writes(out, top, real):
        return f"would write over the run's input {given.path} ({given.what}), which it holds"
    if not given.inside:
        return None
    if _within(real, top) and _counts(given, real, top):
        if os.path.lexists(real) and not os.path.isdir(real) and not out.folder:
            return f"would overwrite the run's input {out.path} (a file of {given.what} {given.path})"
        if given.names is not None:   # a name the folder's own files take (a later checkpoint's)
            return (f"would write inside the run's input {given.path} ({given.what}) under one of its own "
                    f"names; name another file")
        return f"would write inside the run's input {given.path} ({given.what}); name a path elsewhere"
    linked = None if out.folder else _linked_from(out.path, given)
    if linked:
        return (f"would overwrite the run's input {linked} (a file of {given.what} {given.path}; {out.path} is "
                f"a hard link of it)")
    return None


def _same_file(a, b):
    """a and b name one file: the same real path, or the same inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _within(path, top):
    """path is top or below it (both real paths)."""
    return os.path.commonpath([path, top]) == top


def _counts(given, real, top):
    """A path inside the input folder `top` counts as the input: anything,
    or for a folder read in part, a name of its pattern directly in it and
    what that holds (a checkpoint folder's files)."""
    return given.names is None or _named(given.names, real, top)


def _writes(out, inner, real):
    """The output folder `real` writes where the input `inner` (inside it) is:
    anywhere, or only the names of its pattern directly in it (and in them)."""
    return out.names is None or _named(out.names, inner, real)


def _named(names, path, top):
    """path (inside top) is, or lies inside, an entry of top of these names."""
    first = os.path.relpath(path, top).split(os.sep)[0]
    return first not in (os.curdir, os.pardir) and bool(names.match(first))


def _linked_from(path, given):
    """The file in the input folder that `path` (an existing file) is a hard
    link of, or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_nlink < 2:
        return None
    for top, _, names in os.walk(given.path):
        for name in names:
            other = os.path.join(top, name)
            if given.names is not None and not _named(given.names, other, given.path):
                continue
            try:
                ost = os.lstat(other)
            except OSError:
                continue
            if (ost.st_dev, ost.st_ino) == (st.st_dev, st.st_ino):
                return other
    return None
