"""The ONNX export (hpctrain/interop/onnx_export.py) held to ONNX Runtime:
the zoo's image models and a small GPT, each trained a couple of steps in
process, written as a --save file and loaded back as predict loads it
(trained.load), exported; onnxruntime's logits within 1e-4 of hpctrain's
own forward on 100 inputs (the bundled MNIST sample's last images; windows
of the bundled plays); a prompt shorter than the context; the tied head one
tensor; GELU's tanh form; and the one line for what the export cannot write.

    .venv/bin/python -m pytest -q tests/test_onnx_export.py
"""
import math
import types

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from hpctrain import data   # noqa: E402
from hpctrain.base.errors import HpctrainError   # noqa: E402
from hpctrain.checkpoints import trained   # noqa: E402
from hpctrain.data.idx import read_idx   # noqa: E402
from hpctrain.data.vocab import Chars   # noqa: E402
from hpctrain.interop import export   # noqa: E402
from hpctrain.interop.onnx_export import write_onnx   # noqa: E402
from hpctrain.nn import (AvgPool2d, BatchNorm1d, Channels, Conv2d, Dense, Dropout, Flatten, ModelSpec,   # noqa: E402
                         ReLU)
from hpctrain.nn.decode import Decoder   # noqa: E402
from hpctrain.nn.gelu import GELU   # noqa: E402
from hpctrain.nn.layers import Layer   # noqa: E402
from hpctrain.nn.zoo import spec_for   # noqa: E402
from hpctrain.report.params import write_params   # noqa: E402

GPT = "gpt:layers=2,heads=2,width=32"
T = 32          # the GPT's context
INPUTS = 100    # the inputs each export is compared on
TOL = 1e-4


@pytest.fixture(scope="module")
def mnist():
    """The bundled sample's images and labels (uint8, 28x28)."""
    folder = data.bundled_sample_dir()
    return read_idx(f"{folder}/images-idx3-ubyte.gz", "images"), read_idx(f"{folder}/labels-idx1-ubyte.gz", "labels")


@pytest.fixture(scope="module")
def plays():
    """The bundled plays' first 20,000 characters as character ids, and the vocabulary's size."""
    with open(data.bundled_text_path(), encoding="utf-8") as f:
        text = f.read(20000)
    vocab = Chars.train(text)
    return vocab.encode(text), vocab.vocab_size


def saved_and_loaded(tmp_path, model, shape, classes, x, y, hidden=()):
    """The model as training leaves it: built, initialised, two SGD steps
    on (x, y), written by the --save writer and read back by the loader
    predict and evaluate use (checkpoints/trained.load)."""
    args = types.SimpleNamespace(model=model, hidden=list(hidden))
    spec = spec_for(args, shape, classes)
    net = spec.build(np)
    net.init(7)
    for _ in range(2):
        net.forward_backward(x, y)
        net.params -= 0.05 * net.grads
    plan = types.SimpleNamespace(mode="ring", world_size=1, model=model, hidden=list(hidden),
                                 data=types.SimpleNamespace(dir=str(tmp_path / "no-data")))
    pieces = [(name, tuple((0, n) for n in v.shape), v) for name, v in net.tensors() + net.state_tensors()]
    path = tmp_path / "params.h5"
    write_params(str(path), spec, pieces, plan, step=2)
    return trained.load(params=str(path))


