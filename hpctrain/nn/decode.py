"""Incremental decoding of a GPT with a key/value cache: the logits of the
next token after each new one in one single-token step, not a forward
pass over the whole sequence (hpctrain/generate.py samples from them).

    decoder = Decoder(model)              # model: a built GPT (nn/gpt.py), NumPy or CuPy
    logits = decoder.feed(prompt_ids)     # (batch, t, vocab): each new position's logits
    logits = decoder.feed(next_ids)       # (batch, 1, vocab), attending to the cache

It reads the trained layers' parameters and runs their own forward (in
contexts of its own, train=False) where a layer acts on each position by
itself (its `tokenwise` declaration, nn/layers.py: Embedding, LayerNorm,
Linear, GELU, Dropout, and a user's subclass of one); the two layers that
see positions are decoded here: PositionEmbedding adds the rows of the new
positions, and each CausalSelfAttention keeps the keys and values of the
positions so far, (batch, heads, T, head width) each, and attends a new
query to them (the same arithmetic as its forward: scores scaled, the
causal mask added, the row maximum subtracted, exp, normalised). Training's
forward and backward are untouched. A layer of any other kind (a user's
model) is refused in one line.

The sliding window: once the sequence passes the context length T (the
model's block size), the logits are those of the last T tokens, what the
model was trained on. The cache is then recomputed for that window (one
pass over T tokens), not rolled: the position embeddings are learned and
absolute, so every cached key and value depends on its token's position,
and sliding the window by one moves every token to another position; a
rolled cache would give logits the model never computes. Past T each token
therefore costs a pass over the window (as nanoGPT's generate costs for
every token); up to T, one single-token step each.

    python -m pytest -q tests/test_generate.py -k cache
"""
import math

import numpy as np

from .attention import CausalSelfAttention
from .layers import Context, LayerError
from .transformer import Block, PositionEmbedding


class Decoder:
    """A built GPT's logits, a few new tokens at a time, for `batch`
    sequences decoded side by side."""

    def __init__(self, model, batch=1):
        self.model, self.xp = model, model.xp
        self.T = int(model.spec.input_shape[0])
        self.batch = int(batch)
        dtype = model.dtype
        self._mask = self.xp.where(self.xp.arange(self.T).reshape(1, -1) > self.xp.arange(self.T).reshape(-1, 1),
                                   -np.inf, 0).astype(dtype)
        self._steps = [self._step_of(layer, dtype) for layer in model.layers]
        self.tokens = np.empty((self.batch, 0), np.int64)   # the window the cache holds, on the host

    def _step_of(self, layer, dtype):
        """f(x, pos) -> the layer's output for the positions pos.. of x."""
        if layer.tokenwise:   # each position by itself: decoded by its own forward
            ctx = Context(self.xp)
            return lambda x, pos: layer.forward(ctx, x, False)
        if isinstance(layer, PositionEmbedding):
            return lambda x, pos: x + layer.params["P"][pos:pos + x.shape[1]]
        if isinstance(layer, Block):
            return self._block(layer, dtype)
        raise LayerError(f"generate: {layer.describe()} has no incremental decode; a GPT of nn/gpt.py's "
                         f"layers (Embedding, PositionEmbedding, Block, LayerNorm, Linear) decodes")

    def _block(self, block, dtype):
        """x + attn(ln1(x)), then h + mlp(ln2(h)): the attention decoded with
        its cache, the rest token by token."""
        ln1, attn, _ = block.attn_path
        ln1_step, attn_step = self._step_of(ln1, dtype), self._attention(attn, dtype)
        mlp = [self._step_of(layer, dtype) for layer in block.mlp_path]

        def step(x, pos):
            h = x + attn_step(ln1_step(x, pos), pos)
            y = h
            for f in mlp:
                y = f(y, pos)
            return h + y
        return step

    def _attention(self, attn, dtype):
        """CausalSelfAttention's forward for new positions pos..pos+t, their
        keys and values written into the cache, their queries attending to
        the cache up to themselves."""
        if not isinstance(attn, CausalSelfAttention):
            raise LayerError(f"generate: {attn.describe()} in a Block has no incremental decode")
        xp, shape = self.xp, (self.batch, attn.heads, self.T, attn.head_width)
        keys, values = xp.zeros(shape, dtype), xp.zeros(shape, dtype)
        scale = dtype.type(1 / math.sqrt(attn.head_width))

        def step(x, pos):
            n, t, e = x.shape
            end = pos + t
            qkv = xp.matmul(x.reshape(n * t, e), attn.params["Wqkv"])
            qkv += attn.params["bqkv"]
            q, k, v = (attn._heads(qkv, n, t, j) for j in range(3))
            keys[:, :, pos:end], values[:, :, pos:end] = k, v
            att = xp.matmul(q, keys[:, :, :end].transpose(0, 1, 3, 2))
            att *= scale
            att += self._mask[pos:end, :end]
            att -= att.max(axis=-1, keepdims=True)
            xp.exp(att, out=att)
            att /= att.sum(axis=-1, keepdims=True)
            merged = xp.matmul(att, values[:, :, :end]).transpose(0, 2, 1, 3).reshape(n * t, e)
            y = xp.matmul(merged, attn.params["Wo"])
            y += attn.params["bo"]
            return y.reshape(n, t, e)
        return step

    def feed(self, ids):
        """The logits (batch, t, vocab) of t new tokens ids (batch, t),
        appended to the sequence: each position's next-token logits given
        at most T tokens up to it. Within the context length the new tokens
        are one step over the cache; past it, the cache is recomputed for
        the last T tokens (the module's docstring says why) and the logits
        of the last min(t, T) positions come back."""
        ids = np.asarray(ids, np.int64).reshape(self.batch, -1)
        t, pos = ids.shape[1], self.tokens.shape[1]
        if pos + t > self.T:
            self.tokens = np.concatenate([self.tokens, ids], axis=1)[:, -self.T:]
            ids, pos = self.tokens, 0
        else:
            self.tokens = np.concatenate([self.tokens, ids], axis=1)
        x = self.xp.asarray(ids)
        for step in self._steps:
            x = step(x, pos)
        return x.copy()   # the head's output buffer is its context's, overwritten by the next call
