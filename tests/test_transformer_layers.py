"""The transformer's layers (nn/norm.py, nn/gelu.py, nn/linear.py,
nn/attention.py, nn/transformer.py), the per-token loss (nn/losses.py
TokenCrossEntropy) and nanoGPT's model (nn/gpt.py): finite differences in
float64 for every layer and the loss; the whole GPT (2 layers, 2 heads,
width 8, vocabulary 11, 5 positions, batch 3) against a plain float64 NumPy
reference written here (logits, loss and every parameter gradient), as
llm.c checks its GPT against PyTorch; causality; dropout per sample
whatever the batch split; each layer through nn/check.py's checks (a layer
keeps nothing of a call on itself, never writes its input, ...); the CuPy
path on test_layers' NumPy stand-in, bit for bit.

    .venv/bin/python -m pytest -q tests/test_transformer_layers.py
"""
import math

import numpy as np
import pytest

from hpctrain.nn import (GELU, Block, CausalSelfAttention, Context, Dropout, LayerError, LayerNorm, Linear,
                         ModelSpec, Noise, PositionEmbedding, TokenCrossEntropy, gpt)
from hpctrain.nn.check import check_layer
from hpctrain.nn.gelu import CHUNK, erfc_abs, normal_cdf
from test_layers import Dev, StandInCupy, bound, check_gradients, rel_error

VOCAB, T, WIDTH, HEADS, LAYERS, BATCH = 11, 5, 8, 2, 2, 3


# --- GELU's erf --------------------------------------------------------------------

def test_gelu_erfc_is_good_to_float64_rounding_and_keeps_the_dtype():
    """Cody's erfc against math.erfc, relative, over the three intervals and
    far into the tail (erfc(26) ~ 1e-296); Phi in float32 for float32."""
    a = np.concatenate([np.linspace(0, 26, 52001), np.geomspace(1e-12, 0.5, 500)])
    want = np.array([math.erfc(v) for v in a])
    assert np.max(np.abs(erfc_abs(np, a) - want) / want) < 2e-15
    x = np.linspace(-9, 9, 2 * CHUNK + 5)   # chunk by chunk, the last one short
    z = x * (1 / math.sqrt(2))
    want = np.array([0.5 * math.erfc(-v) for v in z])
    assert np.max(np.abs(normal_cdf(np, x) - want) / want) < 2e-15
    assert normal_cdf(np, x.astype(np.float32)).dtype == np.float32


# --- finite differences ----------------------------------------------------------------

LAYER_CASES = [
    (lambda: LayerNorm(), (T, WIDTH)),
    (lambda: LayerNorm(), (6,)),
    (lambda: GELU(), (T, 6)),
    (lambda: Linear(7), (T, WIDTH)),
    (lambda: Linear(7, bias=False), (T, WIDTH)),
    (lambda: PositionEmbedding(std=0.5), (T, WIDTH)),
    (lambda: Dropout(0.3), (T, WIDTH)),
    (lambda: CausalSelfAttention(HEADS, std=0.5, out_std=0.5), (T, WIDTH)),
    (lambda: CausalSelfAttention(1, dropout=0.3, std=0.5, out_std=0.5), (T, WIDTH)),
    (lambda: Block(WIDTH, HEADS, std=0.5, out_std=0.5), (T, WIDTH)),
    (lambda: Block(WIDTH, 4, dropout=0.2, std=0.5, out_std=0.5), (T, WIDTH)),
]


@pytest.mark.parametrize("make, shape", LAYER_CASES, ids=lambda v: v().describe() if callable(v) else
                         "x".join(map(str, v)))
def test_layer_gradients_match_finite_differences(make, shape):
    # (std 0.5: weights large enough that the attention is far from uniform)
    check_gradients(make(), shape, batch=BATCH, picks=40)


def test_the_layernorm_weight_and_bias_start_at_one_and_zero():
    layer, params, _ = bound(LayerNorm(), (T, WIDTH))
    assert np.array_equal(layer.params["gamma"], np.ones(WIDTH)) and not layer.params["beta"].any()


