"""The MLP (inputs-500-500-classes, ReLU, softmax cross-entropy), written
against an array module `xp` (NumPy or CuPy). Inputs and classes come from
the data's manifest (the session passes them); MNIST's 784 and 10 are the
defaults, so MNIST's model is 784-500-500-10.

Parameters live in ONE flat float32 buffer and gradients in another; each
layer's W and b are views into them. So one allreduce, one MPI message or one
HDF5 dataset covers every gradient, and the optimizer is one pass over memory.
Layers sit in the buffer in order (layer 0 first); backprop finishes the last
layer first, so the finished part of the gradient grows from the end of the
buffer towards its start, which is what bucket fusion relies on.

    python -m hpctrain.model        # the flat buffer's layout
"""
import numpy as np

# MNIST's shape: the defaults where no manifest is at hand (demos, benches).
INPUTS = 784
CLASSES = 10


def num_params(hidden, inputs=INPUTS, classes=CLASSES):
    sizes = [inputs, *hidden, classes]
    return sum(i * o + o for i, o in zip(sizes[:-1], sizes[1:]))


class MLP:
    def __init__(self, hidden=(500, 500), xp=np, params=None, grads=None, dtype=np.float32,
                 inputs=INPUTS, classes=CLASSES):
        self.xp = xp
        self.sizes = [int(inputs), *hidden, int(classes)]
        self.dtype = np.dtype(dtype)
        shapes, offset = [], 0
        self.layer_ranges = []  # (lo, hi) of layer i's W and b in the flat buffers
        for fan_in, fan_out in zip(self.sizes[:-1], self.sizes[1:]):
            lo = offset
            shapes.append(((fan_in, fan_out), offset))
            offset += fan_in * fan_out
            shapes.append(((fan_out,), offset))
            offset += fan_out
            self.layer_ranges.append((lo, offset))
        self.num_params = offset
        self.params = xp.zeros(offset, dtype) if params is None else params
        self.grads = xp.zeros(offset, dtype) if grads is None else grads
        for buf in (self.params, self.grads):
            assert buf.shape == (offset,) and buf.dtype == self.dtype and buf.flags.c_contiguous
        self.names, self.W, self.b, self.gW, self.gb = [], [], [], [], []
        for i, (shape, off) in enumerate(shapes):
            size = int(np.prod(shape))
            layer, kind = divmod(i, 2)
            self.names.append(f"layer{layer}/{'b' if kind else 'W'}")
            p = self.params[off: off + size].reshape(shape)
            g = self.grads[off: off + size].reshape(shape)
            (self.b if kind else self.W).append(p)
            (self.gb if kind else self.gW).append(g)
        self.num_layers = len(self.W)
        self._acts = {}

    # --- parameters ---------------------------------------------------------
    def init(self, seed):
        """He-normal weights, zero biases, from `seed` (host RNG, then copied,
        so CPU and GPU runs start from the same bits)."""
        rng = np.random.default_rng(seed)
        self.params[...] = 0
        for (lo, hi), fan_in, fan_out in zip(self.layer_ranges, self.sizes[:-1], self.sizes[1:]):
            # one layer at a time, in the buffer's dtype: no model-sized temporaries
            w = rng.standard_normal(fan_in * fan_out, dtype=np.float64 if self.dtype == np.float64 else np.float32)
            w *= np.sqrt(2.0 / fan_in)
            self.params[lo: lo + fan_in * fan_out] = self.xp.asarray(w.astype(self.dtype, copy=False))

    def tensors(self):
        """(name, view) for each parameter tensor, in buffer order."""
        views = [t for pair in zip(self.W, self.b) for t in pair]
        return list(zip(self.names, views))

    def tensor_ranges(self):
        """(name, lo, hi) of each tensor in the flat buffer."""
        out, off = [], 0
        for name, view in self.tensors():
            out.append((name, off, off + view.size))
            off += view.size
        return out

    # --- compute ------------------------------------------------------------
    def _buffers(self, batch, backward=True):
        """Activation (and, for training, gradient) buffers, kept for the next
        call: one set for training, one for evaluation, so neither evicts the other."""
        key = "train" if backward else "eval"
        acts = self._acts.get(key)
        if acts is None or acts["rows"].shape[0] != batch:
            xp = self.xp
            acts = {
                "h": [xp.empty((batch, n), self.dtype) for n in self.sizes[1:]],
                "d": [xp.empty((batch, n), self.dtype) for n in self.sizes[1:]] if backward else None,
                "rows": xp.arange(batch),
            }
            self._acts[key] = acts
        return acts

    def _forward(self, x, acts):
        xp = self.xp
        a = x
        for i in range(self.num_layers):
            h = acts["h"][i]
            xp.matmul(a, self.W[i], out=h)
            h += self.b[i]
            if i < self.num_layers - 1:
                xp.maximum(h, 0, out=h)
            a = h
        return a  # logits

    def forward_backward(self, x, y, on_layer_done=None, loss_out=None, on_forward_done=None):
        """Mean cross-entropy over the batch (an xp scalar); writes the gradient of
        that mean into self.grads. `on_layer_done(i)` is called as soon as layer
        i's gradient is final (last layer first); `loss_out` (a 1-element array)
        receives the loss before backprop starts; `on_forward_done()` is called
        then too (for timelines)."""
        xp = self.xp
        batch = x.shape[0]
        acts = self._buffers(batch)
        logits = self._forward(x, acts)
        # softmax cross-entropy, stabilised; d = softmax - onehot, over batch
        d = acts["d"][-1]
        xp.subtract(logits, logits.max(axis=1, keepdims=True), out=d)
        xp.exp(d, out=d)
        d /= d.sum(axis=1, keepdims=True)
        rows = acts["rows"]
        loss = -xp.log(xp.maximum(d[rows, y], 1e-30)).mean()
        if loss_out is not None:
            loss_out[...] = loss
        if on_forward_done is not None:
            on_forward_done()
        d[rows, y] -= 1.0
        d *= 1.0 / batch
        for i in range(self.num_layers - 1, -1, -1):
            a_in = x if i == 0 else acts["h"][i - 1]
            xp.matmul(a_in.T, d, out=self.gW[i])
            d.sum(axis=0, out=self.gb[i])
            if i > 0:
                d_prev = acts["d"][i - 1]
                xp.matmul(d, self.W[i].T, out=d_prev)
                # ReLU: pass the gradient where the unit was active
                xp.multiply(d_prev, acts["h"][i - 1] > 0, out=d_prev)
                d = d_prev
            if on_layer_done is not None:
                on_layer_done(i)
        return loss

    def evaluate(self, x, y, batch=128):
        """(sum of cross-entropy, number correct) over x, y, as Python numbers.
        x may be uint8 pixels (scaled by 1/255 a batch at a time) or floats."""
        xp = self.xp
        total_loss, correct = 0.0, 0
        for lo in range(0, x.shape[0], batch):
            xb, yb = x[lo: lo + batch], y[lo: lo + batch]
            if xb.dtype == np.uint8:
                xb = xb.astype(self.dtype)
                xb /= 255
            logits = self._forward(xb, self._buffers(xb.shape[0], backward=False))
            shifted = logits - logits.max(axis=1, keepdims=True)
            logp = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
            total_loss += float(-logp[xp.arange(xb.shape[0]), yb].sum())
            correct += int((logits.argmax(axis=1) == yb).sum())
        return total_loss, correct


if __name__ == "__main__":
    m = MLP()
    for name, lo, hi in m.tensor_ranges():
        print(f"{name:10s} [{lo:>7}, {hi:>7})  {hi - lo:>7} floats")
    print(f"{m.num_params} parameters, {m.num_params * 4:,} bytes in one flat buffer")
