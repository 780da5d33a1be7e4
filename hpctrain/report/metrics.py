"""The --metrics file: JSON Lines, written live by the chief alone, resumed
runs keeping the records up to their checkpoint (report/report.py writes
the records; this keeps the file).

    mpirun -n 2 python -m hpctrain.mnist --steps 300 --metrics m.jsonl && tail -1 m.jsonl
"""
import json
import os
import sys

from ..base.errors import HpctrainError
from ..base.files import one_line, open_in_place, write_atomically


class Metrics:
    """The --metrics file, JSON Lines, written by the chief alone (the other
    ranks hold Metrics(None), which writes nothing).

    Live: opened for append, every record written as it comes (one write(2)
    of whole lines), so `tail -f` follows a running job and a killed job
    keeps what it logged. Opened without following a symlink at its name
    (files.open_in_place), as check_outputs refused one before.
    `resume_at(step)`, called by the loops once the resume is decided, says
    where this run starts: None (or 0) for a fresh run, whose file starts
    anew; a checkpoint's step for a resumed one, whose file keeps the records
    up to that step (an earlier final record and anything past the
    checkpoint are dropped: they will be logged again) and then goes on, so
    the file holds every logged step once, in order, and one final record.
    The kept part is rewritten to an exclusive temporary file and renamed
    into place; a write before resume_at starts the file anew.

    A file that cannot be written any more (a full disk, a file-size limit)
    costs the records, not the run: one warning line, the file cut back to
    its last whole record, and training, checkpoints and --save go on."""

    def __init__(self, path):
        self.path = path
        self._fd = None
        self._whole = 0       # bytes of whole records in the file
        self._failed = False  # a write failed: nothing more is written

    def whole(self):
        """Whether this rank keeps the file and every record reached it."""
        return bool(self.path) and not self._failed

    def resume_at(self, step):
        if not self.path or self._fd is not None or self._failed:
            return
        if not step:
            self._open(append=False)
            return
        try:
            with open(open_in_place(self.path, "r")) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        except (OSError, UnicodeDecodeError) as e:
            raise HpctrainError(f"--metrics {self.path}: cannot read to resume it ({getattr(e, 'strerror', e)})")\
                from None
        kept = [line for line in lines if _kept(line, step)]
        if len(kept) != len(lines):
            self._rewrite(kept)
        self._open(append=True)

    def _open(self, append):
        try:
            self._fd = open_in_place(self.path, "a" if append else "w")
            self._whole = os.fstat(self._fd).st_size
        except OSError as e:
            raise HpctrainError(f"--metrics {self.path}: cannot open ({one_line(e)})") from None

    def _rewrite(self, lines):
        try:
            write_atomically(self.path, lambda f: f.write("".join(line + "\n" for line in lines)))
        except OSError as e:
            raise HpctrainError(f"--metrics {self.path}: cannot rewrite to resume it ({one_line(e)})") from None

    def write(self, record):
        if not self.path or self._failed:
            return
        if self._fd is None:
            self.resume_at(None)
        data = (json.dumps(record) + "\n").encode()
        try:
            done = 0
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as e:
            self._give_up(record, e)
            return
        self._whole += len(data)

    def _give_up(self, record, error):
        """One line, the half-written record cut off, no more writes."""
        self._failed = True
        try:
            os.ftruncate(self._fd, self._whole)
        except OSError:
            pass
        self.close()
        at = record.get("step", record.get("steps"))
        print(f"hpctrain: warning: --metrics {self.path}: cannot write ({one_line(error)}); records from "
              f"step {at} on are not in it, training goes on", file=sys.stderr, flush=True)

    def close(self):
        """Close the file (every record is already in it: a live file is
        never removed, so there is nothing to keep or drop)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _kept(line, step):
    """Whether a record of the metrics file stays when the run resumes at `step`."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return False   # a line a killed writer left half-written (or nested past what json parses)
    if not isinstance(record, dict) or record.get("event") == "final":
        return False
    at = record.get("step")
    return isinstance(at, int) and at <= step
