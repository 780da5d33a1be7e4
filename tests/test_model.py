"""The MLP (nn/zoo.py's layer list on nn/spec.py's layout): flat buffers with
per-layer views, and backprop against finite differences."""
import numpy as np
import pytest

from hpctrain.nn import ClassCrossEntropy, Dense, Flatten, ModelSpec, mlp
from hpctrain.nn.check import check_loss
from hpctrain.nn.gpt import gpt
from hpctrain.nn.losses import TokenCrossEntropy


def MLP(hidden=(500, 500), dtype=np.float32):
    return mlp(hidden=hidden).build(dtype=dtype)


def weights(m):
    """The W and b views of each Dense layer, in order."""
    t = dict(m.tensors())
    k = len(m.layer_ranges)
    return [t[f"layer{i}/W"] for i in range(k)], [t[f"layer{i}/b"] for i in range(k)]


def test_views_share_one_flat_buffer():
    m = MLP((20, 10))
    assert m.num_params == mlp(hidden=(20, 10)).num_params == 784 * 20 + 20 + 20 * 10 + 10 + 10 * 10 + 10
    m.params[:] = np.arange(m.num_params, dtype=np.float32)
    for name, lo, hi in m.tensor_ranges():
        view = dict(m.tensors())[name]
        assert np.shares_memory(view, m.params)
        assert np.array_equal(view.ravel(), np.arange(lo, hi, dtype=np.float32))
    for layer in m.layers:
        for g in getattr(layer, "grads", {}).values():
            assert np.shares_memory(g, m.grads)
    assert sum(len(layer.grads) for layer in m.layers) == 6
    assert [n for n, _ in m.tensors()] == ["layer0/W", "layer0/b", "layer1/W", "layer1/b", "layer2/W", "layer2/b"]


def test_gradient_matches_finite_differences():
    m = MLP((16, 12), dtype=np.float64)
    m.init(3)
    rng = np.random.default_rng(0)
    x, y = rng.random((6, 784)), rng.integers(0, 10, 6)
    m.forward_backward(x, y)
    analytic = m.grads.copy()
    # every bias and a sample of weights from every layer
    picks = [k for _, lo, hi in m.tensor_ranges() for k in rng.choice(np.arange(lo, hi), min(15, hi - lo), replace=False)]
    eps = 1e-6
    for k in picks:
        old = m.params[k]
        m.params[k] = old + eps
        up = float(m.forward_backward(x, y))
        m.params[k] = old - eps
        down = float(m.forward_backward(x, y))
        m.params[k] = old
        numeric = (up - down) / (2 * eps)
        assert abs(numeric - analytic[k]) <= 1e-6 + 1e-4 * abs(numeric), (k, numeric, analytic[k])


def test_layer_done_callbacks_run_last_layer_first_after_its_gradient_is_final():
    m = MLP((8, 8))
    m.init(0)
    x = np.random.default_rng(0).random((4, 784)).astype(np.float32)
    y = np.array([1, 2, 3, 4])
    m.forward_backward(x, y)
    final = m.grads.copy()
    m.grads[:] = np.nan
    seen = []

    def done(i):
        lo, hi = m.layer_ranges[i]
        assert np.array_equal(m.grads[lo:hi], final[lo:hi])
        seen.append(i)
    m.forward_backward(x, y, on_layer_done=done)
    assert seen == [2, 1, 0]


