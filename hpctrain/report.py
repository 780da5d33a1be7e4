"""What a run tells its user: progress lines, the --metrics records, test-set
(and validation-part) evaluations, the final record, the --save parameters
file and the --keep-best one.

The chief writes everything: records, evaluations' lines, files. The loops
call these under an explicit `if chief:`, except the two collectives that
every worker joins (`evaluate`, `peak_memory_and_step_medians`) and, in
async ps mode, `progress`: every worker prints its own progress lines (its
records go nowhere: a rank other than the chief holds a Metrics that
writes nothing). What the chief does alone while the others wait for it
(evaluations, --keep-best, the final line and files) runs under the
watchdog's `busy`: their deadline waits for it as long as the chief
answers (comm/deadline.py), and each file it reads or writes meanwhile has
the chief's own deadline.

    mpirun -n 2 python -m hpctrain.mnist --steps 300 --metrics m.jsonl --save p.h5
    mpirun -n 2 python -m hpctrain.mnist --data data/mnist-val --eval-every 50 --keep-best best.h5
"""
import json
import os
import stat
import sys
import time

import numpy as np
from mpi4py import MPI

from . import data as data_mod
from . import device, trained
from .errors import HpctrainError
from .outputs import one_line, open_in_place, rescue_path, temp_next_to
from .session import agreed
from .tensorboard import Board


class Metrics:
    """The --metrics file, JSON Lines, written by the chief alone (the other
    ranks hold Metrics(None), which writes nothing).

    Live: opened for append, every record written as it comes (one write(2)
    of whole lines), so `tail -f` follows a running job and a killed job
    keeps what it logged. Opened without following a symlink at its name
    (outputs.open_in_place), as check_outputs refused one before.
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
        fd, tmp = temp_next_to(self.path)
        try:
            with os.fdopen(fd, "w") as f:
                f.write("".join(line + "\n" for line in lines))
                f.flush()
                os.fsync(f.fileno())
            _same_mode(self.path, tmp)
            os.replace(tmp, self.path)
        except OSError as e:
            raise HpctrainError(f"--metrics {self.path}: cannot rewrite to resume it ({one_line(e)})") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

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


def eta_text(seconds):
    """42s, 1m23s, 2h05m: short enough for a progress line."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


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


def _same_mode(path, tmp):
    """The rewritten file keeps the permissions of the one it replaces."""
    try:
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
    except FileNotFoundError:
        pass


