"""The entry point: train a model across MPI ranks (data-parallel, parameter servers or a pipeline).

    mpirun -n 4 python -m hpctrain.train                      # ring allreduce
    mpirun -n 4 python -m hpctrain.train --mode ps --num-ps 2 # parameter servers
    python -m hpctrain.train --help                           # every flag

`python -m hpctrain.mnist` is the same program under MNIST's name (the
bundled sample is the default data). Order matters: flags are parsed and
the process configured (BLAS threads, MPI progress throttling, GPU binding)
before numpy and MPI are imported, because they read those settings once,
when they load; then MPI starts under a deadline, the run's world and plan
are made (run/startup.py), one of the three loops trains (loops/), and
every rank leaves through one shutdown barrier. Exit codes: hpctrain/base/errors.py.
"""
import os
import signal
import sys

from .flags import cli
from .run import cluster
from .base import launcher
from .base.errors import EXIT_FAILURE, EXIT_INTERRUPTED, HpctrainError

# A rank other than the chief that got Ctrl-C waits this long per rank of
# distance from the chief (after the abort grace) for the chief's abort,
# before it speaks itself: on a loaded node the launcher takes a while to end
# every rank.
LONE_SIGINT_WAIT_S = 2.0


def main(argv=None, prog="python -m hpctrain.train"):
    signal.signal(signal.SIGINT, _on_sigint)
    _whole_lines()
    sys.unraisablehook = _unraisable(sys.unraisablehook)
    # The parsed flags and, once the roles are known, the chief's world rank
    # (for the Ctrl-C line, which must not call MPI to learn it); once
    # train() started it, this process's watchdog (for the way out of an error).
    seen = {}
    try:
        return _main(argv, seen, prog)
    except KeyboardInterrupt:
        return _interrupted(seen.get("args"), seen.get("chief"))


