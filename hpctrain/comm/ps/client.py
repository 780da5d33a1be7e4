"""A worker's side of the parameter-server protocol: pull parameters into the
model's flat buffer, push its flat gradient buffer, all servers at once; and
the chief's checkpoint calls (restore, snapshot).

    mpirun -n 3 python -m hpctrain.comm.ps      # self-check: 1 ps, 2 workers, sync

A worker's message to a server is the concatenation of that server's ranges:
a view of the flat buffer when it is one range (no copy), a packed copy
otherwise. Workers post their reply receives first, then send to all servers.

With a shared-memory window (shared.py), a server on this node gets only
the headers: it reads the gradient in place, and the worker copies the
parameters out of the server's part of the window.

The buffers may be CuPy arrays (GPU workers on a CUDA-aware MPI, which reads
and writes device memory itself): then the stream is synchronized before
MPI may overwrite what kernels still read, and after packing (kernels)
before MPI reads the packed copies; unpacking is ordered on the stream.
"""
import json
import time
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from ...base.device import array_module
from ..deadline import NO_WATCHDOG
from .placement import Slice
from .protocol import (FROM_FOLDER, F_OWN_BUFFER, F_PREEMPTED, F_REJECTED, F_STOP, F_STOP_REQUEST, F_WANT_STATE,
                       H_EPOCH, H_FLAGS, H_LOSS, H_NORM, H_NSTATE, H_OFFSET, H_OP, H_T, H_VERSION, H_WORKER, HEADER,
                       OP_FINAL, OP_PULL, OP_PUSH, OP_RELEASE, OP_RESTORE, OP_SNAPSHOT, TAG_BULK, TAG_GRAD, TAG_HEADER,
                       TAG_PARAMS, TAG_REPLY, ProtocolError, loss_field, stats_length)
from .snapshot import receive_text, text_buffer
from ..waits import Waits


class Cut(NamedTuple):
    """Every server's state at one moment, each written by its server into
    the chief's folder: a checkpoint. versions and ts: each server's version
    and optimizer step; written: what each wrote (its writer's JSON, decoded);
    positions: the workers' data positions (W x 2) that go with the leader's
    version."""
    versions: list
    ts: list
    written: list
    positions: np.ndarray

    @property
    def consistent(self):
        """One version and one optimizer step on every server (sync: always;
        async with several servers: only when no update was in flight)."""
        return len(set(self.versions)) == 1 and len(set(self.ts)) == 1

    def describe(self):
        return f"ps versions {self.versions}, optimizer steps {self.ts}"