def session(path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1   # the machine's cores are the suite's
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module", params=["mlp", "small_cnn", "resnet"])
def image_export(request, mnist, tmp_path_factory):
    images, labels = mnist
    tmp = tmp_path_factory.mktemp(request.param)
    x = images[:16].astype(np.float32) / 255
    model = saved_and_loaded(tmp, request.param, (28, 28), 10, x, labels[:16].astype(np.int64),
                             hidden=(32,) if request.param == "mlp" else ())
    # as a user types it: hpctrain export --params params.h5 --format onnx --to model.onnx
    assert export.main(["--params", str(tmp / "params.h5"), "--format", "onnx", "--to", str(tmp / "model.onnx")]) == 0
    return model, tmp / "model.onnx"


def test_an_image_models_onnx_logits_are_hpctrains(image_export, mnist):
    model, path = image_export
    images = mnist[0][-INPUTS:]   # the sample's last images: none of the training steps'
    want = model.logits(images)
    got = session(path).run(["logits"], {"images": images.astype(np.float32) / 255})[0]
    assert got.shape == want.shape == (INPUTS, 10)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    assert np.abs(want).max() > 0.1   # logits of some size: a model that gives zeros would agree with anything


@pytest.fixture(scope="module")
def gpt_export(plays, tmp_path_factory):
    ids, vocab = plays
    tmp = tmp_path_factory.mktemp("gpt")
    starts = np.arange(8) * 997
    x = np.stack([ids[s:s + T] for s in starts])
    y = np.stack([ids[s + 1:s + T + 1] for s in starts])
    model = saved_and_loaded(tmp, GPT, (T,), vocab, x, y)
    write_onnx(model, tmp / "gpt.onnx")
    return model, tmp / "gpt.onnx"


def windows(plays, count):
    ids, _ = plays
    starts = 10000 + np.arange(count) * 97   # past the training steps' windows
    return np.stack([ids[s:s + T] for s in starts]).astype(np.int64)


def test_the_gpts_onnx_logits_are_hpctrains_for_every_position(gpt_export, plays):
    model, path = gpt_export
    x = windows(plays, INPUTS)
    want = model.model.run.forward(x, False)
    got = session(path).run(["logits"], {"tokens": x})[0]
    assert got.shape == want.shape == (INPUTS, T, model.spec.classes)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


def test_a_prompt_shorter_than_the_context_gives_the_decoders_logits(gpt_export, plays):
    model, path = gpt_export
    x = windows(plays, 3)[:, :5]
    want = Decoder(model.model, batch=3).feed(x)
    np.testing.assert_allclose(session(path).run(["logits"], {"tokens": x})[0], want, rtol=0, atol=TOL)


def test_the_tied_head_reads_the_one_embedding_tensor(gpt_export):
    graph = onnx.load(str(gpt_export[1])).graph
    embedding = (gpt_export[0].spec.classes, 32)   # (vocabulary, width)
    assert [t.name for t in graph.initializer if tuple(t.dims) in (embedding, embedding[::-1])] == ["embedding/E"]


def test_a_later_opset_writes_the_same_logits(gpt_export, plays, tmp_path):
    model, _ = gpt_export
    write_onnx(model, tmp_path / "18.onnx", opset=18)
    assert onnx.load(str(tmp_path / "18.onnx")).opset_import[0].version == 18
    x = windows(plays, 2)
    np.testing.assert_allclose(session(tmp_path / "18.onnx").run(["logits"], {"tokens": x})[0],
                               model.model.run.forward(x, False), rtol=0, atol=TOL)


def test_the_layers_the_zoo_models_above_leave_out_are_hpctrains_too(tmp_path):
    """Average pooling (overlapping windows), a strided convolution without a
    bias on three channels, dropout at inference, batch norm of a flat input."""
    spec = ModelSpec([Channels(), Conv2d(4, 3, stride=2, padding=1, bias=False), AvgPool2d(3, stride=2), ReLU(),
                      Dropout(0.5), Flatten(), Dense(16), BatchNorm1d(), ReLU(), Dense(10)], (12, 12, 3), 10)
    net = spec.build(np)
    net.init(5)
    rng = np.random.default_rng(5)
    for name, view in net.state_tensors():   # running statistics away from their starting 0 and 1
        view[...] = rng.uniform(0.5, 2, view.shape) if name.endswith("var") else rng.normal(0, 0.3, view.shape)
    model = trained.Trained(net, spec, "layers.h5", 0, [str(i) for i in range(10)], None)
    write_onnx(model, tmp_path / "layers.onnx")
    x = rng.integers(0, 256, (10, 12, 12, 3)).astype(np.uint8)
    np.testing.assert_allclose(session(tmp_path / "layers.onnx").run(["logits"], {"images": x / np.float32(255)})[0],
                               model.logits(x), rtol=0, atol=TOL)


def test_gelus_tanh_form_is_written_as_gpt2s(tmp_path):
    """GPT-2's GELU (`act=gelu_tanh`): the graph's tanh form equals the
    formula and hpctrain's own forward."""
    spec = ModelSpec([Flatten(), GELU(approximate="tanh")], (4, 4), 16)
    model = trained.Trained(spec.build(np), spec, "tanh", 0, [str(i) for i in range(16)], None)
    write_onnx(model, tmp_path / "tanh.onnx")
    x = np.linspace(-6, 6, 3 * 16, dtype=np.float32).reshape(3, 4, 4)
    v = x.reshape(3, 16).astype(np.float64)
    want = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
    got = session(tmp_path / "tanh.onnx").run(["logits"], {"images": x})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got, model.logits(x), rtol=0, atol=1e-6)