def test_a_position_embedding_takes_a_shorter_sequence():
    layer, _, grads = bound(PositionEmbedding(std=0.5), (T, WIDTH))
    x, dy = np.zeros((BATCH, 3, WIDTH)), np.random.default_rng(0).standard_normal((BATCH, 3, WIDTH))
    grads[...] = 1
    assert np.array_equal(layer.forward(x, True), np.broadcast_to(layer.params["P"][:3], x.shape))
    assert layer.backward(dy, True) is dy
    assert np.array_equal(layer.grads["P"][:3], dy.sum(axis=0)) and not layer.grads["P"][3:].any()


def _logits_and_targets(seed=0, ignored=((0, 1), (2, 4))):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((BATCH, T, VOCAB)) * 2
    targets = rng.integers(0, VOCAB, (BATCH, T))
    for n, t in ignored:
        targets[n, t] = -1
    return logits, targets


def test_token_cross_entropy_matches_finite_differences_and_skips_ignored_tokens():
    loss = TokenCrossEntropy()
    loss.check((T, VOCAB), VOCAB)
    logits, targets = _logits_and_targets()
    value, d = loss.forward_backward(Context(np), logits.copy(), targets)
    d = d.copy()
    counted = targets != -1
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    want = -np.take_along_axis(logp, np.where(counted, targets, 0)[..., None], -1)[..., 0][counted].mean()
    assert abs(float(value) - want) < 1e-14 * want
    assert not d[~counted].any(), "dlogits must be zero at the ignored tokens"
    numeric = np.empty(logits.size)
    flat = logits.reshape(-1)
    for k in range(flat.size):
        old = flat[k]
        flat[k] = old + 1e-6
        up = float(loss.forward_backward(Context(np), logits, targets)[0])
        flat[k] = old - 1e-6
        down = float(loss.forward_backward(Context(np), logits, targets)[0])
        flat[k] = old
        numeric[k] = (up - down) / 2e-6
    assert rel_error(numeric, d.reshape(-1)) < 1e-8
    sums = loss.sums(Context(np), logits, targets)
    assert sums["count"] == counted.sum() and abs(sums["loss"] / sums["count"] - want) < 1e-14 * want
    assert sums["correct"] == int(((logits.argmax(-1) == targets) & counted).sum())
    assert loss.zero_sums() == {"loss": 0.0, "count": 0, "correct": 0}


def test_token_cross_entropy_of_only_ignored_tokens_is_zero_and_so_is_its_gradient():
    logits, _ = _logits_and_targets()
    value, d = TokenCrossEntropy(ignore_index=7).forward_backward(Context(np), logits, np.full((BATCH, T), 7))
    assert float(value) == 0 and not d.any()


def test_bad_shapes_are_one_line():
    with pytest.raises(LayerError, match=r"a per-token loss needs \(positions, 11\)"):
        ModelSpec([PositionEmbedding(), Linear(10)], (T, WIDTH), VOCAB, loss=TokenCrossEntropy())
    with pytest.raises(LayerError, match="the width 8 is not a multiple of the heads"):
        ModelSpec([CausalSelfAttention(3), Linear(VOCAB)], (T, WIDTH), VOCAB, loss=TokenCrossEntropy())
    with pytest.raises(LayerError, match=r"Block\(6, heads=2\) takes \(positions, 6\) per sample, not 5x8"):
        ModelSpec([Block(6, 2), Linear(VOCAB)], (T, WIDTH), VOCAB, loss=TokenCrossEntropy())
    with pytest.raises(LayerError, match="the width 8 is not a multiple of the heads"):
        gpt(VOCAB, T, 1, 3, 8)


# --- the whole GPT against a plain float64 reference -------------------------------------

def _erf(x):
    return np.vectorize(math.erf)(x)