class Report:
    """The chief's lines and records for one run."""

    def __init__(self, session, config):
        self.session = session
        self.args = session.args
        self.steps = config.steps   # the run's last step (config.py)
        # Async ps workers print their own progress lines; only the chief writes files.
        self.metrics = Metrics(session.args.metrics if session.chief else None)
        # --tensorboard: the same records as TensorBoard scalars (tensorboard.py), the chief's
        self.board = Board(session.args.tensorboard if session.chief else None, lr=config.lr)
        self._full = {}   # split -> the whole split (uint8), read once by the chief
        self._last_eval = None
        # --keep-best: (val accuracy, step) of the best validation so far. It
        # goes into every checkpoint (checkpoint_attrs) and comes back on
        # resume, so a resumed run keeps the file an uninterrupted run keeps.
        self.best = None
        self._final_val = None   # (loss, accuracy) on the val part at the end (final_val)
        self._mark = None   # (step, wall time) of the last progress line, for the ETA

    def resume_at(self, step, resume=None):
        """Where this run starts (None: step 0): the metrics file keeps the
        records up to it, and the first ETA counts the steps from it. The
        chief takes the best validation so far from resume's checkpoint."""
        ckpt = getattr(resume, "checkpoint", None)
        if ckpt is not None and ckpt.attrs.get("best_val_step", -1) >= 0:
            self.best = (float(ckpt.attrs["best_val_accuracy"]), int(ckpt.attrs["best_val_step"]))
        self.metrics.resume_at(step)
        self.board.resume_at(step)
        self._mark = (step or 0, time.perf_counter())

    def progress(self, step, loss, samples, t_loop, worker=None, local_step=None, grad_norm=None):
        """A progress line and (on the chief) a metrics record. Async ps
        workers each print their own line, as in the tutorial: `worker` and
        `local_step` say whose it is. grad_norm (--clip-norm): the mean
        pre-clip gradient norm since the last line."""
        elapsed = time.perf_counter() - self.session.t_start
        rate = samples / t_loop if t_loop > 0 else 0.0
        who = f"worker {worker}: " if worker is not None else ""
        local = f"  (local step {local_step})" if local_step is not None else ""
        norm = f"  grad norm {grad_norm:.4g}" if grad_norm is not None else ""
        print(f"{who}step {step:>6}/{self.steps}  loss {loss:.4f}{norm}  "
              f"samples/s {rate:,.0f}  elapsed {elapsed:.1f}s  {self._eta(step)}{local}", flush=True)
        record = {"step": step, "loss": round(float(loss), 6), "samples_per_s": round(rate, 1),
                  "time_s": round(elapsed, 3)}
        if grad_norm is not None:
            record["grad_norm"] = round(float(grad_norm), 6)
        self.metrics.write(record)
        self.board.write(record)

    def _eta(self, step):
        """`eta 1m23s`: the steps left at the rate since the last line (wall
        time, so evaluations and checkpoints count: they are part of the wait).
        Not in the metrics records: it is a guess, derived from them."""
        now = time.perf_counter()
        last_step, last_t = self._mark or (0, self.session.t_start)
        self._mark = (step, now)
        left = max(self.steps - step, 0)
        if not left:
            return "eta 0s"
        if step <= last_step or now <= last_t:
            return "eta ?"
        return "eta " + eta_text(left * (now - last_t) / (step - last_step))

    def periodic_eval(self, model, step):
        """--eval-every N: when `step` reaches a multiple of N (before the last
        step, which the final evaluation covers), the chief evaluates its
        parameters on the whole test set by itself (no collective: in async ps
        mode workers are never at the same step) and logs and records it.
        Returns the seconds spent, which the caller keeps out of samples/s."""
        every = self.args.eval_every
        if self._last_eval is None:  # the first step of this run (or of a resumed one)
            self._last_eval = step - 1
        crossed = bool(every) and step < self.steps and step // every > self._last_eval // every
        self._last_eval = step
        if not crossed:
            return 0.0
        t0 = time.perf_counter()
        with self.session.watchdog.busy():
            self._periodic_eval(model, step)
        return time.perf_counter() - t0

    def _periodic_eval(self, model, step):
        test_loss, test_acc, _ = self.evaluate_alone(model)
        record = {"event": "eval", "step": step, "test_accuracy": round(test_acc, 6),
                  "test_loss": round(test_loss, 6)}
        line = f"test accuracy {test_acc:.4f}  test loss {test_loss:.4f}"
        if self.session.has_val:
            val_loss, val_acc, _ = self.evaluate_alone(model, "val")
            record.update(val_accuracy=round(val_acc, 6), val_loss=round(val_loss, 6))
            line = f"val accuracy {val_acc:.4f}  val loss {val_loss:.4f}  " + line
            self.keep_if_best(model, step, val_acc)
        print(f"step {step:>6}/{self.steps}  {line}", flush=True)
        with self._file_wait(f"writing --metrics {self.args.metrics}"):
            self.metrics.write(record)
            self.board.write(record)

    def _file_wait(self, what):
        """The chief's own deadline on a file it reads or writes while busy."""
        return self.session.watchdog.waiting(what, peer="the file system")

    def keep_if_best(self, model, step, val_acc):
        """--keep-best: write the parameters when val_acc beats every earlier
        validation (strictly: a tie keeps the earlier, smaller step). A failed
        write ends the run: a best file that silently stopped following the
        best would be worse than none."""
        if not self.args.keep_best or (self.best is not None and val_acc <= self.best[0]):
            return
        self.best = (float(val_acc), int(step))
        try:
            with self._file_wait(f"writing --keep-best {self.args.keep_best}"):
                write_params(self.args.keep_best, model, step, self.args, self.session.cluster.size,
                             attrs={"val_accuracy": float(val_acc)})
        except OSError as e:
            raise HpctrainError(f"--keep-best {self.args.keep_best}: cannot write ({one_line(e)})",
                                collective=False) from None

    def final_val(self, model, step):
        """The chief alone (as periodic_eval; the val part is small): val loss
        and accuracy of the final parameters, once, and a --keep-best
        candidate. The loops call it before the final checkpoint, so that
        checkpoint's best includes it (resume keeps the same best) -- but not
        when a signal stopped training early: an uninterrupted run would
        never have evaluated that step."""
        if self._final_val is None:
            with self.session.watchdog.busy():
                val_loss, val_acc, _ = self.evaluate_alone(model, "val")
                self.keep_if_best(model, step, val_acc)
            self._final_val = (val_loss, val_acc)
        return self._final_val

    def checkpoint_attrs(self):
        """What a checkpoint records of this report: the best validation so
        far (--keep-best only: other checkpoints stay as they were)."""
        if not self.args.keep_best:
            return {}
        acc, step = self.best if self.best is not None else (-1.0, -1)
        return {"best_val_accuracy": acc, "best_val_step": step}

    def evaluate_alone(self, model, split="test"):
        """Loss, accuracy and count on the whole test set (or "val" part), this rank alone."""
        if split not in self._full:
            with self._file_wait(f"reading the {split} part of {self.session.data_dir}"):
                self._full[split] = data_mod.load_test(self.session.data_dir, raw=True, split=split)
        x, y = self._full[split]
        xp = self.session.xp
        loss_sum, correct = model.evaluate(xp.asarray(x), xp.asarray(y))
        n = max(len(y), 1)
        return loss_sum / n, correct / n, len(y)

    def final(self, result, step, t_loop, samples, comm_s, compute_s, extra):
        """The chief's last line, --save, the final record, the timeline.
        Returns (record, None), or (record, line) when --save could not be
        written; the line then says where the parameters are kept instead."""
        with self.session.watchdog.busy():
            return self._final(result, step, t_loop, samples, comm_s, compute_s, extra)

    def _final(self, result, step, t_loop, samples, comm_s, compute_s, extra):
        session, args, cluster = self.session, self.args, self.session.cluster
        test_loss, test_acc, n_test = result["test"]
        val = {}
        if session.has_val:
            val_loss, val_acc = self.final_val(result["model"], step)
            val = {"val_accuracy": round(val_acc, 6), "val_loss": round(val_loss, 6)}
            print(f"val accuracy {val_acc:.4f}  val loss {val_loss:.4f}", flush=True)
        wall = time.perf_counter() - session.t_start
        rate = samples / t_loop if t_loop > 0 else 0.0
        print(f"test accuracy {test_acc:.4f}  test loss {test_loss:.4f}  ({n_test} images, "
              f"{step} steps, {rate:,.0f} samples/s, {wall:.1f}s)", flush=True)
        with self._file_wait(f"writing --save {args.save}"):
            save_error = save_params(args.save, result["model"], step, args, cluster.size, result["checkpoint"])
        record = {"event": "final", "mode": args.mode, "world_size": cluster.size, "workers": cluster.num_workers,
                  "steps": step, "global_batch": args.batch_size * args.accumulate_steps * cluster.num_workers,
                  **val, "test_accuracy": round(test_acc, 6), "test_loss": round(test_loss, 6),
                  "wall_s": round(wall, 3), "samples_per_s": round(rate, 1),
                  "comm_s": round(comm_s, 4), "compute_s": round(compute_s, 4),
                  "device": session.device_name}
        record.update(result["medians"])
        record.update(extra or {})
        with self._file_wait(f"writing --metrics {args.metrics}"):
            self.metrics.write(record)
            self.metrics.close()
            self.board.write(record)
            self.board.close()
        with self._file_wait(f"writing --timeline {args.timeline}"):
            session.timeline.write()
        if not save_error:
            session.watchdog.note = results_note(args)   # a line from here on says so
        with self._file_wait("writing HPCTRAIN_FINISHED_FILE"):
            mark_finished(record)
        return record, save_error


