"""What a run tells its user: progress lines, the --metrics records
(report/metrics.py keeps the file), test-set (and validation-part)
evaluations, the final record, the --save parameters file and the
--keep-best one (report/params.py writes them; report/best.py keeps the
best so far).

The chief writes everything: records, evaluations' lines, files. The loops
call these under an explicit `if chief:`, except what every worker joins
(`peak_memory_and_step_medians`; the evaluations of a collective model,
report/evaluated.py: a pipeline's) and, in async ps mode, `progress`: every
worker prints its own progress lines (its records go nowhere: a rank other
than the chief holds a Metrics that writes nothing). What the chief does alone while the others wait for it
(evaluations, --keep-best, the final line and files) runs under the
watchdog's `busy`: their deadline waits for it as long as the chief
answers (comm/deadline.py), and each file it reads or writes meanwhile has
the chief's own deadline.

    mpirun -n 2 python -m hpctrain.mnist --steps 300 --metrics m.jsonl --save p.h5
    mpirun -n 2 python -m hpctrain.mnist --data data/mnist-val --eval-every 50 --keep-best best.h5
"""
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from ..base.errors import HpctrainError
from ..base.files import create_new, one_line, remove_temp, temp_name_next_to
from .metrics import Metrics
from .tensorboard import Board


def eta_text(seconds):
    """42s, 1m23s, 2h05m: short enough for a progress line."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Report:
    """The chief's lines and records for one run: world (run/world.World),
    plan (run/plan.Plan), steps (its last step), timeline (written with the
    final record), best (report/best.Best: --keep-best's record)."""

    def __init__(self, world, plan, steps, timeline, best):
        self.world, self.plan, self.outputs, self.steps = world, plan, plan.outputs, steps
        self.timeline, self.best = timeline, best
        # Async ps workers print their own progress lines; only the chief writes files.
        self.metrics = Metrics(self.outputs.metrics if world.chief else None)
        # --tensorboard: the same records as TensorBoard scalars (report/tensorboard.py), the chief's
        self.board = Board(self.outputs.tensorboard if world.chief else None, lr=plan.lr)
        self._last_eval = None
        self._final_val = None   # (loss, accuracy) on the val part at the end (final_val)
        self._mark = None   # (step, wall time) of the last progress line, for the ETA
        self._before = (0.0, 0.0, 0.0, 0)   # a resumed run's earlier runs: checkpoints/resume.Resume.clock

    def resume_at(self, step, resume=None):
        """Where this run starts (None: step 0): the metrics file keeps the
        records up to it, and the first ETA counts the steps from it. The
        chief takes the best validation so far from resume's checkpoint."""
        self.best.resumed(getattr(resume, "checkpoint", None))
        if resume is not None:   # elapsed and time_s go on from the checkpoint's
            self._before = resume.clock
        self.metrics.resume_at(step)
        self.board.resume_at(step)
        self._mark = (step or 0, time.perf_counter())

    def progress(self, step, loss, samples, t_loop, worker=None, local_step=None, grad_norm=None):
        """A progress line and (on the chief) a metrics record. Async ps
        workers each print their own line, as in the tutorial: `worker` and
        `local_step` say whose it is. grad_norm (--clip-norm): the mean
        pre-clip gradient norm since the last line."""
        elapsed = self._before[0] + time.perf_counter() - self.world.t_start
        rate = samples / t_loop if t_loop > 0 else 0.0
        who = f"worker {worker}: " if worker is not None else ""
        local = f"  (local step {local_step})" if local_step is not None else ""
        norm = f"  grad norm {grad_norm:.4g}" if grad_norm is not None else ""
        per_token = self.plan.data.tokens_per_sample
        speed = f"tokens/s {rate * per_token:,.0f}" if per_token else f"samples/s {rate:,.0f}"
        print(f"{who}step {step:>6}/{self.steps}  loss {loss:.4f}{norm}  "
              f"{speed}  elapsed {elapsed:.1f}s  {self._eta(step)}{local}", flush=True)
        record = {"step": step, "loss": round(float(loss), 6), "samples_per_s": round(rate, 1),
                  **({"tokens_per_s": round(rate * per_token, 1)} if per_token else {}),
                  "time_s": round(elapsed, 3),
                  # the learning rate of the step just taken (0-based step - 1), as --tensorboard's train/lr
                  "lr": float(self.plan.lr(step - 1))}
        if grad_norm is not None:
            record["grad_norm"] = round(float(grad_norm), 6)
        self.metrics.write(record)
        self.board.write(record)

    def _eta(self, step):
        """`eta 1m23s`: the steps left at the rate since the last line (wall
        time, so evaluations and checkpoints count: they are part of the wait).
        Not in the metrics records: it is a guess, derived from them."""
        now = time.perf_counter()
        last_step, last_t = self._mark or (0, self.world.t_start)
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
        mode workers are never at the same step) and logs and records it; a
        collective model (report/evaluated.py: a pipeline's) is evaluated by
        every rank, the chief saying it. Returns the seconds spent, which
        the caller keeps out of samples/s."""
        every = self.outputs.eval_every
        if self._last_eval is None:  # the first step of this run (or of a resumed one)
            self._last_eval = step - 1
        crossed = bool(every) and step < self.steps and step // every > self._last_eval // every
        self._last_eval = step
        if not crossed:
            return 0.0
        t0 = time.perf_counter()
        with self.world.watchdog.busy():
            self._periodic_eval(model, step)
        return time.perf_counter() - t0

    def _periodic_eval(self, model, step):
        test_loss, test_acc, _ = self.evaluate_split(model)
        record = {"event": "eval", "step": step, "test_accuracy": round(test_acc, 6),
                  "test_loss": round(test_loss, 6)}
        line = f"test accuracy {test_acc:.4f}  test loss {test_loss:.4f}"
        if self.plan.data.has_val:
            # text's val is its test split (one held-out tail): the same figures, evaluated once
            val_loss, val_acc = (test_loss, test_acc) if self.plan.data.val_is_test else \
                self.evaluate_split(model, "val")[:2]
            record.update(val_accuracy=round(val_acc, 6), val_loss=round(val_loss, 6))
            line = f"val accuracy {val_acc:.4f}  val loss {val_loss:.4f}  " + line
            self.keep_if_best(model, step, val_loss, val_acc)
        if self.world.chief:
            print(f"step {step:>6}/{self.steps}  {line}", flush=True)
            with self._file_wait(f"writing --metrics {self.outputs.metrics}"):
                self.metrics.write(record)
                self.board.write(record)

    def _file_wait(self, what):
        """The chief's own deadline on a file it reads or writes while busy."""
        return self.world.waiting(what, peer="the file system")

    def keep_if_best(self, model, step, val_loss, val_acc):
        """--keep-best: write the parameters when this validation beats every
        earlier one (report/best.py: by accuracy, or for text by loss;
        strictly: a tie keeps the earlier, smaller step). A failed
        write ends the run: a best file that silently stopped following the
        best would be worse than none."""
        if not self.best.beats(val_loss, val_acc):
            return
        if not model.finite():
            return   # a diverged step is no candidate: the next step's loss, or the end, stops the run (exit 4)
        self.best.take(val_loss, val_acc, step)
        path = self.best.path
        try:
            with self._file_wait(f"writing --keep-best {path}"):
                model.write(path, step, attrs={"val_accuracy": float(val_acc), "val_loss": float(val_loss)})
        except OSError as e:   # (the chief's: the others are not told, the job is aborted)
            raise HpctrainError(f"--keep-best {path}: cannot write ({one_line(e)})", collective=False) from None

    def final_val(self, model, step):
        """The chief alone (as periodic_eval; the val part is small; a
        collective model: every rank): val loss
        and accuracy of the final parameters, once, and a --keep-best
        candidate. The loops call it before the final checkpoint, so that
        checkpoint's best includes it (resume keeps the same best) -- but not
        when a signal stopped training early: an uninterrupted run would
        never have evaluated that step."""
        if self._final_val is None:
            with self.world.watchdog.busy():
                val_loss, val_acc, count = self.evaluate_split(model, "val")
                self.keep_if_best(model, step, val_loss, val_acc)
            self._final_val = (val_loss, val_acc, count)
        return self._final_val[:2]

    def final_test_from_val(self):
        """Text's val is its test split: the final evaluation's (loss, accuracy,
        count) are final_val's, where this rank computed it (the chief, or
        every rank of a collective model), else None."""
        return self._final_val if self.plan.data.val_is_test else None

    def evaluate_split(self, model, split="test"):
        """Loss, accuracy and count on the whole test set (or "val" part)
        (report/evaluated.py: the chief alone, or a collective model's every rank)."""
        loss_sum, correct, count = model.evaluate(split)
        n = max(count, 1)
        return loss_sum / n, correct / n, count

    def final(self, result, step, t_loop, samples, comm_s, compute_s, extra):
        """The chief's last line, the final record, the timeline (--save was
        written before: result["save_error"], None or the line that says
        where the parameters are kept instead). Returns (record, that line)."""
        with self.world.watchdog.busy():
            return self._final(result, step, t_loop, samples, comm_s, compute_s, extra)

    def _final(self, result, step, t_loop, samples, comm_s, compute_s, extra):
        world, plan, outputs, cluster = self.world, self.plan, self.outputs, self.world.cluster
        evaluated = result["test"] is not None   # None: --final-eval off
        test = self._final_test(result["test"])
        val = {}
        if plan.data.has_val and evaluated:
            val_loss, val_acc = self.final_val(result["model"], step)
            val = {"val_accuracy": round(val_acc, 6), "val_loss": round(val_loss, 6)}
            print(f"val accuracy {val_acc:.4f}  val loss {val_loss:.4f}", flush=True)
        wall = time.perf_counter() - world.t_start
        rate = samples / t_loop if t_loop > 0 else 0.0
        per_token = plan.data.tokens_per_sample
        speed = f"{rate * per_token:,.0f} tokens/s" if per_token else f"{rate:,.0f} samples/s"
        memory = self._memory_text(result["medians"], extra)
        if not evaluated:
            print(f"no final evaluation (--final-eval off)  ({step} steps, {speed}, {wall:.1f}s; {memory})",
                  flush=True)
        elif per_token:   # a language model: the loss per held-out token, next-token accuracy
            print(f"test loss {test['test_loss']:.4f} per token  test accuracy {test['test_accuracy']:.4f}  "
                  f"({self._tokens_text(test)}, {step} steps, {speed}, {wall:.1f}s; {memory})", flush=True)
        else:
            print(f"test accuracy {test['test_accuracy']:.4f}  test loss {test['test_loss']:.4f}  "
                  f"({result['test'][2]} images, {step} steps, {speed}, {wall:.1f}s; {memory})", flush=True)
        save_error = result["save_error"]
        record = {"event": "final", "mode": plan.mode, "world_size": cluster.size, "workers": cluster.num_workers,
                  "steps": step,
                  "global_batch": plan.per_step,
                  **val, **test,
                  "wall_s": round(wall, 3), "samples_per_s": round(rate, 1),
                  **({"tokens_per_s": round(rate * per_token, 1)} if per_token else {}),
                  "comm_s": round(comm_s, 4), "compute_s": round(compute_s, 4),
                  "device": world.device_name}
        record.update(self._mfu(rate))
        # a resumed run's time over every run that took it (wall_s, compute_s, comm_s: this run's)
        wall_before, compute_before, comm_before, runs = self._before
        record.update(total_wall_s=round(wall_before + wall, 3), total_compute_s=round(compute_before + compute_s, 4),
                      total_comm_s=round(comm_before + comm_s, 4), segments=runs + 1)
        record.update(result["medians"])
        record["config"] = plan.config   # the run's flags, merged (--config's file, the command line)
        record.update(extra or {})
        with self._file_wait(f"writing --metrics {outputs.metrics}"):
            self.metrics.write(record)
            self.metrics.close()
            self.board.write(record)
            self.board.close()
        with self._file_wait(f"writing --timeline {outputs.timeline}"):
            self.timeline.write()
        if not save_error:
            world.watchdog.results_written(results_note(outputs))   # a line from here on says so
        for line in self.written_lines(step, save_error, result.get("checkpoint")):
            print(line, flush=True)
        with self._file_wait("writing HPCTRAIN_FINISHED_FILE"):
            mark_finished(record)
        return record, save_error


    def _mfu(self, rate):
        """The record's `mfu` and the SGEMM it is measured against (report/mfu.py):
        the ranks that compute the model (ps: its workers; its servers only
        add) at this rank's compute threads; none on a GPU (no SGEMM of its own here)."""
        if self.world.xp is not np:
            return {}
        from ..nn import threads
        from .mfu import mfu
        cluster = self.world.cluster
        ranks = cluster.num_workers if self.plan.mode == "ps" else cluster.size
        value, peak = mfu(self.plan.spec, rate, ranks, threads.count())
        return {"mfu": round(value, 4), "sgemm_gflops": round(peak, 1)}

    def _final_test(self, test):
        """The final record's test figures: test_loss and test_accuracy (null,
        and final_eval "off", where --final-eval off skipped them); for text
        the tokens scored (test_tokens) of the held-out windows' (held_out_tokens):
        fewer where --eval-tokens (or its default cap) sampled them."""
        if test is None:
            return {"test_accuracy": None, "test_loss": None, "final_eval": "off"}
        loss, accuracy, count = test
        out = {"test_accuracy": round(accuracy, 6), "test_loss": round(loss, 6)}
        data = self.plan.data
        if data.text:
            from ..data import load_manifest
            from ..data.splits import held_out_tokens
            whole = held_out_tokens(load_manifest(data.dir), data.block_size)
            out.update(test_tokens=int(count), held_out_tokens=int(whole))
        return out

    @staticmethod
    def _tokens_text(test):
        """ "on 8,192 of 111,488 held-out tokens, a sample (--eval-tokens)": what the final evaluation scored."""
        used, whole = test["test_tokens"], test["held_out_tokens"]
        sample = ", an evenly spaced sample (--eval-tokens)" if used < whole else ""
        return f"on {used:,} of {whole:,} held-out tokens{sample}"

    def _memory_text(self, medians, extra):
        """The end line's ZeRO stage (ring mode's, from the final record's `zero`)
        and the largest peak memory of any rank (its resident set)."""
        zero = (extra or {}).get("zero")
        stage = f"ZeRO stage {zero}, " if zero is not None else ""
        return f"{stage}peak memory {medians['peak_rss_mb']:,.0f} MB (the largest rank's)"

    def written_lines(self, step, save_error, checkpoint):
        """The run's last lines: one per file it wrote (or kept), so the user
        knows what is where. checkpoint: (path, step) of the newest checkpoint."""
        outputs, lines = self.outputs, []
        if outputs.save and not save_error:
            lines.append(f"wrote --save {outputs.save} (the parameters after step {step})")
        if self.best.path and self.best.value is not None:
            value, best_step = self.best.value
            lines.append(f"wrote --keep-best {self.best.path} (the parameters after step {best_step}: "
                         f"the best {self.best.measure}, {value:.4f})")
        if checkpoint is not None:
            lines.append(f"last checkpoint {checkpoint[0]} (step {checkpoint[1]})")
        if self.metrics.whole():
            lines.append(f"wrote --metrics {outputs.metrics} (the final record last)")
        if self.board.whole():
            lines.append(f"wrote --tensorboard {outputs.tensorboard} ({tensorboard_view(outputs.tensorboard)})")
        if self.timeline.written:
            lines.append(f"wrote --timeline {outputs.timeline}")
        return lines


def tensorboard_view(path):
    """How to look at --tensorboard's files: `tensorboard --logdir DIR`, and
    where the viewer is not installed (hpctrain writes them through
    tensorboardX, which brings no viewer), how to get it."""
    import importlib.util
    import shutil
    view = f"tensorboard --logdir {path}"
    if shutil.which("tensorboard") or importlib.util.find_spec("tensorboard"):
        return view
    return f"to view them: pip install tensorboard, then {view}"


def results_note(outputs):
    """What a deadline line says once the results are written (Watchdog.results_written)."""
    files = ([f"--save {outputs.save}"] if outputs.save else []) + \
        ([f"the final record in --metrics {outputs.metrics}"] if outputs.metrics else [])
    return f"the run finished and its results are written ({', '.join(files) or 'the final line'})"


def mark_finished(record):
    """HPCTRAIN_FINISHED_FILE (jobs/launch.sh sets it): the final record,
    written by the chief once it has written the results, so the job script
    can bound its wait for a rank that hangs on its way out where no watchdog
    sees it (after MPI_Finalize). A failure is a warning: the results are kept."""
    path = os.environ.get("HPCTRAIN_FINISHED_FILE")
    if not path:
        return
    tmp = temp_name_next_to(path)
    try:
        with os.fdopen(create_new(tmp), "w") as f:
            f.write(json.dumps(record) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        print(f"hpctrain: warning: HPCTRAIN_FINISHED_FILE {path}: cannot write ({e.strerror or e}); the job "
              f"script cannot tell that the run finished", file=sys.stderr, flush=True)
    finally:
        remove_temp(tmp)


def peak_memory_and_step_medians(world, stats, alone=False):
    """Every worker (or, alone, this one): the median step split from
    stats (report/step_stats.StepStats), and peak memory: the largest of any
    worker (bytes above the interpreter with its imports, and in all), and
    on the chief every worker's (by worker rank: a pipeline's stages)."""
    summary = stats.summary()
    peak, base = summary.pop("peak_rss_bytes"), summary.pop("base_rss_bytes")
    mine = np.array([peak, peak - base], np.float64)
    mem, each = np.append(mine, summary.pop("trained_rss_bytes")), mine.reshape(1, 2)
    if not alone:
        comm = world.cluster.worker_comm
        each = np.zeros((comm.Get_size(), 2), np.float64) if world.chief else None
        with world.waiting("memory statistics allreduce", peer=None):
            comm.Allreduce(MPI.IN_PLACE, mem, op=MPI.MAX)
            comm.Gather(mine, each, root=0)   # every worker's, for the chief's record (a pipeline's stages differ)
    summary = {k: round(v, 7) for k, v in summary.items()}
    summary["peak_rss_mb"] = round(mem[0] / 2**20, 1)
    summary["peak_rss_above_base_mb"] = round(mem[1] / 2**20, 1)
    # the training loop's own (the final evaluation's batches can be larger than a step's)
    summary["training_peak_rss_mb"] = round(mem[2] / 2**20, 1)
    if each is not None:
        summary["peak_rss_mb_by_worker"] = [round(v / 2**20, 1) for v in each[:, 0]]
        summary["peak_rss_above_base_mb_by_worker"] = [round(v / 2**20, 1) for v in each[:, 1]]
    return summary
