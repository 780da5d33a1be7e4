"""Run hpctrain.mnist with a rank slowed down or stopped at a given point of
the run: faults injected from the tests, not from production code.

    FAULT_EVAL_SLEEP=3 PYTHONPATH=tests/faults mpirun -n 2 python -m slow_ranks --steps 20 --eval-every 10

Environment:
  FAULT_EVAL_SLEEP=S  every evaluation the chief does alone (Report.evaluate_split:
                      --eval-every, the val part) first sleeps S seconds
  FAULT_EVAL_STOP=1   the chief stops itself (SIGSTOP) in its first such evaluation
  FAULT_FINAL_EVAL_SLEEP=S  the final evaluation (every worker's part of the
                      test set, report/evaluated.py) first sleeps S seconds on every rank
  FAULT_EXIT_STOP=R   rank R stops itself (SIGSTOP) on its way out: the run done
                      and its results written, before the shutdown (comm/start.py stop_mpi)
  FAULT_EXIT_LINGER=R:S  rank R sleeps S seconds right after the shutdown barrier,
                      its watchdog still holding roll calls while the others
                      leave (comm/start.py stop_mpi, deadline.Watchdog.stop_using_mpi)
  FAULT_STOP_GRACE=S  a stop signal outside training is overdue after S
                      seconds, not run/stop_signal.py's 5 (StopSignal.GRACE_S):
                      the tests of what an overdue signal does wait less
  FAULT_FINAL_STOP=R  rank R stops itself after MPI_Finalize, where no watchdog
                      of the job can see it any more (the launcher's wait)
  FAULT_PID_DIR=DIR   every rank writes its pid to DIR/rank-<rank>.pid
  FAULT_STAGE_STOP=R:WHERE  rank R of a pipeline stops itself (SIGSTOP) at its
                      first pipelined evaluation (WHERE=eval) or as it writes its
                      parts of the first checkpoint (WHERE=checkpoint: its own file)
  FAULT_LOOP_STOP=R:MODE  rank R stops itself (SIGSTOP) as the training loop
                      of MODE (ring, ps or pipe) starts, before its first collective
                      (the loop's own communicators)
  FAULT_NO_GUARD=1    no rank starts its exit watcher (comm/exit_guard.py): what
                      is left to bound a hang on the way out is the job script

The patches go in when entry.train starts, after the process is configured
(numpy must not load before: it reads the BLAS thread count once).
"""
import os
import signal
import sys
import time

from hpctrain.run import cluster
from hpctrain import train as entry

_train = entry.train


def stop_here():
    os.kill(os.getpid(), signal.SIGSTOP)


def slow_evaluations():
    from hpctrain.report.report import Report
    evaluate_split = Report.evaluate_split
    sleep = float(os.environ.get("FAULT_EVAL_SLEEP", 0))
    stop = [os.environ.get("FAULT_EVAL_STOP") == "1"]

    def slow(self, *args, **kwargs):
        if stop[0]:
            stop[0] = False
            stop_here()
        time.sleep(sleep)
        return evaluate_split(self, *args, **kwargs)

    Report.evaluate_split = slow


def slow_final_evaluation(seconds):
    from hpctrain.report.evaluated import WholeModel
    evaluate_parts = WholeModel.evaluate_parts

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return evaluate_parts(self, *args, **kwargs)

    WholeModel.evaluate_parts = slow


def stop_at_exit(rank, after_finalize):
    from hpctrain.comm import start
    stop_mpi = start.stop_mpi

    def stopping(watchdog, guard=None):
        if rank == watchdog.rank and not after_finalize:
            stop_here()
        stop_mpi(watchdog, guard)
        if rank == watchdog.rank and after_finalize:
            stop_here()

    start.stop_mpi = stopping


def linger_after_the_barrier(rank, seconds):
    from hpctrain.comm.deadline import Watchdog
    stop_using_mpi = Watchdog.stop_using_mpi

    def lingering(self, *args, **kwargs):
        if self.rank == rank:
            time.sleep(seconds)
        return stop_using_mpi(self, *args, **kwargs)

    Watchdog.stop_using_mpi = lingering


def stop_a_stage(rank, where):
    from hpctrain.pipeline import engine
    from hpctrain.checkpoints import named
    # a checkpoint: each rank writes its own file
    cls, name = (engine.Engine, "evaluate") if where == "eval" else (None, "_write_rank_file")
    original = getattr(cls or named, name)

    def stopping(*args, **kwargs):
        if cluster.launcher_env()[0] == rank:
            stop_here()
        return original(*args, **kwargs)

    setattr(cls or named, name, stopping)


def stop_at_loop_start(rank, mode):
    import importlib
    module = importlib.import_module(f"hpctrain.loops.{mode}")
    name = f"train_{mode}"
    loop = getattr(module, name)

    def stopping(world, *args, **kwargs):
        if world.cluster.rank == rank:
            stop_here()
        return loop(world, *args, **kwargs)

    setattr(module, name, stopping)


def train(*args, **kwargs):
    if os.environ.get("FAULT_LOOP_STOP"):
        rank, mode = os.environ["FAULT_LOOP_STOP"].split(":")
        stop_at_loop_start(int(rank), mode)
    if os.environ.get("FAULT_STAGE_STOP"):
        rank, where = os.environ["FAULT_STAGE_STOP"].split(":")
        stop_a_stage(int(rank), where)
    if os.environ.get("FAULT_NO_GUARD") == "1":
        from hpctrain.comm import exit_guard
        exit_guard.start = lambda rank, timeout: exit_guard.NoGuard()
    if os.environ.get("FAULT_EVAL_SLEEP") or os.environ.get("FAULT_EVAL_STOP"):
        slow_evaluations()
    if os.environ.get("FAULT_FINAL_EVAL_SLEEP"):
        slow_final_evaluation(float(os.environ["FAULT_FINAL_EVAL_SLEEP"]))
    if os.environ.get("FAULT_STOP_GRACE"):
        from hpctrain.run.stop_signal import StopSignal
        StopSignal.GRACE_S = float(os.environ["FAULT_STOP_GRACE"])
    if os.environ.get("FAULT_EXIT_LINGER"):
        rank, seconds = os.environ["FAULT_EXIT_LINGER"].split(":")
        linger_after_the_barrier(int(rank), float(seconds))
    for name, after in (("FAULT_EXIT_STOP", False), ("FAULT_FINAL_STOP", True)):
        if os.environ.get(name):
            stop_at_exit(int(os.environ[name]), after)
    return _train(*args, **kwargs)


def main():
    if os.environ.get("FAULT_PID_DIR"):
        rank = cluster.launcher_env()[0] or 0
        with open(os.path.join(os.environ["FAULT_PID_DIR"], f"rank-{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    entry.train = train
    sys.exit(entry.main())


if __name__ == "__main__":
    main()
