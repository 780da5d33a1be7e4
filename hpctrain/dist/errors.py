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

from ..base.errors import HpctrainError


class DistError(HpctrainError):
    """A call of hpctrain.dist that cannot be done: the message is one line."""


def install_hook(leave, abort):
    """sys.excepthook: an uncaught HpctrainError is its one line and its
    exit code: collective, `leave()` first (every rank is here: MPI is
    finalized); else `abort(code)` (MPI_Abort on the world). Anything else
    as before, then abort(1), so the other ranks do not wait for this one
    forever."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, HpctrainError):
            if value.report and str(value):
                print(f"hpctrain: error: {value}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            if value.collective:
                leave()
                os._exit(value.exit_code)
            abort(value.exit_code)
            os._exit(value.exit_code)
        previous(kind, value, tb)
        sys.stderr.flush()
        abort(1)

    sys.excepthook = hook
    return previous