def _whole_lines():
    """Each line of this rank's one write(2). Unbuffered (PYTHONUNBUFFERED,
    python -u: many container images and job scripts set it), print writes
    a line's text and its newline apart, and the launcher, which merges
    every rank's output, can put another rank's line between the two (async
    ps workers' progress lines ran together on one line). Line-buffered,
    the text waits for its newline and goes out with it."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "write_through", False) and hasattr(stream, "reconfigure"):
            stream.reconfigure(write_through=False, line_buffering=True)


def _main(argv, seen, prog):
    rank, _, _, _ = launcher.launcher_env()
    args = flag_error = None
    try:
        args = cli.parse(argv, quiet=bool(rank), prog=prog)
    except HpctrainError as exc:
        if not launcher.in_mpi_job():
            print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        flag_error = exc   # the other ranks may have good flags: agree first (train)
    seen["args"] = args
    try:
        note = cluster.configure_process(device=args.device if args else "auto", threads=args.threads if args else None)
        train(args, note, flag_error, seen)
        return 0
    except HpctrainError as exc:
        if exc.report and str(exc):
            if exc.detail:   # the user's own traceback, above the line
                print(exc.detail, end="" if exc.detail.endswith("\n") else "\n", file=sys.stderr)
            print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
        if not exc.collective:
            _abort_others(exc.exit_code)
        elif "survivors" in seen:   # --on-failure shrink, ranks lost: the world's barrier would wait for them
            from .comm.start import stop_survivors
            stop_survivors(seen["watchdog"], seen["survivors"], exc.exit_code)
        elif "watchdog" in seen:
            # Every rank of a communicator got it; ranks outside it (ps
            # servers, when --save failed on the chief) end the run as usual:
            # all leave through the same shutdown barrier.
            from .comm.start import stop_mpi
            stop_mpi(seen["watchdog"], seen.get("guard"))
        return exc.exit_code
    except Exception:
        # A bug: show it, and take the other ranks down rather than leave
        # them blocked in a collective (what `python -m mpi4py` does).
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        _abort_others(EXIT_FAILURE)
        return EXIT_FAILURE
    except SystemExit as exc:
        # hpctrain never calls sys.exit inside training: the model's code did.
        # A run that ends before its final record did not succeed, whatever
        # the status it asked for (0 would end the job "done", with no result).
        import traceback
        traceback.print_exc()
        print(f"hpctrain: error: sys.exit({exc.code!r}) was called during the run (by the model's code?), before "
              f"it finished: no result; exit {EXIT_FAILURE}", file=sys.stderr, flush=True)
        _abort_others(EXIT_FAILURE)
        return EXIT_FAILURE


def train(args, process_note="", flag_error=None, seen=None):
    """Train as the flags say; returns the final metrics record (chief) or None.
    flag_error: this rank's flags were bad (args is None); every rank stops.
    seen: main's dict, which gets the watchdog (its way out of an error)."""
    from .comm import exit_guard
    from .comm.deadline import Watchdog
    # Bounded from the first line: a rank that never reaches MPI_Init, or
    # stalls in it, ends this process (nothing of MPI can be used yet); the
    # launcher takes the rest down. Its way out is bounded from outside it
    # too, by a watcher started now, before MPI_Init (exit_guard.py).
    from .run.stop_signal import StopSignal
    # First: a stop signal during start-up is kept for the first step (which
    # stops and checkpoints) instead of killing the rank mid-collective, and
    # a deadline that passes after one ends the job as a pre-emption (75).
    stop = StopSignal()
    timeout = args.timeout if args else cli.DEFAULT_TIMEOUT
    rank = launcher.launcher_env()[0] or 0
    guard = exit_guard.start(rank, timeout)
    watchdog = Watchdog(timeout, rank, abort=_exit_now, heartbeat=guard.heartbeat,
                        preempted=lambda: stop.preempted_line(args.checkpoint_dir if args else None))
    if seen is not None:
        seen["watchdog"], seen["guard"] = watchdog, guard
    from .comm.start import start_mpi, stop_mpi
    shrink = args is not None and args.on_failure == "shrink"
    MPI = start_mpi(watchdog, inherit_errhandler=shrink)   # numpy, BLAS and MPI start here
    stop.claim()   # the stop signals' handlers back where MPI_Init took one (UCX: SIGHUP)
    survival = None
    if shrink:
        from .comm import ulfm
        from .run import survival as survival_mod
        if ulfm.active():   # (without ULFM start() refuses the flag in one line)
            # before any communicator is made from the world: they inherit the handler
            survival_mod.revoke_on_failure(MPI.COMM_WORLD)
            survival = survival_mod.Survival(args.commit_every, comm=MPI.COMM_WORLD)
    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        with watchdog.waiting("start-up (roll-call communicator)", peer=None):
            watchdog.roll_call_on(MPI.COMM_WORLD)
    else:
        # The watchdog's thread must not call MPI then: it names whom it
        # waited for and ends this process; the launcher takes the rest down.
        watchdog.without_roll_call("the culprit could not be determined: MPI gives less than MPI_THREAD_MULTIPLE",
                                   abort=_exit_now)
    from .comm.agree import agreed
    from .run.startup import start
    # The first collective of every rank: a flag bad on some ranks only (an
    # MPMD launch, a per-rank wrapper) ends every rank with its line, exit 2.
    agreed(MPI.COMM_WORLD, _raise, flag_error, watchdog=watchdog, what="flags")
    world, plan, inputs = start(args, process_note, watchdog, stop,
                                on_roles=(lambda chief: seen.__setitem__("chief", chief)) if seen is not None
                                else None, survival=survival)
    while True:
        try:
            record = _loop(world, plan, inputs)
            break
        except MPI.Exception as exc:
            # --on-failure shrink: a peer died; the survivors go on from the in-memory commit
            from .comm.ulfm import peer_lost
            if survival is None or not peer_lost(exc):
                raise
            try:
                world, plan, inputs = survival.recover(
                    world, lambda comm: start(args, process_note, watchdog, stop, survival=survival, comm=comm))
            finally:
                if seen is not None:   # an error from here on leaves through main's stop_survivors
                    seen["survivors"] = survival.comm
    if survival is not None and survival.recoveries:
        from .comm.start import stop_survivors
        stop_survivors(watchdog, world.comm)   # (no MPI_Finalize: it may wait for the lost ranks)
    if world.mesh is not None:
        world.mesh.free()   # its communicators, made once at start-up
    stop_mpi(watchdog, guard)   # shutdown is a wait too
    return record


def _loop(world, plan, inputs):
    """The run's loop on the world start() made: the chief's final record, or None."""
    from .report.timeline import Timeline
    if plan.pipelined:
        from .loops.pipe import train_pipe as loop
    elif plan.mode == "ring":
        from .loops.ring import train_ring as loop
    else:
        from .loops.ps import train_ps as loop
    # the chief's trace; the other ranks' record nothing
    timeline = Timeline(plan.outputs.timeline if world.chief else None, steps=plan.outputs.timeline_steps)
    try:
        return loop(world, plan, inputs, timeline)
    finally:
        timeline.discard()   # a trace that was not written leaves no temporary