class Reference:
    """nanoGPT's forward and backward, one sample and one head at a time, in
    plain float64 NumPy: softmax over the visible positions only (no mask),
    LayerNorm's input gradient through its Jacobian, GELU through math.erf.
    `p`: the model's tensors by name (embedding/E, blocks.b/..., ln_f/...)."""

    def __init__(self, p, layers=LAYERS, heads=HEADS):
        self.p, self.layers, self.heads = p, layers, heads

    @staticmethod
    def layernorm(x, g, b):
        mu = x.mean(-1, keepdims=True)
        rstd = 1 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
        xhat = (x - mu) * rstd
        return xhat * g + b, (xhat, rstd, g)

    @staticmethod
    def layernorm_back(dy, cache):
        xhat, rstd, g = cache
        c = xhat.shape[-1]
        dx = np.empty_like(dy)
        for idx in np.ndindex(*dy.shape[:-1]):
            jac = rstd[idx] * (np.eye(c) - 1 / c - np.outer(xhat[idx], xhat[idx]) / c)   # d xhat / d x
            dx[idx] = jac.T @ (dy[idx] * g)
        return dx, (dy * xhat).reshape(-1, c).sum(0), dy.reshape(-1, c).sum(0)

    def attention(self, x, w):
        n, t, c = x.shape
        d = c // self.heads
        qkv = x @ w["Wqkv"] + w["bqkv"]
        out = np.zeros((n, t, c))
        probs = {}
        for s in range(n):
            for h in range(self.heads):
                q, k, v = (qkv[s, :, j * c + h * d:j * c + (h + 1) * d] for j in range(3))
                a = np.zeros((t, t))
                for i in range(t):
                    score = q[i] @ k[:i + 1].T / math.sqrt(d)
                    e = np.exp(score - score.max())
                    a[i, :i + 1] = e / e.sum()
                probs[s, h] = a
                out[s, :, h * d:(h + 1) * d] = a @ v
        return out @ w["Wo"] + w["bo"], (x, qkv, probs, out)

    def attention_back(self, dy, w, cache):
        x, qkv, probs, merged = cache
        n, t, c = x.shape
        d = c // self.heads
        g = {"Wo": merged.reshape(-1, c).T @ dy.reshape(-1, c), "bo": dy.reshape(-1, c).sum(0)}
        dmerged = dy @ w["Wo"].T
        dqkv = np.zeros_like(qkv)
        for s in range(n):
            for h in range(self.heads):
                q, k, v = (qkv[s, :, j * c + h * d:j * c + (h + 1) * d] for j in range(3))
                a, dout = probs[s, h], dmerged[s, :, h * d:(h + 1) * d]
                da, dv = dout @ v.T, a.T @ dout
                dscore = np.zeros((t, t))
                for i in range(t):
                    row = a[i, :i + 1]
                    dscore[i, :i + 1] = (np.diag(row) - np.outer(row, row)) @ da[i, :i + 1] / math.sqrt(d)
                for j, part in enumerate((dscore @ k, dscore.T @ q, dv)):
                    dqkv[s, :, j * c + h * d:j * c + (h + 1) * d] = part
        g["Wqkv"], g["bqkv"] = x.reshape(-1, c).T @ dqkv.reshape(-1, 3 * c), dqkv.reshape(-1, 3 * c).sum(0)
        return dqkv @ w["Wqkv"].T, g

    def run(self, ids, targets):
        """(logits, loss, {tensor name: gradient})."""
        p, grads = self.p, {}
        x = p["embedding/E"][ids] + p["position/P"]
        caches = []
        for b in range(self.layers):
            w = {name.split("/")[1]: v for name, v in p.items() if name.startswith(f"blocks.{b}/")}
            h1, c1 = self.layernorm(x, w["ln1.gamma"], w["ln1.beta"])
            a, ca = self.attention(h1, {k[5:]: v for k, v in w.items() if k.startswith("attn.")})
            x1 = x + a
            h2, c2 = self.layernorm(x1, w["ln2.gamma"], w["ln2.beta"])
            f = h2 @ w["fc.W"] + w["fc.b"]
            gelu = 0.5 * f * (1 + _erf(f / math.sqrt(2)))
            x2 = x1 + gelu @ w["proj.W"] + w["proj.b"]
            caches.append((w, c1, ca, c2, h2, f, gelu))
            x = x2
        last = "ln_f/"
        xf, cf = self.layernorm(x, p[last + "gamma"], p[last + "beta"])
        logits = xf @ p["embedding/E"].T
        counted = targets != -1
        e = np.exp(logits - logits.max(-1, keepdims=True))
        soft = e / e.sum(-1, keepdims=True)
        picked = np.take_along_axis(soft, np.where(counted, targets, 0)[..., None], -1)[..., 0]
        loss = -np.log(picked)[counted].mean()
        dlogits = soft.copy()
        for s, i in zip(*np.nonzero(counted)):
            dlogits[s, i, targets[s, i]] -= 1
        dlogits *= counted[..., None] / counted.sum()
        dE = dlogits.reshape(-1, VOCAB).T @ xf.reshape(-1, xf.shape[-1])
        dx, grads[last + "gamma"], grads[last + "beta"] = self.layernorm_back(dlogits @ p["embedding/E"], cf)
        for b in range(self.layers - 1, -1, -1):
            w, c1, ca, c2, h2, f, gelu = caches[b]
            name = f"blocks.{b}/"
            grads[name + "proj.W"] = gelu.reshape(-1, gelu.shape[-1]).T @ dx.reshape(-1, dx.shape[-1])
            grads[name + "proj.b"] = dx.reshape(-1, dx.shape[-1]).sum(0)
            dgelu = dx @ w["proj.W"].T
            df = dgelu * (0.5 * (1 + _erf(f / math.sqrt(2))) + f * np.exp(-f * f / 2) / math.sqrt(2 * math.pi))
            grads[name + "fc.W"] = h2.reshape(-1, h2.shape[-1]).T @ df.reshape(-1, df.shape[-1])
            grads[name + "fc.b"] = df.reshape(-1, df.shape[-1]).sum(0)
            dh2, grads[name + "ln2.gamma"], grads[name + "ln2.beta"] = self.layernorm_back(df @ w["fc.W"].T, c2)
            dx1 = dx + dh2
            dh1, g = self.attention_back(dx1, {k[5:]: v for k, v in w.items() if k.startswith("attn.")}, ca)
            grads.update({name + "attn." + k: v for k, v in g.items()})
            dx0, grads[name + "ln1.gamma"], grads[name + "ln1.beta"] = self.layernorm_back(dh1, c1)
            dx = dx1 + dx0
        grads["position/P"] = dx.sum(0)
        for s, i in np.ndindex(*ids.shape):
            dE[ids[s, i]] += dx[s, i]
        grads["embedding/E"] = dE
        return logits, loss, grads


