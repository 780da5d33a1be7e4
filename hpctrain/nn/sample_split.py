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
loss only: the step's loss is summed at the end), the threads meet again
only for the gradients' sum, and every operation stays on its own core, as
two ranks do. What one rank still loses against two at the same batch per
worker is mostly the slices' size: half the rows a product, and each
layer's fixed cost paid once a slice (docs/benchmarks.md).

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

        def slices(t, a, b):
            # a slice's backward needs its own loss only (the sizes weigh the sum below): each thread
            # runs its slices forward and backward without meeting the others in between
            for s in range(a, b):
                lo, hi = cuts[s]
                runs[s].set_noise(None if noise is None else (noise[0], noise[1], noise[2][lo:hi]))
                loss, dout = runs[s].loss_forward_backward(runs[s].forward(x[lo:hi], True), y[lo:hi])
                losses[s] = float(loss)   # read before the backward, which may reuse its buffer
                runs[s].backward(dout, combine=combine)

        # each thread a run of whole slices: which thread takes a slice changes nothing but the time
        threads.run(slices, threads.ranges(len(cuts), threads.count()))
        weights = [(hi - lo) / n for lo, hi in cuts]
        loss = sum(float(w) * part for w, part in zip(weights, losses))
        loss = self.xp.asarray(loss, dtype=self.model.grads.dtype)
        if loss_out is not None:
            loss_out[...] = loss
        if on_forward_done is not None:   # after the backwards: the loss is the slices' sum
            on_forward_done()
        self._sum([c.grads for c in self.copies[:len(cuts)]], self.model.grads, weights)
        if self.model.extra.size:
            self._sum([c.extra for c in self.copies[:len(cuts)]], self.model.extra, weights)
        if on_layer_done is not None:
            for k in range(len(self.model.layer_ranges) - 1, -1, -1):
                on_layer_done(k)
        return loss

    def _sum(self, parts, out, weights):
        """out = sum_s weights[s] * parts[s], in slice order, element ranges
        over the threads (each element's sum the same whoever adds it);
        parts[0] may be out itself."""
        xp, dtype = self.xp, out.dtype
        ws = [dtype.type(w) for w in weights]
        even = all(w == ws[0] for w in ws)

        def add(t, lo, hi):
            o = out[lo:hi]
            if parts[0] is not out:
                xp.copyto(o, parts[0][lo:hi])
            if not even:
                o *= ws[0]
            for w, p in zip(ws[1:], parts[1:]):
                o += p[lo:hi] if even else p[lo:hi] * w
            if even and len(parts) > 1:
                o *= ws[0]
        threads.split(out.size, add, most=threads.most(floats=out.size * len(parts)), on=xp is np)
