"""Parameter-server protocol: where the parameters live, the server loop and
the worker's client. Takes a communicator and contiguous 1-D float32 arrays;
knows nothing about models. The server also takes, as objects, what it
needs to update its slice itself: the optimizer (`step(params, grads, lr,
grad_scale)`, `state()` and `t`), the lr function and the clip (server.py).

    mpirun -n 3 python -m hpctrain.comm.ps      # self-check: 1 ps, 2 workers, sync

    placement.py  place, describe, Slice: which ranges of the flat vector each server holds
    protocol.py   header layout, op codes, flags, tags, statistics layout, ProtocolError
    round.py      Round, Push, Decision; Sync and Async: what to do with a push (pure, no MPI)
    server.py     Server: the request loop, carrying decisions out, replies, the end
    aggregate.py  Update: one update's arithmetic (worker-order sum, DC-ASGD, clip, optimizer)
    leader.py     RoundLink: the leader's sync round decisions to the other servers
    exchange.py   Exchange: a server's buffers and persistent requests towards its workers
    snapshot.py   the server's side of checkpoints (snapshot, restore, data positions)
    client.py     Client: a worker's pull/push, the chief's restore and snapshot
    shared.py     open_shared, SharedExchange: a node's shared-memory window (--ps-exchange auto)
    silence.py    SilenceWatch: ps 0 names a worker gone quiet, ends the job at the deadline
    stats.py      ServerStats and summarize (the final record's ps fields)
"""
from .aggregate import BLOCK, dc_compensate
from .client import Client, Cut
from .placement import PLACEMENTS, Slice, describe, place
from .protocol import ProtocolError
from .round import Async, Decision, Push, Round, Sync
from .server import Server
from .stats import ServerStats, summarize

__all__ = ["BLOCK", "PLACEMENTS", "Async", "Client", "Cut", "Decision", "ProtocolError", "Push", "Round", "Server",
           "ServerStats", "Slice", "Sync", "dc_compensate", "describe", "place", "summarize"]
