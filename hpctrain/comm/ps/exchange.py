"""A server's buffers and persistent requests towards its workers: its
parameter slice, a reply buffer per worker (where replies must not wait for
each other), where each worker's gradient slice lands, and the pre-posted
receives (headers, gradients) and sends (reply headers, parameters).
server.py decides what goes when; this holds what it goes through.

    mpirun -n 3 python -m hpctrain.comm.ps      # self-check: 1 ps, 2 workers, sync

With a shared-memory window (shared.py) the slice and the reply buffers
are this server's part of it, and a worker in the window pushes and pulls
with a header only: its gradient is read in its own buffer (a view for one
range, packed for several), its parameters copied out of the window.
"""
import time

import numpy as np
from mpi4py import MPI

from .placement import Slice, slice_size
from .protocol import F_OWN_BUFFER, H_FLAGS, HEADER, TAG_BULK, TAG_GRAD, TAG_HEADER, TAG_PARAMS, TAG_REPLY


class Exchange:
    """comm: the protocol's communicator; ranges: this server's (lo, hi);
    workers: their ranks; shared: the node's SharedExchange or None;
    own_replies: a reply buffer per worker; waits, watchdog: how to wait
    (comm/waits.py) and under which deadline; times: the server's seconds per
    activity (stats.py); dtype: the parameters' and gradients' (the run's
    precision.params), what the protocol's raw buffers hold."""

    def __init__(self, comm, ranges, workers, shared, own_replies, waits, watchdog, times, dtype):
        self.comm, self.workers, self.shared = comm, list(workers), shared
        self.waits, self.watchdog, self.times = waits, watchdog, times
        self.size = slice_size(list(ranges))
        W = len(self.workers)
        if shared is not None:
            self.params = shared.server_params(comm.Get_rank(), self.size)
            self.params[...] = 0
            self.reply_bufs = shared.server_reply_bufs(comm.Get_rank(), self.size, W) if own_replies else None
        else:
            self.params = np.zeros(self.size, dtype)
            self.reply_bufs = np.zeros((W, self.size), dtype) if own_replies else None
        self.in_window = np.array([shared is not None and shared.on_node(r) for r in self.workers], bool)
        self.grad_views = [Slice(shared.part(r), list(ranges)) if self.in_window[w]
                           else None for w, r in enumerate(self.workers)]
        self.grads = [view.buf if view is not None else np.zeros(self.size, dtype) for view in self.grad_views]
        self.grad_posted = np.zeros(W, bool)     # a gradient receive is active
        self.grad_arrived = np.zeros(W, bool)    # ... and completed, its header not yet here
        self.push_pending = [None] * W           # a push header whose gradient is still coming
        self.sending = np.zeros(W, bool)         # a reply is on its way
        self.hdr_in = np.zeros((W, HEADER), np.int64)
        self.hdr_out = np.zeros((W, HEADER), np.int64)
        self.bulk_hdr = np.zeros(HEADER, np.int64)
        every = list(enumerate(self.workers))
        self.req_hdr = [comm.Recv_init(self.hdr_in[w], r, TAG_HEADER) for w, r in every]
        self.req_grad = [comm.Recv_init(self.grads[w], r, TAG_GRAD) for w, r in every]
        self.send_hdr = [comm.Send_init(self.hdr_out[w], r, TAG_REPLY) for w, r in every]
        self.send_params = [comm.Send_init(self.params if self.reply_bufs is None else self.reply_bufs[w], r,
                                           TAG_PARAMS) for w, r in every]
        # What a reply to each worker sends: the header, and the parameters unless they are in the window.
        self.reply_reqs = [[self.send_hdr[w]] + ([] if self.in_window[w] else [self.send_params[w]])
                           for w in range(W)]

    def post_gradient(self, w):
        """Receive worker w's next gradient (a worker in the window needs none)."""
        if not self.grad_posted[w] and not self.in_window[w]:
            self.req_grad[w].Start()
            self.grad_posted[w] = True

    def cancel_gradient(self, w):
        if self.grad_posted[w]:
            self.req_grad[w].Cancel()
            self.req_grad[w].Wait()
            self.grad_posted[w] = False

    def push_header(self, w, push):
        """Worker w's push header (`push`) is here: its header receive is
        posted again (the worker sends no other until it has our reply).
        Returns the push once its gradient is here too, else None."""
        self.push_pending[w] = push
        self.req_hdr[w].Start()
        if self.in_window[w]:   # the gradient is already where the worker wrote it: visible, packed
            self.shared.sync()
            self.grad_views[w].pack()
            self.grad_arrived[w] = True
        return self._complete(w)

    def gradient_arrived(self, w):
        """Worker w's gradient receive completed: its push, if the header is here."""
        self.grad_posted[w] = False
        self.grad_arrived[w] = True
        return self._complete(w)

    def _complete(self, w):
        push = self.push_pending[w]
        if push is None or not self.grad_arrived[w]:
            return None
        self.push_pending[w], self.grad_arrived[w] = None, False
        return push

    def wait_reply(self, w):
        """Worker w's last reply has left (hdr_out[w] may be filled again)."""
        t0 = time.perf_counter()
        if self.sending[w]:
            with self.watchdog.waiting("parameter reply", peer=self.workers[w]):
                self.waits.all(self.reply_reqs[w])
        self.times["send_wait"] += time.perf_counter() - t0

    def send_reply(self, w):
        """Start the reply in hdr_out[w] (filled), with the parameters as they are now."""
        if self.reply_bufs is not None:
            self.reply_bufs[w][...] = self.params
            self.hdr_out[w][H_FLAGS] |= F_OWN_BUFFER
        if self.in_window[w]:   # the worker copies them out of the window once it has the header
            self.shared.sync()
        MPI.Prequest.Startall(self.reply_reqs[w])
        self.sending[w] = True

    def wait_replies(self):
        """Every reply on its way has left."""
        busy = np.flatnonzero(self.sending)
        if len(busy) == 0:
            return
        t0 = time.perf_counter()
        with self.watchdog.waiting("parameter replies", peer=[self.workers[w] for w in busy]):
            self.waits.all([req for w in busy for req in self.reply_reqs[w]])
        self.sending[:] = False
        self.times["send_wait"] += time.perf_counter() - t0

    def final_sends(self, w, stats, extra):
        """Requests of worker w's final reply (hdr_out[w], filled): header,
        parameters unless in the window (no F_OWN_BUFFER: it copies params
        out of the window), statistics, then `extra` arrays."""
        rank, comm = self.workers[w], self.comm
        reqs = [comm.Isend(self.hdr_out[w], rank, TAG_REPLY)]
        if not self.in_window[w]:
            reqs.append(comm.Isend(self.params, rank, TAG_PARAMS))
        return reqs + [comm.Isend(array, rank, TAG_BULK) for array in [stats, *extra]]

    def free(self, present):
        for w in present:
            for req in (self.req_hdr[w], self.req_grad[w], self.send_hdr[w], self.send_params[w]):
                req.Free()
