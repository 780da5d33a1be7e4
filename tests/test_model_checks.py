"""A user's layers are trusted to run, not to be right (issue 27): what their
code can silently get wrong is refused when the spec is made, one line
naming the layer (nn/spec.py, nn/check.py), and what the runner can make
safe it makes safe (nn/chain.py: an in-place layer after one that keeps its
output gets a copy).

    .venv/bin/python -m pytest -q tests/test_model_checks.py
"""
import os
import sys

import numpy as np
import pytest

from hpctrain.nn import Dense, Flatten, Layer, LayerError, MaxPool2d, ModelSpec, ReLU, Residual
from hpctrain.nn.check import check_layers
from hpctrain.nn.layer_errors import LayerCodeError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from custom_model import LeakyReLU  # noqa: E402  (the example, as users copy it)


# --- user layers, right and wrong --------------------------------------------------

class Tanh(Layer):
    """A textbook tanh: keeps its output y for its backward (1 - y^2)."""

    def forward(self, ctx, x, train):
        ctx.y = ctx.buffer(("out", train), x.shape, x.dtype)
        np.tanh(x, out=ctx.y)
        return ctx.y

    def backward(self, ctx, dy, need_dx):
        return dy * (1 - ctx.y * ctx.y)


class UndeclaredLeaky(Layer):
    """examples/custom_model.py's LeakyReLU before issue 27: in place, undeclared."""

    def forward(self, ctx, x, train):
        ctx.negative = x < 0
        x[ctx.negative] *= 0.1
        return x

    def backward(self, ctx, dy, need_dx):
        dy[ctx.negative] *= 0.1
        return dy


class Identity(Layer):
    def backward(self, ctx, dy, need_dx):
        return dy


class ClaimsNoOutput(Tanh):
    keeps_output = False   # but its backward reads ctx.y


class Wide(Layer):
    def forward(self, ctx, x, train):
        return np.zeros((x.shape[0], 3), x.dtype)


class Doubles(Layer):
    def forward(self, ctx, x, train):
        return x.astype(np.float64) * 2

    def backward(self, ctx, dy, need_dx):
        return dy * 2


class BadGradient(Layer):
    def forward(self, ctx, x, train):
        return x * 2

    def backward(self, ctx, dy, need_dx):
        return dy[:, :1]


class OldTanh(Layer):
    """Tanh written to the contract before issue 42: its output kept on the layer."""

    def forward(self, x, train):
        self.y = np.tanh(x)
        return self.y

    def backward(self, dy, need_dx):
        return dy * (1 - self.y * self.y)


class KeepsOnSelf(Layer):
    """The new arguments, but the output still kept on the layer."""

    def forward(self, ctx, x, train):
        self.y = np.tanh(x)
        return self.y

    def backward(self, ctx, dy, need_dx):
        return dy * (1 - self.y * self.y)


class Rebinds(Layer):
    keeps_output = False

    def configure(self, in_shape):
        return super().configure(in_shape)

    def param_shapes(self):
        return [("w", self.in_shape)]

    def forward(self, ctx, x, train):
        ctx.x = x
        return x * self.params["w"]

    def backward(self, ctx, dy, need_dx):
        self.grads["w"] = (dy * ctx.x).sum(axis=0)
        return dy * self.params["w"]


class DecayedDense(Dense):
    """Adds an L2 term to its weight gradient, which reads the weights: Dense's
    needs_params_without_dx = False inherited wrongly."""

    def backward(self, ctx, dy, need_dx):
        dx = super().backward(ctx, dy, need_dx)
        self.grads["W"] += 0.01 * self.params["W"]
        return dx


class WeightFirstDense(Dense):
    """Writes dW before it computes dx from W: Dense's
    grads_may_overwrite_params = True inherited wrongly (--zero 3 writes dW over W)."""

    def backward(self, ctx, dy, need_dx):
        d = dy.reshape(-1, self.here)
        np.matmul(ctx.rows.T, d, out=self.grads["W"])
        d.sum(axis=0, out=self.grads["b"])
        return (d @ self.params["W"].T).reshape(*dy.shape[:-1], self.fan_in) if need_dx else None


def _raises(method):
    def fail(self, *args):
        raise TypeError("my bug")
    return type(f"Raises{method}", (Layer,), {method: fail})


def _returns(method, value):
    return type(f"Returns{method}", (Layer,), {method: lambda self, *a: value})