class Client:
    """A worker's side: pull parameters into `params`, push `grads` (both the
    flat buffers of the model), all servers at once."""

    def __init__(self, comm, server_ranks, placement, params, grads, worker, num_workers, *,
                 sync=True, watchdog=NO_WATCHDOG, nap=False, shared=None):
        self.comm = comm
        self.servers = list(server_ranks)
        self.num_servers = len(self.servers)
        self.worker, self.num_workers = worker, num_workers
        self.sync = sync
        self.watchdog = watchdog
        self.waits = Waits(nap)     # more ranks than cores: wait without busy-polling (comm/waits.py)
        self.placement = [list(r) for r in placement]
        self.params, self.grads = params, grads
        self.p_slices = [Slice(params, r) for r in self.placement]
        self.g_slices = [Slice(grads, r) for r in self.placement]
        self._init_window(shared)
        # Device buffers: the stream to synchronize before MPI touches them (None for NumPy).
        self._stream = None if isinstance(grads, np.ndarray) else array_module(grads).cuda.get_current_stream
        self.hdr_out = np.zeros((self.num_servers, HEADER), np.int64)
        self.hdr_in = np.zeros((self.num_servers, HEADER), np.int64)
        self.stats = np.zeros((self.num_servers, stats_length(num_workers)), np.float64)
        self._init_requests()
        self.versions = np.zeros(self.num_servers, np.int64)
        self.version = 0            # the leader's
        self.stop = False
        self.preempted = False
        self.stop_seen = False      # some server saw a stop signal: ask the leader to stop
        self.loss = float("nan")    # leader: mean loss of the last round (sync) / last gradient (async)
        self.grad_norm = float("nan")   # leader: the last sync round's pre-clip norm (--clip-norm)
        self.rejected = 0           # pushes the leader did not apply
        # perf_counter marks of the last exchange: sends started, replies in, done (for --timeline)
        self.marks = [0.0, 0.0, 0.0]

    def _init_window(self, shared):
        """Servers in this node's shared-memory window (shared.py): where their
        parameters (and this worker's reply buffer, if they keep one) are.
        The gradient buffer must be this worker's part of the window."""
        self.shared = shared
        self.in_window = [shared is not None and shared.on_node(r) for r in self.servers]
        self.window_params, self.window_replies = [None] * self.num_servers, [None] * self.num_servers
        if not any(self.in_window):
            return
        mine = shared.part(self.comm.Get_rank())
        if self.grads.ctypes.data != mine.ctypes.data:
            raise ProtocolError("the gradient buffer of a worker in the shared window must be its part of it")
        for k, rank in enumerate(self.servers):
            if self.in_window[k]:
                size, part = self.p_slices[k].size, shared.part(rank)
                self.window_params[k] = part[:size]
                # Its reply buffer for this worker, if the server keeps them (the
                # part may be longer than asked: F_OWN_BUFFER says which to read).
                if part.size >= size * (2 + self.worker):
                    self.window_replies[k] = part[size * (1 + self.worker): size * (2 + self.worker)]

    def _init_requests(self):
        comm, servers, every = self.comm, self.servers, range(self.num_servers)
        by_mpi = [k for k in every if not self.in_window[k]]   # the others: headers only
        self.send_hdr = [comm.Send_init(self.hdr_out[k], servers[k], TAG_HEADER) for k in every]
        send_grad = [comm.Send_init(self.g_slices[k].buf, servers[k], TAG_GRAD) for k in by_mpi]
        self.recv_hdr = [comm.Recv_init(self.hdr_in[k], servers[k], TAG_REPLY) for k in every]
        recv_params = {k: comm.Recv_init(self.p_slices[k].buf, servers[k], TAG_PARAMS) for k in by_mpi}
        self.replies = [[self.recv_hdr[k]] + ([recv_params[k]] if k in recv_params else []) for k in every]
        self.recvs = self.recv_hdr + list(recv_params.values())
        self.pushes = self.send_hdr + send_grad

    def waiting(self, what, peer=None):
        return self.watchdog.waiting(what, peer=peer)

    def _exchange(self, op, flags, loss=0.0, grads=False, what="parameters", position=(0, 0)):
        if self._stream is not None:   # kernels (the model's, last unpack) may still read what MPI overwrites
            self._stream().synchronize()
        MPI.Prequest.Startall(self.recvs)
        for k in range(self.num_servers):
            header = self.hdr_out[k]
            header[H_OP], header[H_WORKER], header[H_FLAGS] = op, self.worker, flags
            header[H_EPOCH], header[H_OFFSET] = position
            # sync: one version for all servers (the leader's), so rounds line up
            header[H_VERSION] = self.version if (self.sync or op != OP_PUSH) else self.versions[k]
            loss_field(header)[H_LOSS] = loss
        if grads:
            for k, piece in enumerate(self.g_slices):
                if not self.in_window[k]:
                    piece.pack()
            if self._stream is not None and any(piece.packed for piece in self.g_slices):
                self._stream().synchronize()   # the packing kernels are done before MPI reads
            if self.shared is not None:   # the gradient in the window is visible before the header says so
                self.shared.sync()
            MPI.Prequest.Startall(self.pushes)
        else:
            MPI.Prequest.Startall(self.send_hdr)
        marks = self.marks
        marks[0] = time.perf_counter()
        for k in range(self.num_servers):
            with self.waiting(what, peer=self.servers[k]):
                self.waits.all(self.replies[k])
        marks[1] = time.perf_counter()
        with self.waiting("sending to the servers", peer=self.servers):
            self.waits.all(self.pushes if grads else self.send_hdr)
        self._read_replies()
        marks[2] = time.perf_counter()

    def _read_replies(self):
        if self.shared is not None:
            self.shared.sync()
        for k in range(self.num_servers):
            header = self.hdr_in[k]
            if self.in_window[k]:
                self.p_slices[k].buf[...] = self._window_source(k, header)
            self.p_slices[k].unpack()
            self.versions[k] = header[H_VERSION]
            if header[H_FLAGS] & F_STOP_REQUEST:
                self.stop_seen = True
        lead = self.hdr_in[0]
        self.version = int(lead[H_VERSION])
        self.stop = bool(lead[H_FLAGS] & F_STOP)
        self.preempted = bool(lead[H_FLAGS] & F_PREEMPTED)
        self.loss = float(loss_field(lead)[H_LOSS])
        self.grad_norm = float(loss_field(lead)[H_NORM])
        if lead[H_FLAGS] & F_REJECTED:
            self.rejected += 1

    def _window_source(self, k, header):
        if not header[H_FLAGS] & F_OWN_BUFFER:
            return self.window_params[k]
        if self.window_replies[k] is None:
            raise ProtocolError(f"ps rank {self.servers[k]} replied from a reply buffer it does not have")
        return self.window_replies[k]

    def pull(self, min_version=0):
        """Parameters of version >= min_version (the first pull waits for the chief's restore)."""
        self.version = min_version
        self._exchange(OP_PULL, 0, what="pull parameters")

    def push_pull(self, loss, stop_request=False, position=(0, 0)):
        """Push the gradient (computed on the last pulled version) with the data
        position after its batch; receive new parameters."""
        flags = F_STOP_REQUEST if (stop_request or self.stop_seen) else 0
        self._exchange(OP_PUSH, flags, loss, grads=True, what="push gradients, pull parameters",
                       position=position)

    def final(self, folder=None):
        """Say done; once every worker is, receive the final parameters and each
        server's statistics. Returns (stats, cut): stats one row per server;
        with `folder` (a checkpoint's temporary folder) every server writes
        its final slice and optimizer state there and cut is the Cut of what
        they wrote, else None."""
        path = None if folder is None else text_buffer(folder)
        # the folder rides right behind the request (each server reads it on OP_FINAL)
        sends = [] if path is None else [self.comm.Isend(path, rank, TAG_BULK) for rank in self.servers]
        reqs = [self.comm.Irecv(self.stats[k], self.servers[k], TAG_BULK) for k in range(self.num_servers)]
        flags = (F_PREEMPTED if self.preempted else 0) | (F_WANT_STATE if folder is not None else 0)
        self._exchange(OP_FINAL, flags, what="final parameters")
        with self.waiting("final statistics", peer=self.servers):
            MPI.Request.Waitall(reqs + sends)
        cut = None
        if folder is not None:
            written, positions = [], self._positions()
            for k, rank in enumerate(self.servers):
                with self.waiting("final state", peer=rank):
                    written.append(self._receive_written(k, positions))
            cut = Cut([int(h[H_VERSION]) for h in self.hdr_in], [int(h[H_T]) for h in self.hdr_in], written,
                      positions)
        for req in self.pushes + self.recvs:
            req.Free()
        return self.stats, cut

    def _positions(self):
        """The workers' data positions, W x 2, none yet."""
        return np.zeros((self.num_workers, 2), np.int64)

    def _receive_written(self, k, positions):
        """From server k on TAG_BULK: what it wrote (JSON), then the workers'
        data positions, kept from the leader (k = 0) only."""
        rank = self.servers[k]
        written = json.loads(receive_text(self.comm, rank))
        self.comm.Recv(positions if k == 0 else self._positions(), rank, TAG_BULK)
        return written

    # --- checkpoint support (chief) ----------------------------------------
    def restore(self, version, t, params=None, states=None, positions=None, folder=None):
        """Load every server: its slice of `params` (full flat array) and, when
        `states` (name -> full flat array, in the optimizer's state order) is
        given, of each optimizer state; or, with `folder` (a checkpoint's),
        what each server reads there itself; version, optimizer step t, and the
        workers' data positions (W x 2, default zeros) that go with them."""
        states = states or {}
        positions = self._positions() if positions is None else \
            np.ascontiguousarray(positions, np.int64).reshape(self.num_workers, 2)
        for k, rank in enumerate(self.servers):
            header = self.hdr_out[k]
            header[:] = 0
            header[H_OP], header[H_VERSION], header[H_WORKER] = OP_RESTORE, version, self.worker
            header[H_T], header[H_NSTATE] = t, len(states) if folder is None else FROM_FOLDER
            with self.waiting("restore servers", peer=rank):
                self.comm.Send(header, rank, TAG_HEADER)
                if folder is not None:
                    self.comm.Send(text_buffer(folder), rank, TAG_BULK)
                for flat in [params, *states.values()] if folder is None else []:
                    piece = Slice(np.ascontiguousarray(flat, self.params.dtype), self.placement[k])
                    piece.pack()
                    self.comm.Send(piece.buf, rank, TAG_BULK)
                self.comm.Send(positions, rank, TAG_BULK)
                self.comm.Recv(self.hdr_in[k], rank, TAG_BULK)
            self.versions[k] = self.hdr_in[k][H_VERSION]
        self.version = int(version)

    def snapshot(self, folder):
        """A Cut of every server, each writing its slice and optimizer state
        into `folder` (a checkpoint's temporary folder): the leader first (it
        holds, and its version is the cut's), then each other server, sync at
        that version, async held as it is (its version may differ); then
        every server is released."""
        path, positions = text_buffer(folder), self._positions()
        versions, ts, written = [], [], []
        for k, rank in enumerate(self.servers):
            # sync: followers answer at the leader's version; async: each as it is, held
            target = versions[0] if k and self.sync else -1
            self._send_header(k, OP_SNAPSHOT, target, "snapshot")
            reply = self.hdr_in[k]
            with self.waiting("snapshot", peer=rank):
                self.comm.Send(path, rank, TAG_BULK)
                # while the server writes: polled where ranks nap, so that a Ctrl-C reaches
                # Python here and the folder is removed (a blocking Recv would sit in C)
                self.waits.one(self.comm.Irecv(reply, rank, TAG_BULK))
                written.append(self._receive_written(k, positions))
            versions.append(int(reply[H_VERSION]))
            ts.append(int(reply[H_T]))
        for k in range(self.num_servers):
            self._send_header(k, OP_RELEASE, -1, "release after the snapshot")
        return Cut(versions, ts, written, positions)

    def _send_header(self, k, op, version, what):
        header = self.hdr_out[k]
        header[:] = 0
        header[H_OP], header[H_VERSION], header[H_WORKER] = op, version, self.worker
        with self.waiting(what, peer=self.servers[k]):
            self.comm.Send(header, self.servers[k], TAG_HEADER)
