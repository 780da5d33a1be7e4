"""--tensorboard DIR: the run's scalars as TensorBoard event files, written
by the chief through tensorboardX (an optional dependency:
pip install 'hpctrain[tensorboard]').

    mpirun -n 4 python -m hpctrain.train --tensorboard runs/mnist --eval-every 200
    tensorboard --logdir runs

Tags: train/loss, train/lr, train/samples_per_s, train/grad_norm (with
--clip-norm) at each progress line; eval/test_accuracy, eval/test_loss
(eval/val_accuracy, eval/val_loss with a validation part) at each
--eval-every and at the end. What the report writes to --metrics, the same
numbers at the same steps (report.py calls `write` with each record).

Each record is written and flushed as it comes (fsync'd), so TensorBoard
follows a live run and a killed run keeps what it logged. A resumed run
writes a new event file in the same DIR that starts with TensorBoard's
restart marker (SessionLog START at the step after its checkpoint): the
steps an interrupted run logged past its checkpoint are dropped from view
and logged again, so the run reads as one. What cannot be written (a full
disk, a directory gone) is one warning line and no more events: training,
checkpoints and --save go on, as for --metrics. The writer is tensorboardX's
synchronous EventsWriter (its record format and checksums), not its
SummaryWriter, whose background thread would swallow a write error.

No MPI here: the report calls it on the chief.
"""
import os
import sys
import time

from ..base.errors import HpctrainError
from ..base.files import one_line

INSTALL = "--tensorboard needs tensorboardX, an optional dependency: pip install 'hpctrain[tensorboard]'"
TRAIN_TAGS = {"loss": "train/loss", "samples_per_s": "train/samples_per_s", "tokens_per_s": "train/tokens_per_s",
              "grad_norm": "train/grad_norm", "lr": "train/lr"}
EVAL_TAGS = {"test_accuracy": "eval/test_accuracy", "test_loss": "eval/test_loss",
             "val_accuracy": "eval/val_accuracy", "val_loss": "eval/val_loss"}


def _modules():
    try:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.summary import scalar
    except ImportError:
        raise HpctrainError(INSTALL) from None
    return EventsWriter, Event, SessionLog, scalar


def check(args):
    """At start-up, on every rank: tensorboardX is there and DIR can be a directory."""
    path = getattr(args, "tensorboard", None)
    if not path:
        return
    _modules()
    if os.path.exists(path) and not os.path.isdir(path):
        raise HpctrainError(f"--tensorboard {path}: exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        # Checked by kind, not by access: os.access(FILE, X_OK) is true for an
        # executable file, which let FILE/sub through to a warning at the first write.
        raise HpctrainError(f"--tensorboard {path}: is under {parent}, which is a file, not a directory")
    target = path if os.path.isdir(path) else parent
    if not os.access(target, os.W_OK | os.X_OK):
        raise HpctrainError(f"--tensorboard {path}: cannot write in {target}")


class Board:
    """The chief's event file (path None elsewhere: writes nothing).
    lr(step): the learning rate of 0-based step (run/plan.Plan.lr)."""

    def __init__(self, path, lr=None):
        self.path, self.lr = path, lr
        self._writer = None
        self._failed = False

    def whole(self):
        """Whether this rank keeps the event file and every write reached it."""
        return bool(self.path) and not self._failed

    def resume_at(self, step):
        """Open this run's event file; a resumed run (step > 0) marks the restart."""
        if not self.path or self._writer is not None or self._failed:
            return
        EventsWriter, Event, SessionLog, _ = _modules()
        try:
            os.makedirs(self.path, exist_ok=True)
            # tensorboardX names the file by the second; TensorBoard reads a run's files in name
            # order: the microseconds and the pid after it keep a run resumed within the same
            # second in a file of its own, sorted after the one it resumes.
            suffix = f".{time.time_ns() // 1000 % 10**6:06d}.{os.getpid()}"
            self._writer = EventsWriter(os.path.join(self.path, "events"), suffix)
            if step:
                self._writer.write_event(Event(step=int(step) + 1, session_log=SessionLog(status=SessionLog.START)))
            self._writer.flush()
        except OSError as e:
            self._give_up(step or 0, e)

    def write(self, record):
        """One --metrics record's scalars, flushed."""
        if not self.path or self._failed:
            return
        if self._writer is None:
            self.resume_at(None)
            if self._failed:
                return
        _, Event, _, scalar = _modules()
        final_or_eval = record.get("event") in ("eval", "final")
        step = int(record["steps"] if record.get("event") == "final" else record["step"])
        tags = EVAL_TAGS if final_or_eval else TRAIN_TAGS
        values = [(tags[k], float(v)) for k, v in record.items() if k in tags and v is not None]
        if not final_or_eval and self.lr is not None and "lr" not in record:
            values.append(("train/lr", float(self.lr(step - 1))))
        try:
            for tag, value in values:
                self._writer.write_event(Event(step=step, summary=scalar(tag, value)))
            self._writer.flush()
        except OSError as e:
            self._give_up(step, e)

    def _give_up(self, step, error):
        self._failed = True
        self.close()
        print(f"hpctrain: warning: --tensorboard {self.path}: cannot write ({one_line(error)}); events from step "
              f"{step} on are not in it, training goes on", file=sys.stderr, flush=True)

    def close(self):
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except OSError:
                pass
