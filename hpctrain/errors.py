"""The one exception type users see, and the exit codes scripts rely on.

A HpctrainError is printed as one line (`hpctrain: error: ...`) with no
traceback; its exit code tells a job script what happened:

    0    done: the final record and --save written
    1    a bug: an uncaught exception, its traceback printed, the job aborted
    2    bad input: a flag, file, data, output or cluster layout (one line,
         nothing trained or written)
    3    a rank waited longer than --timeout (from before MPI_Init to
         MPI_Finalize); a roll call names the rank that stopped responding.
         Before MPI is up there is no MPI_Abort: the rank that says it
         exits 3 and the launcher ends the rest, and MPICH's mpirun may then
         report 9 (the SIGKILL of the rank it ended) in its place
    4    the loss became inf/nan (diverged): no checkpoint of those
         parameters; job scripts do not requeue it
    75   pre-empted (SIGTERM/SIGUSR1): a checkpoint written after the same
         step on every rank; requeue, and the same command resumes (EX_TEMPFAIL)
    130  interrupted (Ctrl-C, SIGINT): stopped at once without a new
         checkpoint; the checkpoints and metrics records written before are
         whole, temporary files removed (128 + SIGINT, as shells report it)
"""
import functools
import sys

EXIT_FAILURE = 1      # a bug: uncaught exception, traceback printed
EXIT_BAD_INPUT = 2    # bad flag, file, data or cluster layout
EXIT_TIMEOUT = 3      # a blocking wait passed --timeout; the message names the peer
EXIT_DIVERGED = 4     # the loss or the parameters became inf/nan: no checkpoint of them, no requeue
EXIT_PREEMPTED = 75   # SIGTERM/SIGUSR1: checkpoint written, requeue and --resume
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): stopped at once, no new checkpoint (128 + SIGINT, as shells do)


class HpctrainError(Exception):
    """An error the user can act on; `str(e)` is the whole message, one line."""

    exit_code = EXIT_BAD_INPUT
    # collective: every rank raised it at the same point, so all can simply
    # exit; otherwise the job must be aborted or the other ranks would hang.
    collective = False
    # report: this rank prints the message (one line per job, not per rank).
    report = True

    # detail: text the reporting rank prints above the line (a user's own
    # traceback, when their model file raised), or None.
    detail = None

    def __init__(self, message, exit_code=None, collective=False, report=True, detail=None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        self.collective = collective
        self.report = report
        self.detail = detail


def one_line_errors(main):
    """A command's main(argv, ...) that returns its exit code, with a
    HpctrainError it raises printed as its one line (`hpctrain: error: ...`,
    on standard error) and its exit code returned: the single-process
    commands' error tail, written once (train has its own: ranks agree)."""
    @functools.wraps(main)
    def command(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except HpctrainError as e:
            print(f"hpctrain: error: {e}", file=sys.stderr)
            return e.exit_code
    return command