def results_note(args):
    """What a deadline line says once the results are written (watchdog.note)."""
    files = ([f"--save {args.save}"] if args.save else []) + \
        ([f"the final record in --metrics {args.metrics}"] if args.metrics else [])
    return f"the run finished and its results are written ({', '.join(files) or 'the final line'})"


def mark_finished(record):
    """HPCTRAIN_FINISHED_FILE (jobs/launch.sh sets it): the final record,
    written by the chief once it has written the results, so the job script
    can bound its wait for a rank that hangs on its way out where no watchdog
    sees it (after MPI_Finalize). A failure is a warning: the results are kept."""
    path = os.environ.get("HPCTRAIN_FINISHED_FILE")
    if not path:
        return
    tmp = None
    try:
        fd, tmp = temp_next_to(path)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        print(f"hpctrain: warning: HPCTRAIN_FINISHED_FILE {path}: cannot write ({e.strerror or e}); the job "
              f"script cannot tell that the run finished", file=sys.stderr, flush=True)
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def evaluate(session, model):
    """Every worker: test loss, accuracy and count, each worker evaluating its
    part of the test set (one Allreduce of the sums)."""
    cluster, xp = session.cluster, session.xp
    x, y = session.test_part()
    loss_sum, correct = model.evaluate(xp.asarray(x), xp.asarray(y))
    totals = np.array([loss_sum, correct, len(y)], np.float64)
    with session.watchdog.waiting("evaluation allreduce", peer=None):
        cluster.worker_comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
    n = max(totals[2], 1)
    return totals[0] / n, totals[1] / n, int(totals[2])


