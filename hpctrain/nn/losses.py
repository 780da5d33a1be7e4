"""The loss: what a model's output is scored against, a part of the model
(ModelSpec's `loss`), not of the runner.

The contract (`Loss` below; a user's model file may return its own beside
its layers, nn/user.py):

- `check(out_shape, classes)`: called once when the spec is made, with the
  last layer's output shape per sample (no batch axis); raise `LayerError`
  with one line when the loss cannot score it.
- `forward_backward(ctx, logits, targets) -> (loss, dlogits)`: the mean loss
  of a training batch (an xp scalar) and its gradient with respect to the
  logits, written into a buffer the slot's `ctx` (nn/layers.Context, one per
  slot of the runner) keeps between calls: a step allocates nothing once
  warm. dlogits is what the last layer's backward starts from, and stays
  untouched until that backward has run.
- `sums(ctx, logits, targets) -> dict`: what evaluation adds up over batches, as
  Python numbers: "loss" (the sum of the per-item losses), "count" (the items
  scored: the mean loss is loss / count) and "correct" (items predicted
  right) where accuracy means something; a loss without it leaves "correct"
  out; `zero_sums()` the same keys at 0, the sums of no batch.
- `items(ctx, logits, targets) -> dict` (optional; the built-in losses have
  it): the same keys, each a 1-D array of one value per item whose sum is
  `sums`' number (`Loss.sums` is that sum). Evaluation runs forward in
  batches no larger than a training step's and sums the items of a fixed
  group of samples at once (`EvalSums`), so its bits do not depend on the
  forward's batch; a loss with its own `sums` is called per forward batch.
- `describe()`: one short line (the model summary, rank agreement).

Shapes: nothing here assumes one target per sample. `ClassCrossEntropy`
scores logits (N, C) against integer targets (N,). A per-token loss over a
sequence (the transformer issue's) scores logits (N, T, V) against integer
targets (N, T), skipping the targets equal to an ignored index: its
forward_backward averages over the counted tokens, writes zeros into
dlogits at the ignored ones, and its sums' "count" is the tokens counted,
not N. The readers hand the targets to the loss as they are; only the loss
reads them.

    python -m hpctrain.nn               # the model's summary names its loss
"""
from .layers import LayerError
from .tensor_parallel import nearly_even


class Loss:
    """The base of every loss."""

    def check(self, out_shape, classes):
        """Raise LayerError when the last layer's output (per sample) cannot be scored."""

    def forward_backward(self, ctx, logits, targets):
        raise NotImplementedError

    def items(self, ctx, logits, targets):
        raise NotImplementedError

    def sums(self, ctx, logits, targets):
        return item_sums(self.items(ctx, logits, targets))

    def zero_sums(self):
        return {"loss": 0.0, "count": 0}

    def describe(self):
        return type(self).__name__


class ClassCrossEntropy(Loss):
    """Mean cross-entropy of softmax(logits) against one integer class per
    sample: logits (N, C), targets (N,). Its gradient (softmax - onehot) / N."""

    def check(self, out_shape, classes):
        if tuple(out_shape) != (classes,):
            # a Dense (Linear) acts on its input's last axis: on an image it gives one row of scores per pixel row
            hint = ": put Flatten() before the dense layers" if len(out_shape) > 1 else ""
            raise LayerError(f"the last layer gives {'x'.join(map(str, out_shape))} outputs per sample, "
                             f"the data has {classes} classes{hint}")

    def forward_backward(self, ctx, logits, targets):
        xp = ctx.xp
        d = ctx.buffer("dlogits", logits.shape, logits.dtype)
        rows = self._rows(ctx, logits.shape[0])
        # softmax, stabilised
        xp.subtract(logits, logits.max(axis=1, keepdims=True), out=d)
        xp.exp(d, out=d)
        d /= d.sum(axis=1, keepdims=True)
        loss = -xp.log(xp.maximum(d[rows, targets], 1e-30)).mean()
        # the softmax in d becomes the gradient of the mean loss, in place
        d[rows, targets] -= 1.0
        d *= 1.0 / d.shape[0]
        return loss, d

    @staticmethod
    def _rows(ctx, n):
        """0..n-1 on the model's device, kept on the slot's context."""
        rows = getattr(ctx, "rows", None)
        if rows is None or rows.shape[0] != n:
            rows = ctx.rows = ctx.xp.arange(n)
        return rows

    def items(self, ctx, logits, targets):
        xp = ctx.xp
        shifted = logits - logits.max(axis=1, keepdims=True)
        logp = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        n = logits.shape[0]
        # -sum(a) and sum(-a) are the same bits: rounding is symmetric in sign
        return {"loss": -logp[xp.arange(n), targets], "count": xp.ones(n, xp.int64),
                "correct": logits.argmax(axis=1) == targets}

    def zero_sums(self):
        return {"loss": 0.0, "count": 0, "correct": 0}

    def describe(self):
        return "softmax cross-entropy over classes"