class Square(Layer):
    """A user's layer the export has never heard of."""

    def forward(self, ctx, x, train):
        return x * x


class LeakyReLU(ReLU):
    """A user's ReLU with math of its own: exporting ReLU's would be wrong."""

    def forward(self, ctx, x, train):
        return np.where(x > 0, x, 0.01 * x)


@pytest.mark.parametrize("layer, said", [(Square, "user.h5: layer 2 (Square) is a Square, a layer the ONNX export does not "
                                                  "know (it writes "),
                                         (LeakyReLU, "user.h5: layer 2 (LeakyReLU) is a LeakyReLU, a subclass of ReLU with a "
                                                     "forward of its own")])
def test_a_layer_the_export_cannot_write_is_one_line_exit_2_and_no_file(layer, said, tmp_path):
    spec = ModelSpec([Flatten(), Dense(8), layer(), Dense(10)], (4, 4), 10)
    model = trained.Trained(spec.build(np), spec, "user.h5", 0, [str(i) for i in range(10)], None)
    with pytest.raises(HpctrainError) as e:
        write_onnx(model, tmp_path / "user.onnx")
    assert str(e.value).startswith(said) and "\n" not in str(e.value)
    assert e.value.exit_code == 2
    assert list(tmp_path.iterdir()) == []


def test_an_opset_before_layer_normalization_is_one_line(gpt_export, tmp_path):
    with pytest.raises(HpctrainError, match=r"^ONNX opset 16: the export writes opsets 17 to \d+"):
        write_onnx(gpt_export[0], tmp_path / "16.onnx", opset=16)
    assert list(tmp_path.iterdir()) == []


def test_a_model_past_what_one_onnx_file_holds_is_one_line_before_anything_is_built(tmp_path):
    spec = ModelSpec([Flatten(), Dense(2 ** 20)], (2 ** 9,), 2 ** 20)   # 2 GiB of float32: laid out, not built
    model = trained.Trained(None, spec, "big.h5", 0, [], None)
    with pytest.raises(HpctrainError, match=r"^big\.h5: 2\.0 GiB of parameters, more than one ONNX file holds"):
        write_onnx(model, tmp_path / "big.onnx")
    assert list(tmp_path.iterdir()) == []


def test_the_export_command_writes_onnx_in_float32_only(gpt_export, tmp_path, capsys):
    model, _ = gpt_export
    assert export.main(["--params", model.source, "--format", "onnx", "--dtype", "bf16",
                        "--to", str(tmp_path / "g.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "float32" in err[0], err
    assert not (tmp_path / "g.onnx").exists()


def test_a_path_that_takes_no_file_is_one_line(tmp_path):
    spec = ModelSpec([Flatten(), Dense(10)], (4, 4), 10)
    model = trained.Trained(spec.build(np), spec, "p.h5", 0, [str(i) for i in range(10)], None)
    with pytest.raises(HpctrainError, match=r"/no/such/folder/p\.onnx: cannot write the ONNX file \(No such file"):
        write_onnx(model, tmp_path / "no/such/folder/p.onnx")