class NaNInit(Layer):
    def param_shapes(self):
        return [("w", (3,))]

    def init(self, rng, params, dtype):
        params["w"][...] = np.nan


class Quits(Layer):
    def forward(self, ctx, x, train):
        sys.exit(0)


def spec(*middle, shape=(6,)):
    return ModelSpec([Flatten(), *middle, Dense(4)], shape, 4)


BAD = {
    "configure raises": (lambda: [_raises("configure")()], "layer 1 (Raisesconfigure): configure raised TypeError: my bug"),
    "configure returns None": (lambda: [_returns("configure", None)()], "configure returned None, not an output shape"),
    "configure returns a negative shape": (lambda: [_returns("configure", (-1,))()], "configure returned (-1,)"),
    "param_shapes raises": (lambda: [_raises("param_shapes")()], "param_shapes raised TypeError: my bug"),
    "a negative tensor shape": (lambda: [_returns("param_shapes", [("w", (-3, 2))])()],
                                "tensor 'w' has shape (-3, 2), not a tuple of positive whole numbers"),
    "a repeated tensor name": (lambda: [_returns("param_shapes", [("w", (2,)), ("w", (3,))])()],
                               "tensor name 'w' is used twice in the layer"),
    "not a list of tensors": (lambda: [_returns("param_shapes", None)()], "param_shapes() returned NoneType"),
    "init raises": (lambda: [_raises("init")()], "layer 1 (Raisesinit): init raised TypeError: my bug"),
    "init leaves nan": (lambda: [NaNInit()], "init left values that are not finite in w"),
    "forward raises": (lambda: [_raises("forward")()], "forward raised TypeError: my bug"),
    "forward quits": (lambda: [Quits()], "layer 1 (Quits): forward called sys.exit(0)"),
    "a wrong output shape": (lambda: [Wide()], "forward returned shape 3x3, but configure said 3x6"),
    "a float64 output": (lambda: [Doubles()], "forward returned float64 for a float32 input"),
    "a wrong input gradient": (lambda: [BadGradient()], "backward returned shape 3x1 as the input gradient"),
    "an undeclared in-place write": (lambda: [UndeclaredLeaky()], "forward wrote into its input but the layer "
                                                                  "does not declare inplace = True"),
    "its input handed on undeclared": (lambda: [Identity()], "forward returns its input (or a view of it) but "
                                                             "declares neither view = True"),
    "keeps_output = False, wrongly": (lambda: [ClaimsNoOutput()], "declares keeps_output = False, but its "
                                                                  "backward reads its forward's output"),
    "rebound gradient views": (lambda: [Rebinds()], "its gradient views were replaced"),
    "needs_params_without_dx = False, wrongly": (lambda: [DecayedDense(6)], "declares needs_params_without_dx = "
                                                 "False, but its backward without dx reads its parameters"),
    "grads_may_overwrite_params = True, wrongly": (lambda: [WeightFirstDense(6)], "declares "
                                                   "grads_may_overwrite_params = True, but its backward reads a "
                                                   "parameter after writing its gradient"),
    "an undeclared in-place write in a Residual": (lambda: [Residual([UndeclaredLeaky(), Dense(6)])],
                                                   "layer 1 (Residual[UndeclaredLeaky>Dense(6)]): forward wrote "
                                                   "into its input"),
    # issue 42, 1: a call's activations travel in its context, not on the layer
    "the contract before issue 42": (lambda: [OldTanh()], "layer 1 (OldTanh): forward(x, train) is the layer "
                                                          "contract before issue 42: it is now forward(ctx, x, train)"),
    "the old contract in a Residual": (lambda: [Residual([Dense(6), OldTanh()])],
                                       "layer 1.block1 (OldTanh): forward(x, train) is the layer contract before "
                                       "issue 42"),
    "activations kept on the layer": (lambda: [KeepsOnSelf()], "layer 1 (KeepsOnSelf): forward set self.y: a layer "
                                                               "keeps nothing of a call on itself"),
    "activations kept on a layer in a Residual": (lambda: [Residual([Dense(6), KeepsOnSelf()])],
                                                  "layer 1 (Residual[Dense(6)>KeepsOnSelf]): forward set "
                                                  "self.block1.y: a layer keeps nothing of a call on itself"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_user_layer_that_breaks_the_contract_is_one_line_naming_it(case):
    make, expect = BAD[case]
    with pytest.raises(LayerCodeError) as caught:
        check_layers(spec(*make()))
    line = str(caught.value)
    assert expect in line and "\n" not in line, line
    if "raises" in case or "quits" in case:
        assert "Traceback" in caught.value.traceback   # the user's, for the chief to print above the line


def test_one_layer_object_in_two_places_is_refused():
    d, r = Dense(6), ReLU()
    with pytest.raises(LayerCodeError, match=r"layer 3 \(Dense\(6\)\) is the same object as layer 1"):
        ModelSpec([Flatten(), d, ReLU(), d, Dense(4)], (6,), 4)
    with pytest.raises(LayerCodeError, match=r"layer 4 \(ReLU\) is the same object as layer 2"):
        ModelSpec([Flatten(), Dense(6), r, Dense(6), r, Dense(4)], (6,), 4)
    with pytest.raises(LayerCodeError, match=r"layer 2.block1 \(ReLU\) is the same object as layer 1.block1"):
        ModelSpec([Flatten(), Residual([Dense(6), r]), Residual([Dense(6), r]), Dense(4)], (6,), 4)


def test_the_example_and_the_docs_layers_pass_the_check():
    check_layers(spec(Dense(6), LeakyReLU(0.1), Tanh(), Dense(6), LeakyReLU()))
    check_layers(spec(Residual([LeakyReLU(), Dense(6), Tanh()]), LeakyReLU()))


# --- the in-place rule made safe: gradients against finite differences ---------------

def gradient_error(layers, shape=(6,), classes=4, seed=3):
    """Relative error of the whole model's parameter gradient against central
    differences, float64."""
    model = ModelSpec(layers, shape, classes).build(dtype=np.float64)
    model.init(seed)
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((5, *shape)), rng.integers(0, classes, 5)
    model.forward_backward(x.copy(), y)
    analytic = model.grads.copy()
    numeric = np.zeros_like(analytic)
    for k in range(model.num_params):
        old = model.params[k]
        model.params[k] = old + 1e-6
        up = float(model.forward_backward(x.copy(), y))
        model.params[k] = old - 1e-6
        down = float(model.forward_backward(x.copy(), y))
        model.params[k] = old
        numeric[k] = (up - down) / 2e-6
    return np.linalg.norm(analytic - numeric) / np.linalg.norm(analytic + numeric)


@pytest.mark.parametrize("layers", [
    # issue 27, 3: an in-place layer after one that keeps its output (4.9% before)
    lambda: [Flatten(), Dense(5), Tanh(), LeakyReLU(), Dense(4)],
    # ... past a view in between
    lambda: [Flatten(), Dense(5), Tanh(), Flatten(), LeakyReLU(), Dense(4)],
    # ... first in a Residual's block (45% before: the skip path saw its output)
    lambda: [Flatten(), Dense(5), Residual([LeakyReLU(), Dense(5)]), Dense(4)],
    # ... after a keeper inside a Residual's block
    lambda: [Flatten(), Dense(5), Residual([Dense(5), Tanh(), LeakyReLU(), Dense(5)]), Dense(4)],
], ids=["after a keeper", "past a view", "first in a residual", "inside a residual"])
def test_in_place_layers_get_the_gradient_right_wherever_they_stand(layers):
    assert gradient_error(layers()) < 1e-6


def test_the_zoo_models_make_no_copy():
    from hpctrain.nn import MODELS
    for name, make in MODELS.items():
        model = make((12, 12, 3), 10).build()
        assert not any(model.chain.copies), name


# --- hpctrain's own layers -------------------------------------------------------

def test_max_pooling_over_windows_wider_than_16():
    # issue 27, 10: the winner's offset was a byte, so 17 x 17 windows overflowed
    pool = MaxPool2d(17)
    pool.configure((34, 34, 2))
    pool.bind(np, {}, {}, {})
    x = np.random.default_rng(0).standard_normal((2, 34, 34, 2)).astype(np.float32)
    ctx = pool.context()
    y = pool.forward(ctx, x, True)
    windows = x.reshape(2, 2, 17, 2, 17, 2)
    assert np.array_equal(y, windows.max(axis=(2, 4)))
    dy = np.ones_like(y)
    dx = pool.backward(ctx, dy, True)
    assert dx.sum() == y.size and np.array_equal(dx * x, np.where(dx > 0, x, 0))
    assert np.array_equal((dx * x).reshape(2, 2, 17, 2, 17, 2).sum(axis=(2, 4)), y)


def test_batch_norm_1d_needs_two_samples_and_the_spec_says_so():
    from hpctrain.nn import BatchNorm1d
    assert spec(BatchNorm1d()).min_batch == 2
    assert spec(Residual([Dense(6), BatchNorm1d()])).min_batch == 2
    assert spec(Dense(6)).min_batch == 1


def test_a_model_that_does_not_fit_is_still_a_layer_error_not_a_code_error():
    with pytest.raises(LayerError) as caught:
        ModelSpec([Dense(4)], (6, 6), 4)
    assert not isinstance(caught.value, LayerCodeError)


# --- python -m hpctrain.nn: the spec tool, and --check (issue 27, 11; issue 32, 5) ---------

def nn_tool(*args):
    import subprocess
    return subprocess.run([sys.executable, "-m", "hpctrain.nn", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, expect", [
    (["--shape", "abc"], "argument --shape: expected comma-separated whole numbers"),
    (["--hidden", "abc"], "argument --hidden: expected comma-separated whole numbers"),
    (["--shape", "0,0"], "argument --shape: the image shape must be >= 1 each"),
    (["--classes", "0"], "argument --classes: must be >= 1, got 0"),
    (["--hidden", "-5"], "argument --hidden: --hidden must be >= 1 each"),
    (["--model", "lenet", "--shape", "28"], "--model lenet on 28, 10 classes: layer 0 (Channels)"),
    (["--model", "nowhere.py:build"], "nowhere.py is not a file"),
])
def test_the_spec_tools_bad_arguments_are_one_line_and_exit_2(args, expect):
    r = nn_tool(*args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and expect in r.stderr, r.stderr
    assert r.stderr.startswith("hpctrain: error: ") and not r.stdout


def test_the_spec_tool_checks_a_users_model_layer_by_layer(tmp_path):
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                           "custom_model.py")
    r = nn_tool("--model", f"{example}:build", "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed: gradients within") == 6 and "model passed" in r.stdout
    # a backward off by a factor: that layer's line says so, exit 1
    (tmp_path / "m.py").write_text(
        "from hpctrain.nn import Dense, Flatten, Layer\n\n\nclass Twice(Layer):\n    keeps_output = False\n\n"
        "    def forward(self, ctx, x, train):\n        return x * 2\n\n    def backward(self, ctx, dy, need_dx):\n"
        "        return dy * 3\n\n\ndef build(shape, classes):\n    return [Flatten(), Dense(8), Twice(), Dense(classes)]\n")
    r = nn_tool("--model", f"{tmp_path / 'm.py'}:build", "--check", "--shape", "6")
    assert r.returncode == 1, r.stdout + r.stderr
    bad = [line for line in r.stdout.splitlines() if "FAILED" in line]
    assert len(bad) == 1 and bad[0].startswith("layer   2 Twice") and "the backward does not match" in bad[0], bad
    # ... and one that breaks the contract (writes into its input) is named with it
    (tmp_path / "w.py").write_text(
        "from hpctrain.nn import Dense, Flatten, Layer\n\n\nclass Half(Layer):\n    keeps_output = False\n\n"
        "    def forward(self, ctx, x, train):\n        x *= 0.5\n        return x\n\n"
        "    def backward(self, ctx, dy, need_dx):\n"
        "        return dy * 0.5\n\n\ndef build(shape, classes):\n    return [Flatten(), Dense(8), Half(), Dense(classes)]\n")
    r = nn_tool("--model", f"{tmp_path / 'w.py'}:build", "--shape", "6")
    assert r.returncode == 2 and "layer 2 (Half): forward wrote into its input" in r.stderr, r.stderr
    r = nn_tool("--model", f"{tmp_path / 'w.py'}:build", "--shape", "6", "--check")
    bad = [line for line in r.stdout.splitlines() if "FAILED" in line]
    assert r.returncode == 1 and len(bad) == 1 and bad[0].startswith("layer   2 Half"), r.stdout + r.stderr
    assert "forward wrote into its input but the layer does not declare inplace = True" in bad[0], bad


def test_bench_layers_refuses_a_batch_that_cannot_fit():
    import subprocess
    r = subprocess.run([sys.executable, "-m", "hpctrain.bench", "layers", "--batch", "1000000000"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--model small_cnn at --batch 1000000000 needs at least" in r.stderr and "GiB available" in r.stderr