class TokenCrossEntropy(Loss):
    """Mean cross-entropy of softmax(logits) over a vocabulary at every
    position: logits (N, T, V), integer targets (N, T) (a language model's
    next tokens). A target equal to `ignore_index` (default -1: padding) is
    not scored: the loss is the mean over the counted tokens (0 where none
    is), and dlogits is (softmax - onehot) / counted there, zero at the
    ignored ones. sums: "loss" the sum of the counted tokens' losses (nats),
    "count" the tokens counted, "correct" those whose most likely token is
    the target (next-token top-1 accuracy: a measure people report for
    language models, so evaluation's accuracy stays meaningful).

    The mean is this batch's: ranks that split a batch each average their
    own tokens, which is the global mean when each counts as many tokens
    (no ignored targets, or as many on each)."""

    group = None   # --tensor-parallel: the TensorGroup the vocabulary is cut over (join; nn/tensor_parallel.py)

    def __init__(self, ignore_index=-1):
        self.ignore_index = int(ignore_index)

    def join(self, group):
        """--tensor-parallel: score the slice of the logits a vocabulary-parallel
        head gives (the spec calls it, before check: nn/tensor_split.py)."""
        self.group = group

    def check(self, out_shape, classes):
        self.rows = (0, classes)   # the logits' columns this rank holds: the vocabulary, or its part
        if self.group is not None:
            bounds = nearly_even(classes, self.group.size)
            self.rows = bounds[self.group.rank:self.group.rank + 2]
        if len(out_shape) != 2 or out_shape[1] != self.rows[1] - self.rows[0]:
            raise LayerError(f"the last layer gives {'x'.join(map(str, out_shape))} outputs per sample, a "
                             f"per-token loss needs (positions, {classes}): one score per token of the vocabulary")

    def _scored(self, ctx, logits, targets):
        """(logits as (N T, V) rows, targets as N T ids with the ignored
        ones at 0, which rows count (as 0/1 of the logits' dtype))."""
        xp = ctx.xp
        rows = logits.reshape(-1, logits.shape[-1])
        ids = targets.reshape(-1).astype(xp.int64)
        counted = ids != self.ignore_index
        return rows, xp.where(counted, ids, 0), counted.astype(logits.dtype)

    def forward_backward(self, ctx, logits, targets):
        if self.group is not None:
            return self._split_forward_backward(ctx, logits, targets)
        xp = ctx.xp
        rows, ids, counted = self._scored(ctx, logits, targets)
        index = ClassCrossEntropy._rows(ctx, rows.shape[0])
        d = ctx.buffer("dlogits", rows.shape, rows.dtype)
        # the loss as log(sum exp(shifted)) - shifted[target]: no log of a
        # rounded probability, and the softmax in d from the same exp
        xp.subtract(rows, rows.max(axis=1, keepdims=True), out=d)
        picked = d[index, ids]
        xp.exp(d, out=d)
        total = d.sum(axis=1)
        d /= total[:, None]
        count = xp.maximum(counted.sum(), 1)
        loss = ((xp.log(total) - picked) * counted).sum() / count
        d[index, ids] -= 1.0
        d *= (counted / count)[:, None]
        return loss, d.reshape(logits.shape)

    def _split(self, ctx, logits, targets):
        """A vocabulary cut over the tensor group: (rows, the targets' columns
        here (0 where another rank holds them), 1 where this rank holds the
        target (the logits' dtype), counted, the rows' max over the whole
        vocabulary)."""
        xp, (lo, hi) = ctx.xp, self.rows
        rows, ids, counted = self._scored(ctx, logits, targets)
        inside = (ids >= lo) & (ids < hi)
        local = xp.where(inside, ids - lo, 0)
        top = self.group.max(rows.max(axis=1))
        return rows, local, inside.astype(rows.dtype), counted, top

    def _split_forward_backward(self, ctx, logits, targets):
        """forward_backward on this rank's columns of the logits: the max, the
        sum of exp and the target's logit over the group (one allreduce for
        the max, one for both sums), never the whole logits."""
        xp = ctx.xp
        rows, local, inside, counted, top = self._split(ctx, logits, targets)
        index = ClassCrossEntropy._rows(ctx, rows.shape[0])
        d = ctx.buffer("dlogits", rows.shape, rows.dtype)
        xp.subtract(rows, top[:, None], out=d)
        sums = ctx.buffer("sums", (2, rows.shape[0]), rows.dtype)
        xp.multiply(d[index, local], inside, out=sums[1])   # the target's shifted logit, where it is here
        xp.exp(d, out=d)
        d.sum(axis=1, out=sums[0])
        total, picked = self.group.sum(sums)
        d /= total[:, None]
        count = xp.maximum(counted.sum(), 1)
        loss = ((xp.log(total) - picked) * counted).sum() / count
        d[index, local] -= inside
        d *= (counted / count)[:, None]
        return loss, d.reshape(logits.shape)

    def items(self, ctx, logits, targets):
        xp = ctx.xp
        if self.group is not None:
            rows, local, inside, counted, top = self._split(ctx, logits, targets)
            index = xp.arange(rows.shape[0])
            shifted = rows - top[:, None]
            both = xp.stack([xp.exp(shifted).sum(axis=1), shifted[index, local] * inside])
            total, picked = self.group.sum(both)
            # the first column holding the row's max over the group (np.argmax's choice), in the whole vocabulary
            best = rows.argmax(axis=1)
            first = xp.where(rows[index, best] == top, best + self.rows[0], self.rows[1] + 2 ** 40).astype(xp.int64)
            first = self.group.min(first)
            ids = local + self.rows[0]
            right = ((first == ids) & (inside > 0)) * counted
            right = self.group.sum(right.astype(xp.int64))
            losses = xp.log(total) - picked
            return {"loss": losses * counted, "count": counted, "correct": right}
        rows, ids, counted = self._scored(ctx, logits, targets)
        shifted = rows - rows.max(axis=1, keepdims=True)
        index = xp.arange(rows.shape[0])
        losses = xp.log(xp.exp(shifted).sum(axis=1)) - shifted[index, ids]
        right = (rows.argmax(axis=1) == ids) * counted
        return {"loss": losses * counted, "count": counted, "correct": right}

    def zero_sums(self):
        return {"loss": 0.0, "count": 0, "correct": 0}

    def describe(self):
        ignored = "" if self.ignore_index == -1 else f", ignoring {self.ignore_index}"
        return f"softmax cross-entropy per token{ignored}"


