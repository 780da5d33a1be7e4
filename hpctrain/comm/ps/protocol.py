"""What servers and workers must agree on, in one place: the header layout,
op codes, flags, tags, the final statistics' layout, and the loss that rides
in an int64 header field. Nothing here sends or receives.

    python -c "import hpctrain.comm.ps.protocol as p; print(p.HEADER, p.OP_PULL, p.OP_RELEASE)"

Every request and reply starts with one int64 header of HEADER fields
(buffer-form Send/Recv, nothing pickled), followed by raw float32 buffers:

    worker -> server  TAG_HEADER  [op, version, worker, flags, stop, t, nstate, loss, epoch, offset]
                      TAG_GRAD    gradient slice (OP_PUSH only)
    server -> worker  TAG_REPLY   header: op=OP_REPLY, version, flags, stop version, loss, norm
                      TAG_PARAMS  parameter slice
Between a worker and a server in one shared-memory window (shared.py) only
the headers travel: the server reads the gradient in the worker's buffer, the
worker copies the parameters from the server's part of the window.
    either way        TAG_BULK    snapshot/restore payloads, final statistics
    ps 0 -> ps k      TAG_ROUND   header + W member flags: who is in round `version` (sync)

`loss` is a float64 stored in the int64 field's bits, and so is a reply's
`norm`: the pre-clip 2-norm of the last sync round's averaged gradient
(--clip-norm; nan without it); (epoch, offset) is the pushing worker's data
position after the batch of this gradient. Ops:

    OP_PULL      reply with the parameters once version >= header version
    OP_PUSH      a gradient computed on `version`; reply with the parameters
                 after it is used or dropped (sync: once version > its version)
    OP_FINAL     the worker is done; reply (parameters + statistics) when all are;
                 with F_WANT_STATE also the optimizer state and data positions
    OP_SNAPSHOT  (chief) reply on TAG_BULK: header (version, t, nstate), the
                 parameter slice, each optimizer state array in order, and the
                 workers' data positions (int64 W x 2) that go with that version
    OP_RESTORE   (chief) header (version, t, nstate) then, on TAG_BULK, the
                 slice, nstate state arrays (0: reset the state) and the data
                 positions (W x 2); ack on TAG_BULK. nstate FROM_FOLDER: a
                 checkpoint folder's path in place of the arrays, from which
                 the server reads its slice and state itself.
    OP_RELEASE   (chief) the snapshot is taken: apply the pushes held since.

A checkpoint is one cut: the chief asks the leader first (version -1); the
leader holds (applies no gradient) and answers with its version v; then each
other server is asked for v: a sync follower answers once it applied round
v-1 (it cannot pass v: the leader decides no round while it holds), an async
one holds and answers at once, at its own version (the checkpoint's step is
the leader's). OP_RELEASE ends every hold.
"""
import numpy as np

HEADER = 11
H_OP, H_VERSION, H_WORKER, H_FLAGS, H_STOP, H_T, H_NSTATE, H_LOSS, H_EPOCH, H_OFFSET, H_NORM = range(HEADER)

OP_PULL, OP_PUSH, OP_FINAL, OP_SNAPSHOT, OP_RESTORE, OP_REPLY, OP_ROUND, OP_RELEASE = 1, 2, 3, 4, 5, 6, 7, 8

FROM_FOLDER = -1     # OP_RESTORE's nstate: the server reads its parts from a checkpoint folder

F_STOP_REQUEST = 1   # a stop signal was seen: please stop soon
F_STOP = 2           # reply: the leader's version reached its stop version: stop now
F_PREEMPTED = 4      # the stop came from a signal, not from the step budget
F_REJECTED = 8       # reply: your gradient was not applied (stale, too stale, or past the end)
F_WANT_STATE = 16    # OP_FINAL: also send the optimizer state and data positions (a checkpoint)
F_OWN_BUFFER = 32    # reply, shared-memory exchange: the parameters are in the worker's reply buffer, not params

TAG_HEADER, TAG_GRAD, TAG_REPLY, TAG_PARAMS, TAG_BULK, TAG_ROUND = 101, 102, 103, 104, 105, 106
TAG_WAKE = 107       # a server to itself (COMM_SELF): its SilenceWatch has news

HIST_BINS = 32       # staleness histogram: 0..30, and 31+ in the last bin

# Statistics a server sends with its final reply (float64): counts, then the
# seconds its loop spent per activity (T_NAMES, from serve_until_done to the
# last request); then W pushes, W dropped, W abandoned (1: the worker never
# came back, the run ended without it), HIST_BINS histogram counts.
S_VERSION, S_UPDATES, S_STALE, S_AFTER_STOP, S_ST_SUM, S_ST_COUNT, S_ST_MAX, S_ELEMENTS = range(8)
T_NAMES = ("idle", "aggregate", "optimizer", "reply", "send_wait", "total")
S_TIMES = 8
S_FIXED = S_TIMES + len(T_NAMES)


class ProtocolError(RuntimeError):
    """A message that the protocol does not allow: a bug, not bad input."""


def stats_length(num_workers):
    return S_FIXED + 3 * num_workers + HIST_BINS


def loss_field(header):
    """The header as float64: index H_LOSS (H_NORM) reads or writes the loss's (norm's) bits."""
    return header.view(np.float64)
