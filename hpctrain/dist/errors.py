"""hpctrain.dist's one error type, and how it ends a user's script: one
line `hpctrain: error: ...` and the exit code (2 for a bad call, 3 for a
deadline), as the hpctrain program ends.

A user's training loop is theirs: a DistError is an ordinary exception they
may catch. Uncaught, the hook installed by hpctrain.dist.init() prints its
one line (on the rank that has it to say) and ends the process with its
code: every rank at once when the error is collective (every rank found it
in the same call, so each leaves without waiting for the others), else
through MPI_Abort, so no rank is left in a collective.

    python -c "from hpctrain.dist.errors import DistError; print(DistError('x').exit_code)"
"""
import os
import sys
import time

from ..base.errors import HpctrainError
from ..comm.deadline import ABORT_GRACE_S

SILENT_WAIT_S = 10.0   # how long a silent rank of a process set waits for the speaking rank's MPI_Abort


class DistError(HpctrainError):
    """A call of hpctrain.dist that cannot be done: the message is one line.
    world: a collective error is the whole world's (every rank raised it);
    False where only a process set's ranks did (the others know nothing)."""

    def __init__(self, message, exit_code=None, collective=False, report=True, world=True):
        super().__init__(message, exit_code, collective, report)
        self.world = world


def install_hook(leave, abort):
    """sys.excepthook: an uncaught HpctrainError is its one line and its
    exit code: collective over the world, `leave()` first (every rank is
    here: MPI is finalized); else `abort(code)` (MPI_Abort on the world: a
    process set's ranks that raised it together do not wait for the ranks
    outside it, which know nothing of it). Anything else
    as before, then abort(1), so the other ranks do not wait for this one
    forever."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, HpctrainError):
            if value.report and str(value):
                print(f"hpctrain: error: {value}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            if value.collective and getattr(value, "world", True):
                leave()
                os._exit(value.exit_code)
            if value.collective and not value.report:
                # a process set's rank that did not print: the one that did aborts the job; MPI's
                # "Abort(2) on node ..." lines of several ranks at once cut into its line
                time.sleep(SILENT_WAIT_S)
            else:
                # MPI_Abort's launcher ends every process at once: a line not yet forwarded from
                # the pipe is lost (seen under load), so the launcher gets the time the program gives it
                time.sleep(ABORT_GRACE_S)
            abort(value.exit_code)
            os._exit(value.exit_code)
        previous(kind, value, tb)
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)   # (the traceback forwarded first, as above)
        abort(1)

    sys.excepthook = hook
    return previous
