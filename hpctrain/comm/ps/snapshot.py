"""The server's side of checkpoints: the workers' data positions that go with
a version, OP_SNAPSHOT (at one cut, CutHold: write the slice and its
optimizer state into the folder the chief named, through the server's
`write`, and reply with what was written and the positions) and OP_RESTORE
(load them: the chief's initial parameters, or a checkpoint folder's
parts, which the server reads itself). Texts (a folder's path,
what was written, as JSON) travel as raw bytes: `send_text`, `receive_text`.

    mpirun -n 3 python -m pytest --only-mpi tests/test_ps.py -k snapshot

The leader keeps, per worker, the (version, epoch, offset) of its last two
pushes, newest first, so that a snapshot of version v can give each worker's
position after its batch for the newest gradient computed on an older version
(sync: round v-1, even if a fast worker already pushed for v).
"""
import json

import numpy as np
from mpi4py import MPI

from .protocol import FROM_FOLDER, H_NSTATE, H_T, H_VERSION, TAG_BULK, ProtocolError


def text_buffer(text):
    return np.frombuffer(text.encode(), np.uint8)


def receive_text(comm, rank):
    """The next message on TAG_BULK from rank: raw bytes, as text."""
    status = MPI.Status()
    comm.Probe(rank, TAG_BULK, status)
    buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
    comm.Recv(buf, rank, TAG_BULK)
    return bytes(buf).decode()


class DataPositions:
    """Per worker: its last two pushes' (version, epoch, offset), newest first; epoch -1: none."""

    def __init__(self, num_workers):
        self.num_workers = num_workers
        self.recent = np.full((num_workers, 2, 3), -1, np.int64)

    def record(self, worker, version, epoch, offset):
        rec = self.recent[worker]
        rec[1] = rec[0]
        rec[0] = version, epoch, offset

    def at(self, version):
        """(W, 2) int64: each worker's data position that goes with parameters
        of `version`: after the batch of its newest push computed on an older
        version. (-1, -1) where there is none."""
        out = np.full((self.num_workers, 2), -1, np.int64)
        for w in range(self.num_workers):
            for tag, epoch, offset in self.recent[w]:
                if epoch >= 0 and tag < version:
                    out[w] = epoch, offset
                    break
        return out

    def reset(self, version, positions):
        """After a restore of `version`: the positions that came with it."""
        self.recent[...] = -1
        self.recent[:, 0, 0] = version - 1
        self.recent[:, 0, 1:] = positions


def send_snapshot(server, w, folder):
    """OP_SNAPSHOT from worker w (the chief): the slice and its optimizer
    state written into `folder` (server.written), then the reply: header,
    what was written (JSON), positions."""
    rank = server.workers[w]
    written = text_buffer(json.dumps(server.written(folder)))
    header = server.ex.bulk_hdr
    server.fill_reply(header)
    with server.watchdog.waiting("snapshot to the chief", peer=rank):
        server.comm.Send(header, rank, TAG_BULK)
        server.comm.Send(written, rank, TAG_BULK)
        server.comm.Send(server.positions.at(server.round.version), rank, TAG_BULK)


def receive_restore(server, w, header):
    """OP_RESTORE from worker w (the chief): load slice, state (or zeros),
    or read them from a checkpoint folder (nstate FROM_FOLDER: server.read);
    version, t and positions; acknowledge; answer the pulls that waited."""
    rank = server.workers[w]
    states = server.opt.state()
    nstate = int(header[H_NSTATE])
    if nstate not in (0, len(states), FROM_FOLDER):
        raise ProtocolError(f"ps rank {server.rank}: restore with {nstate} state arrays, "
                            f"the optimizer has {len(states)}")
    server.quiesce()
    folder = None
    with server.watchdog.waiting("restore from the chief", peer=rank):
        if nstate == FROM_FOLDER:
            folder = receive_text(server.comm, rank)
        else:
            server.comm.Recv(server.ex.params, rank, TAG_BULK)
            for array in states.values():
                if nstate:
                    server.comm.Recv(array, rank, TAG_BULK)
                else:
                    array[...] = 0
        positions = np.empty((server.num_workers, 2), np.int64)
        server.comm.Recv(positions, rank, TAG_BULK)
    if folder is not None:
        server.read(folder, states)
    server.opt.t = int(header[H_T])
    dropped = server.round.restore(int(header[H_VERSION]))   # gradients of the old state mean nothing now
    server.positions.reset(server.round.version, positions)
    for v in dropped:
        server.repost(v)
    server.initialized = True
    ack = server.ex.bulk_hdr
    server.fill_reply(ack)
    with server.watchdog.waiting("restore acknowledgement", peer=rank):
        server.comm.Send(ack, rank, TAG_BULK)
    for v in range(server.num_workers):
        server.reply(v)


class CutHold:
    """A checkpoint is one cut (protocol.py): while it is taken this server
    may hold pushes (apply none) until OP_RELEASE, and a sync follower
    answers only once it reached the leader's version."""

    def __init__(self, server):
        self.server = server
        self.holding = False
        self.held = []               # round.Push, in order of arrival
        self.due = None              # (worker, version, folder): answer once at that version

    def holds(self, push):
        """Keep this push for later if a cut is being taken."""
        if self.holding:
            self.held.append(push)
        return self.holding

    def on_snapshot(self, w, version, folder):
        """Hold (where this server must) and write the snapshot into `folder`
        now, or once at `version` (a sync follower behind the leader's cut);
        -1: any version."""
        srv = self.server
        if srv.holds_for_cut:
            self.holding = True
        if version > srv.round.version:
            self.due = (w, version, folder)
            return
        if version >= 0 and version != srv.round.version:
            raise ProtocolError(f"ps rank {srv.rank}: snapshot of version {version} at version {srv.round.version}")
        send_snapshot(srv, w, folder)

    def answer_if_due(self):
        if self.due is not None and self.server.round.version >= self.due[1]:
            due, self.due = self.due, None
            self.on_snapshot(*due)

    def release(self):
        """The cut is taken: the held pushes, in their order of arrival, to apply now."""
        held, self.held, self.holding = self.held, [], False
        return held