def _raise(error):
    if error is not None:
        raise error


def _on_sigint(signum, frame):
    # The first Ctrl-C interrupts; any more (a terminal sends one to every
    # process of the job, and Hydra forwards its own) must not interrupt the
    # way out, or a traceback is printed after all.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _unraisable(hook):
    """sys.unraisablehook: a Ctrl-C whose KeyboardInterrupt was raised inside
    a finaliser or weakref callback (the garbage collector runs them at any
    moment), where Python can only print it and go on, is delivered again to
    the main flow, quietly: the handler back, and the signal simulated from
    another thread 50 ms later, once this callback has returned (simulated
    at once, it is raised inside this hook and swallowed again); anything
    else goes to `hook`."""
    import _thread
    import threading

    def on_unraisable(unraisable):
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            signal.signal(signal.SIGINT, _on_sigint)
            later = threading.Timer(0.05, _thread.interrupt_main, args=(signal.SIGINT,))
            later.daemon = True
            later.start()
            return
        hook(unraisable)
    return on_unraisable


def _interrupted(args, chief=None):
    """Ctrl-C (SIGINT) on this rank: one line for the job, exit 130. Writers
    have removed their temporary files on the way here (try/finally); what
    was written before (checkpoints, metrics records) is whole.

    The chief (ring: rank 0; ps: worker 0) says it and ends the job
    (_end_job_quietly). Another rank waits for that to end it, and speaks
    (and ends the job) itself only if it did not come: the chief did not
    get the signal, or sits in an MPI call (C code, where no signal reaches Python) waiting for a
    peer that already stopped. Those waits are staggered by rank, so that
    one rank speaks. On one rank alone (no MPI, or a world of one) it
    returns the code for main to exit with."""
    import time
    from .comm.deadline import ABORT_GRACE_S
    mpi = sys.modules.get("mpi4py.MPI")
    up = mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()
    rank = mpi.COMM_WORLD.Get_rank() if up else (launcher.launcher_env()[0] or 0)
    if chief is None:   # before the roles are known: today's rule's chief, or rank 0
        chief = args.num_ps if args is not None and args.mode == "ps" else 0
    if rank != chief:
        if not up:
            return EXIT_INTERRUPTED   # before MPI: every rank got it from the launcher
        after = (rank - chief) % mpi.COMM_WORLD.Get_size()   # 1, 2, ...: one rank at a time
        time.sleep(ABORT_GRACE_S + LONE_SIGINT_WAIT_S * (1 + min(after, 32)))
    where = (f"checkpoints already in --checkpoint-dir {args.checkpoint_dir} are whole; run the same "
             f"command again to resume from the newest" if args is not None and args.checkpoint_dir
             else "nothing is resumable (no --checkpoint-dir)")
    print(f"hpctrain: error: interrupted (SIGINT) on rank {rank}; {where}", file=sys.stderr, flush=True)
    if up and mpi.COMM_WORLD.Get_size() > 1:
        _end_job_quietly(EXIT_INTERRUPTED)
    return EXIT_INTERRUPTED


def _end_job_quietly(code):
    """End the job with `code` from this rank: MPI_Abort, whose launcher
    ends every rank with that code at once (this rank's line said what
    happened), but without MPICH's own 'Abort(130) ... MPI_Abort' line,
    which reads as a crash beside the one line Ctrl-C deserves: standard
    error goes to /dev/null first. Not os._exit: Hydra then SIGKILLs the
    other ranks, and one killed before this rank's exit is reported as a
    'BAD TERMINATION' banner and exit 9 (one run in two of a 3-rank ps job);
    not MPI_Finalize: it waits for ranks still inside a collective."""
    import time
    from .comm.deadline import ABORT_GRACE_S
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)   # let the launcher forward this rank's line first
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(code)


def _exit_now(code):
    os._exit(code)


def _abort_others(code):
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
        import time
        from .comm.deadline import ABORT_GRACE_S
        time.sleep(ABORT_GRACE_S)  # let the launcher forward our error line first
        mpi.COMM_WORLD.Abort(code)


if __name__ == "__main__":
    sys.exit(main())
