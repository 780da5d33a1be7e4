"""A rank's compute threads split a training step by samples
(`--thread-split samples`): the batch is cut into a fixed number of slices
(`--thread-slices S`, whatever the thread count), each slice runs whole
layers forward and backward on one thread, into a gradient buffer of its
own, and the slices' gradients are summed in slice order. So the bits
depend on S, never on the number of threads, as the ring's sums do not
depend on the rank count.

Why: the per-operation split (nn/threads.py, `--thread-split ops`) hands
work to the other thread many times a layer (30-90 us each on a 2-core VM)
and leaves the small operations on one thread; a slice per thread runs
forward and backward in one hand-off (a slice's backward needs its own
loss only: the step's loss is summed at the end), a thread whose slices
are done adds up the layers every slice has finished while the others
finish theirs (no meeting for the sum), and every operation stays on its
own core, as two ranks do. What one rank still loses against two at the
same batch per worker is mostly the slices' size: half the rows a
product, and each layer's fixed cost paid once a slice
(docs/benchmarks.md).

The arithmetic is not today's: each slice's loss is the mean over its own
samples, and the step's gradient is sum_s (n_s / n) * g_s (the slices'
sizes n_s as even as whole samples allow), which rounds differently from
one product over the whole batch. With one slice it is the model itself.
A layer whose training forward depends on the whole batch (batch norm's
statistics: a model with non-trainable state) cannot be split so: refused.

    python -m hpctrain.train --model gpt:layers=4,heads=4,width=128 --block-size 64 --batch-size 12 \\
        --data DIR --threads 2 --thread-split samples --thread-slices 2
    python -m pytest -q tests/test_sample_split.py
"""
import threading

import numpy as np

from . import threads


class SampleSplit:
    """Sequential.forward_backward's contract over `slices` copies of the
    model's layers (spec.build: each its own layers, contexts and gradient
    buffer, all over the model's parameter buffer), the summed gradient
    written into the model's own buffers (grads, and extra: a tied tensor's
    later uses' parts where combine=False)."""

    def __init__(self, spec, model, slices, xp=np):
        if spec.num_state:
            raise ValueError("--thread-split samples cannot split batch norm's statistics (they are the whole "
                             "batch's); use --thread-split ops")
        self.model, self.slices, self.xp = model, int(slices), xp
        # the first slice's gradient written in the model's own buffer: the sum starts there, no copy
        self.copies = [spec.build(xp, params=model.params, grads=model.grads if s == 0 else None, dtype=model.dtype)
                       for s in range(self.slices)]
        # what the layers' sums leave (the layers' ranges are the whole buffer in the models we build)
        edges = sorted(model.layer_ranges) + [(model.grads.size, model.grads.size)]
        self.gaps = [(a, b) for a, b in zip([0] + [hi for _, hi in edges[:-1]], [lo for lo, _ in edges]) if b > a]

    def forward_backward(self, x, y, on_layer_done=None, loss_out=None, on_forward_done=None, noise=None,
                         combine=True):
        """As Sequential.forward_backward: the batch's mean loss (an xp
        scalar), its gradient in model.grads, the hooks called as there
        but later: on_forward_done once every slice's backward is done too
        (the loss is the slices' sum), on_layer_done for every layer once
        the gradients' sum is done, last first."""
        n = len(x)
        cuts = threads.ranges(n, self.slices)   # whole samples; fewer slices than S where n < S
        runs = [copy.run for copy in self.copies[:len(cuts)]]
        losses = [None] * len(cuts)
        weights = [(hi - lo) / n for lo, hi in cuts]
        add = self._adder([c.grads for c in self.copies[:len(cuts)]], self.model.grads, weights)
        layers = _LayerSums(len(self.model.layer_ranges), len(cuts))

        def slices(t, a, b):
            # a slice's backward needs its own loss only (the sizes weigh the sum): each thread runs
            # its slices forward and backward without meeting the others in between, then adds up
            # the layers every slice has finished (the others may still be in their backwards)
            try:
                for s in range(a, b):
                    lo, hi = cuts[s]
                    runs[s].set_noise(None if noise is None else (noise[0], noise[1], noise[2][lo:hi]))
                    loss, dout = runs[s].loss_forward_backward(runs[s].forward(x[lo:hi], True), y[lo:hi])
                    losses[s] = float(loss)   # read before the backward, which may reuse its buffer
                    runs[s].backward(dout, on_layer_done=layers.done, combine=combine)
                for k in layers.ready():
                    add(*self.model.layer_ranges[k])
            except BaseException:
                layers.stop()   # the other threads wait for no layer of this one's
                raise

        # each thread a run of whole slices: which thread takes a slice or adds a layer changes nothing
        # but the time
        threads.run(slices, threads.ranges(len(cuts), threads.count()))
        for lo, hi in self.gaps:   # elements no layer's range holds (none in the models we build)
            add(lo, hi)
        loss = sum(float(w) * part for w, part in zip(weights, losses))
        loss = self.xp.asarray(loss, dtype=self.model.grads.dtype)
        if loss_out is not None:
            loss_out[...] = loss
        if on_forward_done is not None:   # after the backwards: the loss is the slices' sum
            on_forward_done()
        if self.model.extra.size:
            self._sum([c.extra for c in self.copies[:len(cuts)]], self.model.extra, weights)
        if on_layer_done is not None:
            for k in range(len(self.model.layer_ranges) - 1, -1, -1):
                on_layer_done(k)
        return loss

    def _sum(self, parts, out, weights):
        """out = sum_s weights[s] * parts[s], element ranges over the threads."""
        add = self._adder(parts, out, weights)
        threads.split(out.size, lambda t, lo, hi: add(lo, hi), floats=out.size * len(parts),
                      on=self.xp is np)

    def _adder(self, parts, out, weights):
        """add(lo, hi): out[lo:hi] = sum_s weights[s] * parts[s][lo:hi], in
        slice order (each element's sum the same whoever adds it, whenever);
        parts[0] may be out itself."""
        xp, dtype = self.xp, out.dtype
        ws = [dtype.type(w) for w in weights]
        even = all(w == ws[0] for w in ws)

        def add(lo, hi):
            o = out[lo:hi]
            if parts[0] is not out:
                xp.copyto(o, parts[0][lo:hi])
            if not even:
                o *= ws[0]
            for w, p in zip(ws[1:], parts[1:]):
                o += p[lo:hi] if even else p[lo:hi] * w
            if even and len(parts) > 1:
                o *= ws[0]
        return add


class _LayerSums:
    """The layers' gradient sums as tasks: layer k's is ready once every
    slice's backward has finished it (done(k), from each slice's backward);
    a thread whose slices are done takes the ready ones (ready()) until every
    layer is taken, so the sum overlaps the backwards still running and needs
    no meeting of its own."""

    def __init__(self, layers, slices):
        self.left = [slices] * layers   # the slices still to finish each layer
        self.order = []                 # the ready layers, in the order they became ready
        self.taken, self.layers, self.stopped = 0, layers, False
        self.cond = threading.Condition()

    def done(self, k):
        with self.cond:
            self.left[k] -= 1
            if not self.left[k]:
                self.order.append(k)
                self.cond.notify()

    def stop(self):
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def ready(self):
        while True:
            with self.cond:
                while self.taken == len(self.order) and self.taken < self.layers and not self.stopped:
                    self.cond.wait()
                if self.taken == self.layers or self.stopped:
                    return
                k = self.order[self.taken]
                self.taken += 1
                if self.taken == self.layers:
                    self.cond.notify_all()   # the threads still waiting: nothing is left for them
            yield k
