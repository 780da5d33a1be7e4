"""Parameter-server protocol: where the parameters live, the server loop and
the worker's client. Takes a communicator and contiguous 1-D float32 arrays;
knows nothing about models (the optimizer comes in as an object with
`step(params, grads, lr, grad_scale)`, `state()` and `t`).

    mpirun -n 3 python -m hpctrain.comm.ps      # self-check: 1 ps, 2 workers, sync

    placement.py  place, describe, Slice: which ranges of the flat vector each server holds
    protocol.py   header layout, op codes, flags, tags, statistics layout, ProtocolError
    server.py     Server: the request loop, replies, the end
    aggregate.py  SyncRounds and AsyncApply (bounded staleness, DC-ASGD)
    snapshot.py   the server's side of checkpoints (snapshot, restore, data positions)
    client.py     Client: a worker's pull/push, the chief's restore and snapshot
    shared.py     open_shared, SharedExchange: a node's shared-memory window (--ps-exchange auto)
    silence.py    SilenceWatch: ps 0 names a worker gone quiet, ends the job at the deadline
    stats.py      ServerStats and summarize (the final record's ps fields)
"""
from .aggregate import BLOCK, AsyncApply, SyncRounds, dc_compensate
from .client import Client, Cut
from .placement import PLACEMENTS, Slice, describe, place
from .protocol import ProtocolError
from .server import Server
from .stats import ServerStats, summarize

__all__ = ["BLOCK", "PLACEMENTS", "AsyncApply", "Client", "Cut", "ProtocolError", "Server", "ServerStats", "Slice",
           "SyncRounds", "dc_compensate", "describe", "place", "summarize"]
