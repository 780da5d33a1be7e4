"""A layer list over one flat parameter buffer and one flat gradient buffer:
the model the loops train. Made by `ModelSpec.build` (nn/spec.py), which
knows the layout; this runs it: `LayerRange`, the one runner of a range of
layers (the whole model, or a pipeline stage), and `Sequential`, the model
over all of them: `init`, `forward_backward` (with the hooks fusion and the
timeline use), `evaluate`.

The loss is the spec's (nn/losses.py: cross-entropy over classes, or over
tokens for a language model), scoring the last layer's outputs (the logits)
against the batch's targets.

    python -m hpctrain.nn               # what a built model holds
"""
import contextlib
import copy

import numpy as np

from .chain import Chain
from .layers import Context, Noise
from . import threads
from .losses import EvalSums, eval_batches
from .tied import RangeTies


# How initial parameters are drawn: 1, one generator of --seed for every
# layer in list order (up to issue 29); 2, a generator of (seed, layer index)
# for each layer. Recorded in checkpoints and --save (a resume does not draw).
INIT_VERSION = 2

# Tokens a batch of evaluate() takes at most (8192: 128 windows of 64, nanoGPT's CPU context).
EVAL_TOKENS = 8192


class LayerRange:
    """The one runner of layers: layers [a, b) of a spec, each bound once to
    the views its parameter store hands out (nn/store.py: the plain store's
    are views of the whole model's flat buffers, or of a pipeline stage's
    slices), run forward (nn/chain.py: with the in-place rule's copies) and
    backward in the order training needs, with the spec's loss when b is the
    last layer. The store hears of every call (nn/store.py's hooks): before
    a forward (training, evaluation, recompute) and after it, before a
    backward, and as each layer's gradient becomes final; the layers read
    parameters only between a before-hook and the hook that ends that call.
    The whole model is the range [0, n) (Sequential below); a pipeline stage
    one range of it (pipeline/stage.py), so a stage computes what the model
    computes for those layers, call for call.

    One set of layers, `slots` contexts (nn/layers.py Context): a slot holds
    one call's activations from its forward to its backward, so a pipeline
    stage keeps a slot per micro-batch in flight, not a copy of its layers.

    --recompute (spec.recompute): each layer that declares itself a
    recompute unit (`recompute_unit`: the transformer's Block; the grain is
    one such layer) runs forward in a context the range's units share (one
    per kind of unit, not per slot), its output copied into a buffer of the
    slot (the next layer's input) and its input kept; its backward first
    runs that forward again from the kept input, into the shared context,
    to the same bits (its noise is the slot's, set as without). So a slot
    holds the units' inputs and the other layers' activations, and the
    range one unit's activations: what memory_bytes counts (nn/spec.py)."""

    def __init__(self, spec, a, b, xp, store, slots=1):
        self.spec, self.a, self.b, self.xp, self.store = spec, a, b, xp, store
        self.base = store.base
        # a store that gathers parameters a bucket at a time hears of each layer (nn/sharded_store.py)
        self.per_layer = getattr(store, "per_layer", False)
        self.layers = copy.deepcopy(spec.layers[a:b])   # every build its own: two models of a spec share nothing
        # tied tensors (nn/tied.py): a copy of those owned before the range, the
        # later writers' parts; empty without ties. A reader's tied views are
        # rebound onto the owner's range of the share (or the copy): a store
        # that moves parameters (tests/test_store.py) sees ties as the plain one.
        params, grads = store.params, store.grads
        self.ties = RangeTies(spec, a, b)
        # the tied tensors each layer is the last writer of (nn/tied.py): only those layers combine
        self._last_writes = {i: groups for i in range(a, b) if (groups := self.ties.done_by(i))}
        self.copies = xp.zeros(self.ties.copy_size, params.dtype)
        self.extra = xp.zeros(self.ties.extra_size, params.dtype)
        for i, layer in zip(range(a, b), self.layers):
            pv, gv, sv = store.views(i)
            self.ties.bind_views(i, params, grads, pv, gv, self.copies, self.extra, self.base[0])
            layer.bind(xp, pv, gv, sv)
        self.state, self.grads = store.state, grads
        # the range's input is its own (the batch, or a received buffer): an in-place first layer may write it
        self.chain = Chain(self.layers, xp)
        self.slots = [self.chain.context() for _ in range(slots)]
        self._noiseless = [True] * slots   # every layer's context of the slot holds noise None (set_noise)
        # --recompute: the units (positions in the range), their shared contexts, each slot's units' inputs
        self.units = {k for k, layer in enumerate(self.layers) if spec.recompute and layer.recompute_unit}
        self.shared = {}   # kind -> context (_kind)
        self._shared_of = {k: self.shared.setdefault(self._kind(k), self.layers[k].context())
                           for k in sorted(self.units)}
        self._unit_inputs = [{} for _ in range(slots)]
        # forwards of units run again before their backward: the final record's
        # recomputed_forwards, so a run shows --recompute happened (loops/)
        self.recomputed = 0
        self._scratch = Context(xp)   # a unit's output gradient and the state a recompute puts back
        self.in_shape = spec.input_shape if a == 0 else spec.shapes[a - 1]
        # the model's loss where the range ends the model, and a context per slot
        # for it (its gradient buffer is a call's, kept until that slot's backward)
        self.loss = spec.loss if b == len(spec.layers) else None
        self.loss_slots = [Context(xp) for _ in range(slots)] if self.loss is not None else None
        # (layer, index of its range in layer_ranges) for layers with parameters
        self.owner = {i: k for k, i in enumerate(spec.param_layers)}
        # backprop stops at the model's first layer with parameters: nothing before it needs a gradient
        self.first = spec.param_layers[0] if spec.param_layers else len(spec.layers)

    def init(self, seed):
        """Layers [a, b)'s initial parameters and their state's starting
        values into the store's share (its params and state), each layer
        from a stream of its own, (seed, its index in the model):
        a pure function of them, whatever else the model holds, so a pipeline
        stage initialises its layers alone to the bits the whole model gets
        (INIT_VERSION 2; before, one stream drew every layer in list order).
        Host RNG, then copied: CPU and GPU runs start from the same bits."""
        params, state, (base, state_base) = self.store.params, self.store.state, self.store.base
        for i, layer in zip(range(self.a, self.b), self.layers):
            layer.init_state(self.spec.views(state, i, of="state", base=state_base))
        # the draw a piece of the share at a time: the whole share here, a bucket
        # at a time with a store that keeps no whole copy (nn/sharded_store.py)
        pieces = self.store.init_pieces(params.dtype) if hasattr(self.store, "init_pieces") else \
            [self._whole_piece(params, base)]
        first = True
        for lo, hi, host, put in pieces:
            host[...] = 0
            for i, layer in zip(range(self.a, self.b), self.layers):
                entries = self.spec.layer_tensors[i]
                at = entries[0][2] if entries and entries[-1][3] > entries[0][2] else None
                if not (lo <= at < hi if at is not None else first):
                    continue
                views = self.ties.init_views(i, self.spec.views(host, i, base=lo), host.dtype)
                if i in self.spec.split_layers:   # --tensor-parallel: the whole layer's draw, cut
                    self.spec.init_split(i, np.random.default_rng([seed, i]), views, host.dtype)
                else:
                    layer.init(np.random.default_rng([seed, i]), views, host.dtype)
            put(host)
            first = False
        self.ties.init_copies(self.spec, seed, self.copies, self.xp)

    def _whole_piece(self, params, base):
        """The share as one piece: drawn in place on the host, else on the host and copied."""
        if self.xp is np:
            return base, base + params.size, params, lambda host: None

        def put(host):
            params[...] = self.xp.asarray(host)
        return base, base + params.size, np.zeros(params.size, params.dtype), put

    def set_noise(self, noise, slot=0):
        """`noise=(seed, step, sample_ids)`, or None, for the slot's next
        training forward: each layer's Noise, stream = its index in the model."""
        if noise is None and self._noiseless[slot]:   # a model without dropout: nothing to set, every step
            return
        self._noiseless[slot] = noise is None
        ctx = self.slots[slot]
        for i, layer, inner in zip(range(self.a, self.b), self.layers, ctx.inner):
            layer.set_noise(inner, None if noise is None else Noise(*noise[:3], stream=i))

    def forward(self, x, train, slot=0):
        """The range's output for x (the last range: the logits), a training
        forward's activations held in the slot until its backward (an
        evaluation's in none: _evaluation_forward)."""
        x = x.reshape(x.shape[0], *self.in_shape)
        if not self.per_layer:
            self.store.before_forward(self.a, self.b)
        y = self._forward(slot, x) if train else self._evaluation_forward(x)
        self.store.after_forward(self.a, self.b)
        return y

    def _layer_hook(self, k):
        """A per-layer store's before_forward, for layer k of the range."""
        self.store.before_forward(self.a + k, self.a + k + 1)

    def _forward(self, slot, x):
        """The range's layers forward over x into the slot, in training mode
        (the units into their shared contexts)."""
        ctx = self.slots[slot]
        before = self._layer_hook if self.per_layer else None
        if not self.units:
            return self.chain.forward(ctx, x, True, before)
        for k, layer in enumerate(self.layers):
            if before is not None:
                before(k)
            if self.chain.copies[k]:
                x = self.chain.copy_input(ctx, k, x)
            x = self._unit_forward(slot, k, x) if k in self.units else layer.forward(ctx.inner[k], x, True)
        return x

    def _evaluation_forward(self, x):
        """The range's layers forward over x in evaluation mode, each layer
        in a context of its own, let go once the layer has run: an
        evaluation keeps no activations for a backward, so it holds one
        layer's buffers (a transformer Block's) at a time beside what the
        training slots keep, not every layer's (a slot's evaluation buffers
        were as large again as a step's activations, issue 60). The calls
        are a training slot's in evaluation mode (a recompute unit's too:
        its output is what its shared context gives), so the same bits;
        the buffers are made again each call (a few ms a batch)."""
        before = self._layer_hook if self.per_layer else None
        for k, layer in enumerate(self.layers):
            if before is not None:
                before(k)
            if self.chain.copies[k]:
                x = x.copy()
            x = layer.forward(layer.context(), x, False)
        return x

    def _kind(self, k):
        """Units of one kind share a context: the same class, input shape and description."""
        layer = self.layers[k]
        return type(layer), layer.in_shape, layer.describe()

    def _unit_forward(self, slot, k, x):
        """Unit k's training forward in its kind's shared context; its output
        copied into the slot, its input kept for the recompute (the range's
        own input copied: its sender may reuse the buffer)."""
        ctx, layer, shared = self.slots[slot], self.layers[k], self._shared_of[k]
        if k == 0:
            x = self._copied(ctx, "unit input", x)
        self._unit_inputs[slot][k] = x
        layer.set_noise(shared, ctx.inner[k].noise)
        return self._copied(ctx, ("unit output", k), layer.forward(shared, x, True))

    def _copied(self, ctx, key, x):
        buf = ctx.buffer(key, x.shape, x.dtype)
        self.xp.copyto(buf, x)
        return buf

    def _unit_backward(self, slot, k, d, need_dx):
        """Unit k's forward run again from its kept input (the non-trainable
        state put back after it), then its backward from d (first copied: d
        may be the shared context's own input gradient buffer)."""
        layer, shared = self.layers[k], self._shared_of[k]
        dy = self._copied(self._scratch, ("dy", d.shape), d)
        layer.set_noise(shared, self.slots[slot].inner[k].noise)
        with self._state_kept(self.a + k):
            layer.forward(shared, self._unit_inputs[slot].pop(k), True)
        self.recomputed += 1
        return layer.backward(shared, dy, need_dx)

    @contextlib.contextmanager
    def _state_kept(self, i):
        """Layer i's non-trainable state as it was before the block (batch
        norm's running statistics move once per forward, not per recompute)."""
        if not self.spec.layer_state[i]:
            yield
            return
        saved = self._copied(self._scratch, "state", self.state)
        yield
        self.xp.copyto(self.state, saved)

    def loss_forward_backward(self, logits, targets, slot=0):
        """(mean loss, its gradient with respect to the logits) of a training
        batch, the gradient in the slot's buffer until its backward."""
        return self.loss.forward_backward(self.loss_slots[slot], logits, targets)

    def sums(self, logits, targets):
        """The loss's evaluation sums of one batch (nn/losses.py)."""
        return self.loss.sums(self.loss_slots[0], logits, targets)

    def backward(self, d, on_layer_done=None, slot=0, combine=True):
        """Backprop d (the gradient of the range's output) through the range,
        last layer first, from the slot's activations, writing each layer's
        parameter gradients. A tied tensor's later writers write parts of
        their own (self.extra), added into its gradient once its last writer
        is done (combine=False: left apart, for a caller that sums
        micro-batches first and then calls `combine`). As soon as layer i's
        gradient is final, tells the store (grads_done(i, i + 1)), then calls
        on_layer_done(k), k its index in layer_ranges. Returns the gradient of
        the range's input, or None where no layer before it has parameters
        (the model's first range)."""
        inner, store = self.slots[slot].inner, self.store
        if not self.per_layer:
            store.before_backward(self.a, self.b)
        for i in range(self.b - 1, max(self.a, self.first) - 1, -1):
            k = i - self.a
            if self.per_layer:
                store.before_backward(i, i + 1)
            d = self._unit_backward(slot, k, d, i > self.first) if k in self.units else \
                self.layers[k].backward(inner[k], d, need_dx=i > self.first)
            if combine:
                self.combine(i, self.grads, self.extra)
            if i in self.owner:
                store.grads_done(i, i + 1)
                if on_layer_done is not None:
                    on_layer_done(self.owner[i])
        return d if self.a > self.first else None

    def combine(self, i, grads, extra):
        """The tied tensors whose last writer is layer i: each one's gradient
        in `grads` (the range's layout) += its parts in `extra`, in backprop
        order (nn/tied.py)."""
        for group in self._last_writes.get(i, ()):
            self.ties.combine(group, grads, extra, self.base[0])