def _gpt_model(seed=5, dropout=0.0):
    spec = gpt(VOCAB, T, LAYERS, HEADS, WIDTH, dropout)
    model = spec.build(dtype=np.float64)
    model.init(seed)
    # larger weights than nanoGPT's 0.02 so every path carries a visible gradient
    model.params[...] *= 1 + np.random.default_rng(seed).random(spec.num_params) * 20
    return spec, model


def test_gpt_matches_a_plain_float64_reference():
    """Logits and loss within 1e-12 relative, each parameter tensor's
    gradient within 1e-11 relative (seen: 3e-16 and 1e-14 at most); a
    target ignored on the way."""
    spec, model = _gpt_model()
    rng = np.random.default_rng(1)
    ids, targets = rng.integers(0, VOCAB, (BATCH, T)), rng.integers(0, VOCAB, (BATCH, T))
    targets[1, 2] = -1
    loss = float(model.forward_backward(ids, targets))
    logits = model.run.forward(ids, False)
    params = {name: view.copy() for name, view in model.tensors()}
    grads = {name: model.grads[lo:hi].reshape(shape) for name, shape, lo, hi in spec.tensors}
    want_logits, want_loss, want = Reference(params).run(ids, targets)
    assert rel_error(logits, want_logits) < 1e-12 and abs(loss - want_loss) < 1e-12 * want_loss
    assert sorted(grads) == sorted(want)
    for name in want:
        assert np.abs(want[name]).max() > 1e-2 and rel_error(grads[name], want[name]) < 1e-11, name


