"""One pipeline stage's model (or, with --virtual-stages V, one of its V
chunks: loops/pipe.py makes a Stage per chunk, `s` then the model's chunk
index in the PV + 1 cuts): layers [a, b) of the spec's list over the
stage's slice of the flat buffers, run by the model's own runner
(nn/sequential.LayerRange), so that the pipeline's arithmetic is that of the
whole model, call for call. Never imports MPI.

A stage keeps one set of layers (one StageModel) and `copies` slots of
contexts (nn/layers.py Context), the schedule's peak of micro-batches in
flight (schedule.peak_activations: GPipe M, 1F1B min(P - s, M); a chunk's:
schedule.chunk_peaks): a layer's forward leaves in its slot's context what
its backward needs, so a slot holds one micro-batch's activations from
`forward(m)` to `backward(m)` and then serves the next forward. That bound
is the stage's activation memory. The slots share the stage's layers,
parameter, state and gradient buffers: a slot's backward
writes micro-batch m's gradient (`grad`), which the engine adds to the
step's sum (`grads`, the buffer the replicas average) right away (every
schedule backprops in micro-batch order 0..M-1) through the step gradient of
every loop (comm/step_gradient.py): g0, += g1 ... g_{M-1}. A tied tensor's
later uses (nn/tied.py) are summed apart the same way and combined after
the last backward; pipeline/tied.py then sums a tensor whose uses lie on
several stages.

    python -m pytest -q tests/test_pipeline.py
"""
from ..nn.sequential import LayerRange
from ..nn.store import PlainStore
from .stages import ranges


class StageModel:
    """Layers [a, b) over a parameter store (nn/store.py; the stage's is the
    plain store over its slices of the model's buffers): the model's one
    runner (nn/sequential.LayerRange) over the stage's range, with a slot
    per micro-batch in flight, and on the last stage the model's loss, whose
    gradient (one buffer per slot) backward starts from."""

    def __init__(self, spec, a, b, xp, store, slots):
        self.run = LayerRange(spec, a, b, xp, store, slots=slots)
        self.a, self.b = a, b
        self._d = [None] * slots

    def forward(self, slot, x, y=None, noise=None):
        """The stage's output for x in the slot; on the last stage the loss (its gradient kept for backward)."""
        run = self.run
        run.set_noise(noise, slot)
        out = run.forward(x, True, slot)
        if run.loss is None:
            return out
        loss, self._d[slot] = run.loss_forward_backward(out, y, slot)
        return loss

    def backward(self, slot, dy=None):
        """Writes the slot's micro-batch's gradient into the stage's gradient buffer;
        returns the gradient with respect to the stage's input (None on the first stage)."""
        d, self._d[slot] = (self._d[slot] if dy is None else dy), None
        # a tied tensor's uses are summed over the micro-batches apart, then combined (comm/step_gradient.py)
        return self.run.backward(d, slot=slot, combine=False)


class Stage:
    """Stage `s` of `cuts`: its parameter slice [lo, hi), its state slice,
    and one StageModel over them with `copies` slots for the micro-batches
    in flight."""

    def __init__(self, spec, cuts, s, micro_batches, xp, dtype, copies=None):
        self.a, self.b = cuts[s], cuts[s + 1]
        (self.lo, self.hi), (self.state_lo, self.state_hi) = ranges(spec, self.a, self.b), \
            ranges(spec, self.a, self.b, of="state")
        n = self.hi - self.lo
        # The parameters and the step's gradient sum, each the stage's slice of
        # ring mode's buffers: the replicas average (or reduce-scatter, then
        # allgather) ring mode's buckets of them (comm/data_parallel.py), so their sums
        # run in its order.
        self.params = xp.zeros(n, dtype)
        self.state = xp.zeros(self.state_hi - self.state_lo, dtype)
        self.grad = xp.zeros(n, dtype)   # one micro-batch's, written by every slot's backward
        self.grads = xp.zeros(n, dtype)   # the step's sum (the engine's StepGradient adds into it)
        self.micro = micro_batches
        self.slots = copies or micro_batches
        store = PlainStore(spec, self.params, self.grad, self.state, (self.lo, self.state_lo))
        self.model = StageModel(spec, self.a, self.b, xp, store, self.slots)
        self._free, self._holding = list(range(self.slots)), {}

    def init(self, seed):
        """The stage's layers' initial parameters and state, drawn by the stage
        alone (nn/sequential.LayerRange.init: the whole model's bits for them)."""
        self.model.run.init(seed)

    def forward(self, m, x, y=None, noise=None):
        """Micro-batch m's forward in a free slot, which holds it until backward(m)."""
        slot = self._free.pop(0)   # never empty: there are as many slots as the schedule holds at once
        self._holding[m] = slot
        return self.model.forward(slot, x, y, noise)

    def backward(self, m, dy=None):
        """Micro-batch m's backward: its gradient in `grad` (its tied uses' in
        the runner's extra), the slot freed. Returns the gradient with respect
        to the stage's input (None on the first stage)."""
        slot = self._holding.pop(m)
        dx = self.model.backward(slot, dy)
        self._free.append(slot)
        return dx
