"""Where a range of layers' parameters and gradients live: the store behind
the layer runner (nn/sequential.LayerRange).

The runner binds each layer once, to the views the store hands out
(`views(i)`), and around every call tells the store what is about to run and
what has finished:

- `before_forward(a, b)`: layers [a, b) (model indices) are about to run
  forward (training, evaluation, or a recompute before backward): when it
  returns, their parameter views hold their parameters. (--recompute's
  per-block forward runs inside the range's backward, under
  `before_backward`, before the block's gradient is done.)
- `after_forward(a, b)`: that forward is over; until the next
  `before_backward` or `before_forward` of the range the store may put its
  parameters elsewhere (what a sharded store releases between a
  micro-batch's forward and its backward).
- `before_backward(a, b)`: like before_forward, before the layers run
  backward (which reads parameters again: a Dense's input gradient is
  dy W^T).
- `grads_done(a, b)`: layers [a, b)'s gradients, in their gradient views,
  are final for this backward. The runner calls it for one layer at a time,
  [i, i + 1), as backprop finishes each layer with parameters (last first),
  just before its own `on_layer_done(k)` (fusion starts a bucket's allreduce
  from that, report/timeline marks it): what those read is what the store
  left.

Outside those hooks the runner reads no parameters (tests/test_store.py
proves it with a store that keeps them elsewhere, fills the views in the
two before-hooks and NaN-fills them after a forward and after each layer's
gradient): so a store may keep a layer's parameters anywhere between calls,
the seam through which --zero 3's sharded parameters are gathered before use
and released after. (A tensor-parallel layer's slice is not the store's: the
spec lays out each rank's slice, nn/tensor_split.py.)

A store that says `per_layer = True` (--zero 3's nn/sharded_store.py) hears
the two before-hooks a layer at a time, [i, i + 1), right before layer i
runs forward or backward, so it can hold one bucket of parameters at a
time; `init_pieces(dtype)`, where a store has it, hands the initial draw
out a piece of the share at a time (nn/sequential.LayerRange.init).

The views are bound once (layers keep what they derive from them at bind
time, Conv2d its W as a matrix, and a step allocates nothing): a store that
keeps its parameters elsewhere hands out views of a working buffer of its
own and fills that buffer in the hooks, rather than rebinding. Non-trainable
state (batch-norm statistics), read and written by forward, stays in the
share's state buffer: its views never move.

`params`, `grads`, `state`: the rank's share, one flat buffer each (the
house rule): what the optimizer updates, the wire carries, checkpoints
write and `init` draws into. `base`: the model's offsets (params, state)
where the share starts (a pipeline stage's slice).

    python -m pytest -q tests/test_store.py
"""


class PlainStore:
    """Today's store: the parameters and gradients live in the share's flat
    buffers themselves (the whole model's, or a pipeline stage's slices from
    the model's offsets `base`); each layer's views are views of them, bound
    once, and the hooks have nothing to do."""

    def __init__(self, spec, params, grads, state, base=(0, 0)):
        self.spec, self.params, self.grads, self.state, self.base = spec, params, grads, state, tuple(base)

    def views(self, i):
        """Layer i's (params, grads, state) views, name -> array: what the
        runner binds it to."""
        spec, (base, state_base) = self.spec, self.base
        return (spec.views(self.params, i, base=base), spec.views(self.grads, i, base=base),
                spec.views(self.state, i, of="state", base=state_base))

    def before_forward(self, a, b):
        """Layers [a, b) run forward next: their parameter views must hold them."""

    def after_forward(self, a, b):
        """Layers [a, b) ran forward: their parameters are not read until the next before-hook."""

    def before_backward(self, a, b):
        """Layers [a, b) run backward next: their parameter views must hold them."""

    def grads_done(self, a, b):
        """Layers [a, b)'s gradients are final in their gradient views."""