def test_gpt_gradients_match_finite_differences():
    """The spec's gradient (the tied head's part included) against central
    differences on 60 parameters, whatever the reference above assumes."""
    spec, model = _gpt_model(seed=2, dropout=0.1)
    rng = np.random.default_rng(3)
    ids, targets = rng.integers(0, VOCAB, (BATCH, T)), rng.integers(0, VOCAB, (BATCH, T))
    noise = (1, 2, np.arange(BATCH))
    model.forward_backward(ids, targets, noise=noise)
    analytic = model.grads.copy()
    picks = rng.choice(spec.num_params, 60, replace=False)
    numeric = []
    for k in picks:
        old = model.params[k]
        model.params[k] = old + 1e-6
        up = float(model.forward_backward(ids, targets, noise=noise))
        model.params[k] = old - 1e-6
        down = float(model.forward_backward(ids, targets, noise=noise))
        model.params[k] = old
        numeric.append((up - down) / 2e-6)
    assert rel_error(np.array(numeric), analytic[picks]) < 1e-7


def test_gpt_layout_init_and_summary():
    """nanoGPT's init: N(0, 0.02) weights, the residual projections N(0,
    0.02 / sqrt(2 L)), biases 0, LayerNorm 1 and 0; the head lies nowhere
    (tied to layer 0's E)."""
    spec = gpt(1000, 16, 4, 4, 64)
    model = spec.build()
    model.init(0)
    t = dict(model.tensors())
    assert [(tie.user, tie.owner, tie.transposed) for tie in spec.ties] == [(8, 0, True)]
    for name, std in (("embedding/E", 0.02), ("position/P", 0.02), ("blocks.0/attn.Wqkv", 0.02), ("blocks.1/fc.W", 0.02),
                      ("blocks.2/attn.Wo", 0.02 / math.sqrt(8)), ("blocks.3/proj.W", 0.02 / math.sqrt(8))):
        assert abs(t[name].std() / std - 1) < 0.05 and abs(t[name].mean()) < std / 10, name
    assert not t["blocks.0/attn.bqkv"].any() and not t["blocks.3/fc.b"].any() and not t["blocks.3/proj.b"].any()
    assert (t["blocks.0/ln1.gamma"] == 1).all() and (t["ln_f/gamma"] == 1).all() and not t["ln_f/beta"].any()
    assert spec.input_kind == "tokens" and spec.shapes[-1] == (16, 1000)
    assert "W is layer 0's E transposed (tied)" in "\n".join(spec.summary())


def test_an_earlier_logit_does_not_see_a_later_token():
    _, model = _gpt_model()
    ids = np.random.default_rng(4).integers(0, VOCAB, (BATCH, T))
    before = model.run.forward(ids, False).copy()
    later = ids.copy()
    later[:, 3] = (later[:, 3] + 1) % VOCAB
    after = model.run.forward(later, False)
    assert np.array_equal(before[:, :3], after[:, :3])
    assert not np.allclose(before[:, 3:], after[:, 3:])
    # a prefix alone (3 of the 5 positions, the layers called directly) gives the same first logits
    prefix = model.chain.forward(model.ctx, ids[:, :3], False)
    assert prefix.shape == (BATCH, 3, VOCAB) and rel_error(prefix, before[:, :3]) < 1e-14


def test_dropout_in_the_gpt_is_per_sample_whatever_the_batch_split():
    """Attention dropout and both residual dropouts (streams nested in the
    blocks) draw from (seed, step, sample id) alone: the batch's first two
    rows give what those two rows give alone."""
    _, model = _gpt_model(dropout=0.3)
    ids = np.random.default_rng(6).integers(0, VOCAB, (4, T))
    model.run.set_noise((1, 9, np.arange(20, 24)))
    whole = model.run.forward(ids, True).copy()
    model.run.set_noise((1, 9, np.arange(20, 22)))
    part = model.run.forward(ids[:2], True)
    assert rel_error(whole[:2], part) < 1e-14
    model.run.set_noise((1, 10, np.arange(20, 24)))
    assert not np.allclose(whole, model.run.forward(ids, True))   # another step, other masks


