"""The GPT's options a GPT-2 checkpoint needs (issue 56 §2): `act=gelu_tanh`
(nn/gelu.py GELU(approximate="tanh"), GPT-2's GELU, transformers' gelu_new)
against torch.nn.functional.gelu(approximate="tanh") in float64 and float32,
forward and backward, on NumPy, in the compiled kernel (nn/passes.py) and on
test_layers' CuPy stand-in, and against finite differences; `eps=X` (every
LayerNorm's epsilon); both parsed in the model's name (flags/model_names.py),
named in its summary, refused in one line when bad, and a whole GPT with
them against bench/torch_gpt.py's PyTorch twin.

    .venv/bin/python -m pytest -q tests/test_gpt_options.py
"""
import numpy as np
import pytest

from hpctrain.flags.model_names import gpt_name, gpt_options
from hpctrain.nn import GELU, LayerNorm, compiled, gpt
from hpctrain.nn.layers import LayerError
from test_layers import Dev, StandInCupy, bound, check_gradients

torch = pytest.importorskip("torch")
KERNEL = [False] + ([True] if compiled.available() else [])


def _x_and_dy(dtype):
    """Both tails (tanh saturates near |u| = 9: x ~ 5.5) and the middle."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal((4, 40)) * 3, np.linspace(-30, 30, 160).reshape(4, 40)], 1)
    return x.astype(dtype), rng.standard_normal(x.shape).astype(dtype)


def _ours(x, dy, kernel, xp=np):
    compiled.use(kernel)
    try:
        slot, _, _ = bound(GELU("tanh"), x.shape[1:], xp=xp, dtype=x.dtype)
    finally:
        compiled.use(False)
    assert slot.layer.compiled == kernel
    return slot.forward(xp.asarray(x.copy()), True).copy(), slot.backward(xp.asarray(dy.copy()), True).copy()


@pytest.mark.parametrize("kernel", KERNEL, ids=lambda k: "compiled" if k else "numpy")
@pytest.mark.parametrize("dtype, ulps", [(np.float64, 4), (np.float32, 4)])
def test_gelu_tanh_is_torchs_forward_and_backward(dtype, ulps, kernel):
    """Within a few units of the last place of what each sums: x S's |x|,
    dy (S + x S')'s |dy| (1 + |x|)."""
    x, dy = _x_and_dy(dtype)
    tx = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.gelu(tx, approximate="tanh")
    ty.backward(torch.tensor(dy))
    y, dx = _ours(x, dy, kernel)
    eps = np.finfo(dtype).eps
    assert (np.abs(y - ty.detach().numpy()) <= ulps * eps * np.abs(x) + 1e-30).all()
    assert (np.abs(dx - tx.grad.numpy()) <= ulps * eps * np.abs(dy) * (1 + np.abs(x)) + 1e-30).all()
    assert y.dtype == dx.dtype == dtype


@pytest.mark.parametrize("kernel", KERNEL, ids=lambda k: "compiled" if k else "numpy")
def test_gelu_tanh_gradient_matches_finite_differences(kernel):
    compiled.use(kernel)
    try:
        check_gradients(GELU(approximate="tanh"), (5, 6))
    finally:
        compiled.use(False)


def test_gelu_tanh_on_the_cupy_stand_in_is_numpys_bits():
    x, dy = _x_and_dy(np.float64)
    y, dx = _ours(x, dy, False)
    dev_y, dev_dx = _ours(x, dy, False, xp=StandInCupy())
    assert isinstance(dev_y, Dev) and isinstance(dev_dx, Dev)
    assert np.array_equal(y, dev_y.view(np.ndarray)) and np.array_equal(dx, dev_dx.view(np.ndarray))


def test_gelu_takes_none_or_tanh_and_exact_stays_the_default():
    assert GELU().approximate == "none" and GELU().describe() == "GELU"
    assert GELU("tanh").describe() == "GELU(tanh)"
    with pytest.raises(ValueError, match="approximate='erf'"):
        GELU("erf")


def test_act_and_eps_in_the_name_parse_and_default_names_are_unchanged():
    options = gpt_options("gpt:layers=2,heads=2,width=32,act=gelu_tanh,eps=1e-6")
    assert (options["act"], options["eps"]) == ("gelu_tanh", 1e-6)
    assert gpt_name(options) == "gpt:layers=2,heads=2,width=32,act=gelu_tanh,eps=1e-06"
    assert gpt_options(gpt_name(options)) == options
    plain = gpt_options("gpt:layers=2,heads=2,width=32,act=gelu,eps=1e-5")
    assert gpt_name(plain) == "gpt:layers=2,heads=2,width=32"   # the record of every model so far
    for bad, line in (("act=relu", "act='relu' is not one of gelu, gelu_tanh"),
                      ("eps=0", "eps=0.0 is not in (0, 1)"), ("eps=nan", "eps=nan is not in (0, 1)"),
                      ("eps=small", "eps='small' is not a real number")):
        with pytest.raises(ValueError, match=f"^{line.replace('(', '[(]').replace(')', '[)]')}$"):
            gpt_options(f"gpt:layers=2,heads=2,width=32,{bad}")
    with pytest.raises(LayerError, match="act='swish'"):
        gpt(11, 8, 1, 2, 8, act="swish")


def test_the_spec_has_them_everywhere_and_its_summary_names_them():
    spec = gpt(11, 8, 2, 2, 32, act="gelu_tanh", eps=1e-6, name=gpt_name(gpt_options(
        "gpt:layers=2,heads=2,width=32,act=gelu_tanh,eps=1e-6")))
    norms, gelus = [], []
    for layer in spec.layers:
        for inner in [layer, *(inner for _, inner in getattr(layer, "inner", ()))]:
            norms += [inner] if isinstance(inner, LayerNorm) else []
            gelus += [inner] if isinstance(inner, GELU) else []
    assert [n.eps for n in norms] == [1e-6] * 5 and [g.approximate for g in gelus] == ["tanh"] * 2
    text = "\n".join(spec.summary())
    assert "model gpt:layers=2,heads=2,width=32,act=gelu_tanh,eps=1e-06:" in text, text
    assert "Block(32, heads=2, act=gelu_tanh, eps=1e-06)" in text and "LayerNorm(eps=1e-06)" in text, text
    assert spec.identity != gpt(11, 8, 2, 2, 32, name=spec.name).identity


@pytest.mark.parametrize("name", ["gpt:layers=2,heads=2,width=32,act=gelu_tanh,eps=1e-6",
                                  "gpt:layers=2,heads=2,width=32,eps=0.1"])
def test_a_gpt_with_them_gives_its_pytorch_twins_logits(name):
    """bench/torch_gpt.py's twin (nn.GELU(approximate="tanh"), nn.LayerNorm(eps))
    on the same weights: float32 rounding apart (eps=0.1: a wrong epsilon would show)."""
    from hpctrain.bench.torch_gpt import same_gpt
    r = same_gpt(gpt_options(name), vocab=11, block_size=8)
    assert r["hpctrain_params"] == r["torch_params"]
    assert r["max_logit_diff"] < 1e-5 * max(1.0, r["max_logit"]), r
