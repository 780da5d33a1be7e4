"""A stage's transfers to one neighbour, as the engine (engine.py) makes them
each step: sends bounded and receives posted early, all from pools of host
buffers allocated once warm (Megatron batches its isend/irecv the same way).

- `Sends`: each send a copy into a pooled buffer (the model copy whose
  output it is serves its next micro-batch before the send completes), at
  most `cap` in flight: beyond, the oldest is waited for and its buffer
  reused. cap is the stage's model copies (the schedule's activations in
  flight): micro-batch m + cap's forward comes after m's backward, which
  waited for what the neighbour sent after receiving m, so the wait finds
  that send done.
- `Receives`: the step's receives in the schedule's order, up to `ahead` of
  them posted before their action asks (so a transfer overlaps the compute
  before it), each into a free buffer; a buffer comes back (`release`) when
  the micro-batch's backward no longer reads it (the stage's first layer
  keeps its input).

Takes a communicator (the grid's pipe communicator), the watchdog and the
world's waits (comm/waits.py: napping where ranks outnumber cores, so a
stage that waits leaves the cores to the one that computes); never imports
MPI itself.

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --micro-batches 8 --steps 20 --timeline t.json
"""
from collections import deque

import numpy as np

from ..base import device
from ..comm.waits import Waits
from ..base.precision import FLOAT32


class Pool:
    """Host buffers of one shape and dtype (the run's precision.compute),
    taken and given back."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.free = tuple(shape), np.dtype(dtype), []

    def take(self):
        if self.free:
            return self.free.pop()
        return np.empty(self.shape, self.dtype)

    def give(self, buffer):
        self.free.append(buffer)


def micro_batch(tag):
    return f"micro-batch {tag}"


class Sends:
    def __init__(self, comm, dest, shape, cap, watchdog, what, peer, label=micro_batch, waits=None,
                 dtype=FLOAT32.compute):
        self.comm, self.dest, self.cap, self.watchdog, self.what, self.peer = comm, dest, max(1, cap), watchdog, what, peer
        self.waits = waits or Waits(False)
        self.label = label   # a tag in words
        self.pool, self.flight = Pool(shape, dtype), deque()

    def send(self, array, tag, xp):
        if len(self.flight) >= self.cap:
            request, buffer = self.flight.popleft()
            with self.watchdog.waiting(f"pipeline {self.what} send before {self.label(tag)}", peer=self.peer):
                self.waits.one(request)
            self.pool.give(buffer)
        device.synchronize(xp)
        host = self.pool.take()
        np.copyto(host, device.to_host(array), casting="same_kind")
        self.flight.append((self.comm.Isend(host, dest=self.dest, tag=tag), host))

    def requests(self):
        return [request for request, _ in self.flight]

    def done(self):
        """After the step's Waitall: every buffer back in the pool."""
        while self.flight:
            self.pool.give(self.flight.popleft()[1])


class Receives:
    def __init__(self, comm, source, shape, tags, ahead, watchdog, what, peer, label=micro_batch, waits=None,
                 dtype=FLOAT32.compute):
        self.comm, self.source, self.tags, self.ahead = comm, source, list(tags), max(1, ahead)
        self.waits = waits or Waits(False)
        self.label = label
        self.watchdog, self.what, self.peer = watchdog, what, peer
        self.pool = Pool(shape, dtype)
        self.pending, self.posted = deque(), {}

    def start(self):
        """A step begins: its receives, in order, the first ones posted now."""
        self.pending = deque(self.tags)
        self._post()

    def _post(self):
        while self.pending and len(self.posted) < self.ahead:
            tag = self.pending.popleft()
            buffer = self.pool.take()
            self.posted[tag] = (self.comm.Irecv(buffer, source=self.source, tag=tag), buffer)

    def get(self, tag):
        """Micro-batch `tag`'s buffer, once its data are in."""
        if tag not in self.posted:   # (ahead of what the order says: post the rest first)
            self._post()
        request, buffer = self.posted.pop(tag)
        with self.watchdog.waiting(f"pipeline {self.what} of {self.label(tag)} from stage {self.source}",
                                   peer=self.peer):
            self.waits.one(request)
        self._post()
        return buffer

    def release(self, buffer):
        """The buffer is read no more: back to the pool, and the next receive posted."""
        self.pool.give(buffer)
        self._post()