def test_noise_none_after_a_step_with_noise_reaches_every_layer():
    """set_noise(None) after a step with noise clears every layer's, down to
    the attention's own dropout (LayerRange.set_noise skips the layers only
    while every context holds None already): a dropout then refuses to train
    without noise, not reuse the last step's masks; with noise again the
    masks are that step's."""
    _, model = _gpt_model(dropout=0.3)
    ids = np.random.default_rng(6).integers(0, VOCAB, (2, T))
    model.run.set_noise((1, 9, np.arange(2)))
    dropped = model.run.forward(ids, True).copy()
    model.run.set_noise(None)
    with pytest.raises(LayerError, match="needs noise"):
        model.run.forward(ids, True)
    model.run.set_noise((1, 9, np.arange(2)))
    assert model.run.forward(ids, True).tobytes() == dropped.tobytes()


# --- the contract, as nn/check.py checks a user's layer ------------------------------

@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_every_gpt_layer_passes_the_user_layer_checks(dropout):
    """check_layer runs each layer by itself in float32 (nn/check.py): it
    keeps nothing of a call on itself, does not write its input, returns
    float32 of its declared shape, reads no output it says it does not."""
    spec = gpt(VOCAB, T, 1, HEADS, WIDTH, dropout)
    for i in range(len(spec.layers)):
        check_layer(spec, i)


def test_the_new_layers_each_pass_the_user_layer_checks():
    for make, shape in LAYER_CASES:
        layer = make()
        spec = ModelSpec([layer, Linear(VOCAB)], shape, VOCAB, loss=TokenCrossEntropy() if len(shape) == 2 else None)
        check_layer(spec, 0)


# --- the CuPy path ----------------------------------------------------------------------

def test_cupy_path_on_a_stand_in_equals_numpy():
    """Every new layer and the loss through xp only (test_layers' stand-in
    refuses NumPy functions on device arrays): the same bits as NumPy, two
    steps (the second on warm buffers), and evaluation. The Embedding is
    left out: its xp.add.at is not in the stand-in."""
    def layers():
        return [PositionEmbedding(), Dropout(0.2), Block(WIDTH, HEADS, dropout=0.2), LayerNorm(),
                Linear(VOCAB, bias=False)]
    spec = ModelSpec(layers(), (T, WIDTH), VOCAB, loss=TokenCrossEntropy())
    xp = StandInCupy()
    host, dev = spec.build(dtype=np.float64), spec.build(xp, dtype=np.float64)
    host.init(3)
    dev.init(3)
    rng = np.random.default_rng(0)
    x, y, ids = rng.standard_normal((4, T, WIDTH)), rng.integers(-1, VOCAB, (4, T)), np.arange(40, 44)
    for _ in range(2):
        lh = host.forward_backward(x, y, noise=(1, 2, ids))
        ld = dev.forward_backward(xp.asarray(x), xp.asarray(y), noise=(1, 2, ids))
        assert isinstance(dev.grads, Dev)
        assert float(lh) == float(ld)
        assert np.array_equal(host.grads, dev.grads.view(np.ndarray))
    assert dev.evaluate(xp.asarray(x), xp.asarray(y), batch=3) == host.evaluate(x, y, batch=3)


def test_attention_holds_no_per_head_copies_beyond_its_estimate():
    """The heads' outputs are written into `merged` and q, k, v's gradients
    into dqkv by the products themselves (no per-head copies): what one
    attention's context holds after a step (NumPy's path, its softmax
    scratch included) stays within the memory check's count of it."""
    n = 3
    att, _, _ = bound(CausalSelfAttention(HEADS), (T, WIDTH))
    x = np.random.default_rng(0).standard_normal((n, T, WIDTH))
    att.backward(att.forward(x, True), True)
    assert 0.9 * n * 8 * att.train_floats() <= att.ctx.held_bytes() <= n * 8 * att.train_floats()


def test_noise_reaches_the_attention_dropout_inside_a_block():
    block, _, _ = bound(Block(WIDTH, HEADS, dropout=0.5), (T, WIDTH))
    block.set_noise(Noise(1, 2, np.arange(BATCH), stream=3))
    attn_ctx = block.ctx.inner[0].inner[1]
    assert attn_ctx.noise.stream == 3 * 64 + 2 and attn_ctx.inner[0].noise.stream == (3 * 64 + 2) * 64 + 1