def peak_memory_and_step_medians(session, alone=False):
    """Every worker (or, alone, this one): the median step split from
    session.stats, and peak memory: the largest of any worker (bytes above
    the interpreter with its imports, and in all)."""
    summary = session.stats.summary()
    peak = summary.pop("peak_rss_bytes")
    mem = np.array([peak, peak - summary.pop("base_rss_bytes")], np.float64)
    if not alone:
        with session.watchdog.waiting("memory statistics allreduce", peer=None):
            session.cluster.worker_comm.Allreduce(MPI.IN_PLACE, mem, op=MPI.MAX)
    summary = {k: round(v, 7) for k, v in summary.items()}
    summary["peak_rss_mb"] = round(mem[0] / 2**20, 1)
    summary["peak_rss_above_base_mb"] = round(mem[1] / 2**20, 1)
    return summary


def finish_everywhere(session, report, model, step, t_loop, samples, comm_s, compute_s,
                      checkpoints, extra=None, alone=False):
    """Every worker, at the end of training: the shared evaluation and
    statistics, then the chief's final line and files. If --save failed, every
    worker exits with the chief's line (no abort: nobody is left waiting).
    alone: the chief by itself, no collective (ps: a worker was left behind)."""
    if alone:
        with session.watchdog.busy():
            test = report.evaluate_alone(model)
    else:
        test = evaluate(session, model)
    result = {"test": test, "medians": peak_memory_and_step_medians(session, alone),
              "model": model,
              "checkpoint": checkpoints.saved_path if checkpoints.saved_step == step else None}
    record, save_error = None, None
    if session.chief:
        record, save_error = report.final(result, step, t_loop, samples, comm_s, compute_s, extra)
    if alone:
        _raise_if(save_error)
        return record
    agreed(session.cluster.worker_comm, _raise_if, save_error, watchdog=session.watchdog,
           what="the chief's final record and --save")
    # Every worker knows now: a deadline line from here on says so.
    session.watchdog.note = results_note(session.args)
    return record


def _raise_if(line):
    if line:
        raise HpctrainError(line)


# ---------------------------------------------------------------------------
# the parameters file

def save_params(path, model, step, args, world_size, checkpoint_path=None):
    """--save. Returns None, or (when the file cannot be written, e.g. the disk
    filled up during training) the one-line error that says where the
    parameters are kept instead: the checkpoint of this step if there is one,
    else a file in the temporary directory."""
    if not path:
        return None
    try:
        write_params(path, model, step, args, world_size)
        return None
    except OSError as e:
        failed = f"--save {path}: cannot write ({one_line(e)})"
    if checkpoint_path:
        return f"{failed}; the parameters of step {step} are in checkpoint {checkpoint_path}"
    try:
        rescue = rescue_path(step)
        write_params(rescue, model, step, args, world_size)
    except OSError as e:
        return f"{failed}, nor in the temporary directory ({one_line(e)}): the parameters are lost"
    return f"{failed}; the parameters of step {step} are kept in {rescue}"


def write_params(path, model, step, args, world_size, attrs=None):
    """One float32 dataset per tensor, attributes step/mode/world_size/hidden
    (and attrs: --keep-best's val_accuracy); written to a temporary name and
    renamed, so it is never half-written."""
    import h5py
    # Exclusive and unpredictable: a planted symlink is never followed.
    fd, tmp = temp_next_to(path)
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            # the non-trainable state (batch-norm statistics) beside the parameters
            for name, view in model.tensors() + model.state_tensors():
                f.create_dataset(name, data=device.to_host(view))
            f.attrs["step"] = step
            f.attrs["mode"] = args.mode
            f.attrs["world_size"] = world_size
            f.attrs["hidden"] = ",".join(map(str, args.hidden))
            f.attrs["model"] = model.spec.identity
            # how to rebuild the model and prepare its inputs (predict, evaluate)
            for key, value in {**trained.record(model.spec, args), **(attrs or {})}.items():
                f.attrs[key] = value
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