class Sequential:
    """The built model: the range of all its layers over a parameter store
    (nn/store.py; `ModelSpec.build` makes the plain one over the model's flat
    buffers). Members the loops rely on: params, grads (the store's flat
    buffers: the rank's share), state (non-trainable, may be empty),
    num_params, layer_ranges ((lo, hi) of each layer with parameters, in
    buffer order; backprop finishes them last first), tensors(),
    tensor_ranges(), init(seed), forward_backward(...), evaluate(...)."""

    def __init__(self, spec, xp, store, dtype):
        self.spec, self.xp, self.dtype = spec, xp, np.dtype(dtype)
        self.params, self.grads, self.state = store.params, store.grads, store.state
        self.num_params = spec.num_params
        self.layer_ranges = spec.layer_ranges
        self.run = LayerRange(spec, 0, len(spec.layers), xp, store)
        self.ctx = self.run.slots[0]   # the one slot: each layer's context in .inner, in list order
        self.layers, self.loss, self.chain = self.run.layers, self.run.loss, self.run.chain
        self.extra = self.run.extra   # tied tensors' later uses' gradients (nn/tied.py); empty without ties

    def init(self, seed):
        """Every layer's initial parameters from (seed, its index) (LayerRange.init)."""
        self.run.init(seed)

    def tensors(self):
        """(name, view) of each parameter tensor, in buffer order."""
        return [(name, self.params[lo:hi].reshape(shape)) for name, shape, lo, hi in self.spec.tensors]

    def tensor_ranges(self):
        """(name, lo, hi) of each parameter tensor in the flat buffer."""
        return [(name, lo, hi) for name, _, lo, hi in self.spec.tensors]

    def state_tensors(self):
        """(name, view) of each non-trainable tensor (batch-norm statistics)."""
        return [(name, self.state[lo:hi].reshape(shape)) for name, shape, lo, hi in self.spec.state]

    def forward_backward(self, x, y, on_layer_done=None, loss_out=None, on_forward_done=None, noise=None,
                         combine=True):
        """The model's mean loss over the batch, x scored against the targets
        y (an xp scalar); writes the gradient of that mean into self.grads. `on_layer_done(k)` is called as soon as
        layer_ranges[k]'s gradient is final (last first); `loss_out` (a 1-element
        array) receives the loss before backprop starts; `on_forward_done()` is
        called then too (for timelines). `noise=(seed, step, sample_ids)`, one id
        per row of x (its position in the epoch), is what layers drawing
        randomness (Dropout) need: their draws depend on it alone, never on how
        the rows are split over ranks. combine=False: a tied tensor's later
        uses' gradients are left apart in self.extra (LayerRange.backward)."""
        run = self.run
        run.set_noise(noise)
        loss, d = run.loss_forward_backward(run.forward(x, True), y)
        if loss_out is not None:
            loss_out[...] = loss
        if on_forward_done is not None:
            on_forward_done()
        run.backward(d, on_layer_done, combine=combine)
        return loss

    def combine(self):
        """Every tied tensor's gradient += its later uses' parts (self.extra),
        after a step's micro-batches were summed apart (combine=False)."""
        for i in range(len(self.layers) - 1, -1, -1):
            self.run.combine(i, self.grads, self.extra)

    def evaluate(self, x, y, batch=128, forward=None):
        """The loss's sums over x, y (nn/losses.py: {"loss": sum, "count",
        "correct"}, Python numbers), added group by group in order. x may be
        uint8 pixels (scaled by 1/255 a batch at a time) or floats. A group
        is `batch` samples, token windows EVAL_TOKENS tokens at most: what
        one sum adds (its bits). Each runs forward `forward` samples at a
        time (eval_forward: the training step's batch, so evaluation holds
        no more activations than a step; None: the group whole)."""
        if self.spec.input_kind == "tokens" and x.ndim == 2:
            batch = max(1, min(batch, EVAL_TOKENS // x.shape[1]))
        forward = min(forward or batch, batch)
        sums = EvalSums(self.loss, self.run.loss_slots[0])
        for lo, hi, ends in eval_batches(x.shape[0], batch, forward):
            xb, yb = x[lo:hi], y[lo:hi]
            if xb.dtype == np.uint8:
                xb = xb.astype(self.dtype)
                xb /= 255
            sums.add(self.run.forward(xb, False), yb)
            if ends:
                sums.end_group()
        return sums.total


def eval_forward(spec, batch_size):
    """Samples an evaluation runs forward at once: the training step's
    `batch_size` (a rank's, a micro-batch's), so its activations are no more
    than a step's, rounded down to whole ROW_TILEs of the products' rows
    (nn/threads.row_unit: a token window's T rows, an image's one), so each
    row's bits are those of the whole group's product (OpenBLAS sums a
    row in other bits in another tile shape); at least one such unit."""
    rows = spec.input_shape[0] if spec.input_kind == "tokens" else 1
    unit = threads.row_unit(rows)
    return max(unit, batch_size // unit * unit)