def item_sums(items):
    """`Loss.sums` from `Loss.items`: each key's items summed at once, as Python numbers."""
    return {key: (float if key == "loss" else int)(values.sum()) for key, values in items.items()}


class EvalSums:
    """Evaluation's sums over batches run forward `add` by `add`: with a
    loss that has items (`Loss.items`), a group's items are kept until
    `end_group` and summed at once, the bits a `sums` of the whole group's
    logits gives, whatever forward batches it came in (a group is a few
    thousand floats; its logits were what evaluation held before, up to
    8,192 tokens' worth of vocabulary scores and the activations that made
    them). A loss with its own `sums` (a user's) is summed per forward batch."""

    def __init__(self, loss, ctx):
        self.loss, self.ctx = loss, ctx
        self.grouped = type(loss).sums is Loss.sums
        self.total, self.parts = loss.zero_sums(), []

    def add(self, logits, targets):
        if not self.grouped:
            add_sums(self.total, self.loss.sums(self.ctx, logits, targets))
            return
        self.parts.append(self.loss.items(self.ctx, logits, targets))

    def end_group(self):
        if not self.parts:
            return
        xp, parts = self.ctx.xp, self.parts
        whole = parts[0] if len(parts) == 1 else {k: xp.concatenate([p[k] for p in parts]) for k in parts[0]}
        add_sums(self.total, item_sums(whole))
        self.parts = []


def eval_batches(count, group, forward):
    """(lo, hi, ends_group) of evaluation's forward batches over `count`
    items: groups of `group` (whose sums are one reduction: EvalSums), each
    cut into forward batches of `forward` from its start."""
    for lo in range(0, count, group):
        hi = min(lo + group, count)
        for a in range(lo, hi, forward):
            b = min(a + forward, hi)
            yield a, b, b == hi


def add_sums(total, part):
    """total += part, key by key (evaluation's batches, in order)."""
    for key, value in part.items():
        total[key] += value
    return total
