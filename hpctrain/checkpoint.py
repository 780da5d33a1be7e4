"""The checkpoint command: list a --checkpoint-dir's checkpoints, newest
first, verify each and show its tensors by name, dtype and shape (the
formats: checkpoints/named.py's folders of named tensors, each rank file
hashed; the old flat files (checkpoints/file.py), their flat datasets; the checks:
checkpoints/read_back.py).

    python -m hpctrain.checkpoint DIR      # exit 1 if one is corrupt, 2 if DIR is not a directory
"""
import os
import sys

import numpy as np

from .checkpoints.file import list_checkpoints
from .checkpoints.named import is_named, open_checkpoint
from .checkpoints.read_back import read
from .checkpoints.trust import Corrupt
from .flags.arguments import Parser
from .base.errors import HpctrainError, one_line_errors
from .run.identity import SAME_ON_RESUME, unused_by


@one_line_errors   # its stop signals: one line (errors.stops_as_errors)
def main(argv=None, prog="python -m hpctrain.checkpoint"):
    """List DIR's checkpoints newest first, verify each and list its tensors
    (exit 1 if any is corrupt; 2, with one line, if DIR is not a directory)."""
    p = Parser(prog=prog, description="List and verify the checkpoints in a --checkpoint-dir.")
    p.add_argument("dir", help="checkpoint directory")
    try:
        a = p.parse_args(argv)
        found = _cli_listing(a.dir)
    except HpctrainError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return e.exit_code
    if not found:
        print(f"{a.dir}: no checkpoints (ckpt-NNNNNNNN/ or ckpt-NNNNNNNN.h5) in it")
    bad = 0
    for named, path in found:
        try:
            c, tensors = _verified(path)
            if c.step != named:
                raise Corrupt(f"its name says step {named} but it holds step {c.step}")
            unused = unused_by(c.attrs.get("optimizer"))   # an Adam run lists no momentum
            keys = ", ".join(f"{k} {c.attrs[k]}" for k in SAME_ON_RESUME if k in c.attrs and k not in unused)
            print(f"{c.name}: ok, step {c.step}, {keys}")
            width = max((len(name) for name, _ in tensors), default=0)
            for name, what in tensors:
                print(f"  {name:<{width}}  {what}")
        except Corrupt as e:
            bad += 1
            print(f"{os.path.basename(path)}: corrupt ({e})")
    return 1 if bad else 0


def _verified(path):
    """A checkpoint read and verified whole, and [(name, "dtype shape")] of
    what it holds: a folder's named tensors (a tied tensor's alias as "-> the
    tensor", "(transposed)" where it is read so) and
    the datasets its index holds whole; a flat file's datasets."""
    if is_named(path):
        with open_checkpoint(path) as c:
            c.verify()
            tensors = [(n, _described(dtype, shape)) for n, (shape, dtype) in c.tensors.items()]
            tensors += [(alias, f"-> {n}{' (transposed)' if t else ''}") for alias, (n, t) in c.aliases.items()]
            tensors += [(n, _described((a := c.small(n)).dtype, a.shape)) for n in c.smalls]
        return c, tensors
    c = read(path)
    flat = {"params": c.params, **{f"optimizer/{n}": a for n, a in c.optimizer_state.items()},
            "data_positions": c.data_positions, **{f"compression/{n}": a for n, a in c.compression_state.items()}}
    if c.model_state.size:
        flat["model_state"] = c.model_state
    return c, [(n, _described(a.dtype, a.shape)) for n, a in flat.items()]


def _described(dtype, shape):
    return f"{np.dtype(dtype).name} {tuple(shape)}"


def _cli_listing(directory):
    """list_checkpoints for the CLI, where a missing directory or a file is
    a mistake to say, not an empty listing."""
    if os.path.isfile(directory):
        raise HpctrainError(f"{directory}: is a file; give the checkpoint directory (--checkpoint-dir) "
                            f"that holds it")
    if not os.path.isdir(directory):
        raise HpctrainError(f"{directory}: no such directory")
    try:
        return list_checkpoints(directory)
    except HpctrainError as e:
        raise HpctrainError(str(e).removeprefix("--checkpoint-dir ")) from None


if __name__ == "__main__":
    sys.exit(main())