def test_evaluate_counts_correct_and_loss():
    m = MLP((8,))
    m.init(0)
    rng = np.random.default_rng(1)
    x = rng.random((2500, 784)).astype(np.float32)
    # The predictions, by an independent forward pass in float64: ReLU between layers.
    a = x.astype(np.float64)
    Ws, bs = weights(m)
    for i, (W, b) in enumerate(zip(Ws, bs)):
        a = a @ W.astype(np.float64) + b
        if i < len(Ws) - 1:
            a = np.maximum(a, 0)
    predicted = a.argmax(axis=1)
    top2 = np.sort(a, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-5   # no near-tie float32 could flip
    # Labels right for a known 1234 samples (spread over every batch), wrong for the rest.
    right = rng.permutation(2500)[:1234]
    y = (predicted + 1 + rng.integers(0, 9, 2500)) % 10
    y[right] = predicted[right]
    sums = m.evaluate(x, y, batch=1000)
    loss_sum, correct = sums["loss"], sums["correct"]
    assert sums["count"] == 2500
    loss = float(m.forward_backward(x, y))
    assert abs(loss_sum / 2500 - loss) < 1e-4
    assert correct == 1234
    # uint8 pixels are scaled the same way as the floats they stand for.
    pixels = rng.integers(0, 256, (300, 784), dtype=np.uint8)
    assert m.evaluate(pixels, y[:300], batch=128)["correct"] == m.evaluate(
        (pixels / np.float32(255)).astype(np.float32), y[:300], batch=128)["correct"]


class Scaled(ClassCrossEntropy):
    """The default loss, its gradient scaled by 0.5 and its loss sum by 3."""

    def forward_backward(self, ctx, logits, targets):
        loss, d = super().forward_backward(ctx, logits, targets)
        d *= np.float32(0.5)
        return loss, d

    def sums(self, ctx, logits, targets):
        sums = super().sums(ctx, logits, targets)
        return dict(sums, loss=3 * sums["loss"])


def test_the_specs_loss_is_what_training_and_evaluation_use():
    """The loss is the spec's, not the runner's: its gradient is what backprop
    starts from (halved here: a linear model's gradient halves, bit for bit,
    the halving being exact) and its sums are what evaluate adds."""
    rng = np.random.default_rng(0)
    x, y = rng.random((6, 4, 5), dtype=np.float32), rng.integers(0, 3, 6)
    models = []
    for loss in (None, Scaled()):
        m = ModelSpec([Flatten(), Dense(3)], (4, 5), 3, loss=loss).build()
        m.init(1)
        models.append((float(m.forward_backward(x, y)), m.grads.copy(), m.evaluate(x, y)))
    (plain_loss, plain_grads, plain_sums), (loss, grads, sums) = models
    assert loss == plain_loss
    assert np.array_equal(grads, plain_grads * np.float32(0.5))
    assert sums == dict(plain_sums, loss=3 * plain_sums["loss"]) and sums["count"] == 6


class TokenLossOfMine(TokenCrossEntropy):
    """A user's token loss: hpctrain's, from a module of the user's."""


def test_a_users_token_loss_passes_the_start_up_check():
    # The check once fed one target per sample whatever the logits' shape, so
    # a user's loss over a GPT's (T, vocabulary) logits raised at start-up.
    spec = gpt(11, 8, 1, 2, 8)
    spec.loss = TokenLossOfMine()
    check_loss(spec)


def test_init_is_deterministic_and_he_scaled():
    a, b = MLP(), MLP()
    a.init(7)
    b.init(7)
    assert np.array_equal(a.params, b.params)
    Ws, bs = weights(a)
    assert abs(float(Ws[0].std()) - np.sqrt(2 / 784)) < 0.01 * np.sqrt(2 / 784) * 10
    assert not np.any(bs[0])


def test_build_refuses_a_buffer_of_the_wrong_size_or_type_with_a_real_check():
    """build's buffers are checked by a raise, not an assert that python -O would drop."""
    spec = mlp(hidden=(8,))
    with pytest.raises(ValueError, match=rf"build's grads must be one contiguous float32 buffer of "
                                         rf"{spec.num_params} elements, got shape \(3,\), float32"):
        spec.build(grads=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"build's params .* got shape .*, float64"):
        spec.build(params=np.zeros(spec.num_params))
    with pytest.raises(ValueError, match=r"not contiguous"):
        spec.build(params=np.zeros(2 * spec.num_params, np.float32)[::2])
