"""The one check made wherever a model meets data (hpctrain/data/fit.py):
a language model's vocabulary compared whole with the data's (two
vocabularies of one size are told apart: chars against chars, bytes against
bpe:256), a file without a recorded vocabulary held to its size, and a
model meeting the other kind of data (an image model on text, a language
model on images) refused in plain words. No jobs here: the commands that
make the check are run in tests/test_generate.py and tests/test_predict.py.

    .venv/bin/python -m pytest -q tests/test_model_fit.py
"""
import numpy as np
import pytest

from hpctrain import data
from hpctrain.data.fit import check_fit, check_kind
from hpctrain.data.vocab import describe, load_vocabulary
from hpctrain.base.errors import HpctrainError
from hpctrain.flags.model_names import input_kind_of

TEXT = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind to suffer\n" * 30


def quiet(*args, **kwargs):
    return None


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """{name: directory}: the text as chars, bytes and bpe:256; the same text
    with 'q' made '#', chars of the same size and another vocabulary; a few
    images."""
    root = tmp_path_factory.mktemp("fit")
    (root / "a.txt").write_text(TEXT, encoding="utf-8")
    (root / "b.txt").write_text(TEXT.replace("q", "#"), encoding="utf-8")
    out = {}
    for name, source, text in (("chars", "a", "chars"), ("other", "b", "chars"), ("bytes", "a", "bytes"),
                               ("bpe", "a", "bpe:256")):
        out[name] = root / name
        data.prepare_text(str(root / f"{source}.txt"), str(out[name]), text, log=quiet)
    rng = np.random.default_rng(0)
    np.savez(root / "images.npz", x=rng.integers(0, 256, (40, 6, 6), np.uint8), y=np.arange(40) % 4)
    out["images"] = root / "images"
    data.prepare(str(root / "images.npz"), str(out["images"]), log=quiet)
    return out


def entry(directory):
    """What a model trained on directory records of its vocabulary."""
    return load_vocabulary(directory).record_entry()


def test_a_vocabulary_is_compared_whole_not_by_its_size(prepared):
    sizes = {name: load_vocabulary(prepared[name]).vocab_size for name in ("chars", "other", "bytes", "bpe")}
    assert sizes["chars"] == sizes["other"] and sizes["bytes"] == sizes["bpe"] == 256
    for model, data_name in (("chars", "other"), ("other", "chars"), ("bytes", "bpe"), ("bpe", "bytes")):
        with pytest.raises(HpctrainError) as e:
            check_fit("model m.h5", "tokens", prepared[data_name], classes=sizes[model],
                      text=entry(prepared[model]))
        mine, have = (describe(load_vocabulary(prepared[n])) for n in (model, data_name))
        assert mine != have and str(e.value) == (
            f"model m.h5 was trained on vocabulary {mine} but data {prepared[data_name]} holds {have}: "
            f"another model's file, or other data")
    # its own data passes (a BPE rebuilt from its record is the data's tokenizer.json)
    for name in ("chars", "bytes", "bpe"):
        manifest = check_fit("model m.h5", "tokens", prepared[name], classes=sizes[name], text=entry(prepared[name]))
        assert manifest == data.load_manifest(prepared[name])
    assert describe(load_vocabulary(prepared["chars"])).startswith(f"chars:{sizes['chars']} (digest ")


def test_a_file_that_records_no_vocabulary_is_held_to_its_size(prepared):
    check_fit("model old.h5", "tokens", prepared["other"], classes=load_vocabulary(prepared["chars"]).vocab_size)
    with pytest.raises(HpctrainError, match=r"^model old.h5 reads 256 token ids \(it records no vocabulary: saved "
                                            r"by an older hpctrain\) but data .* holds chars:"):
        check_fit("model old.h5", "tokens", prepared["chars"], classes=256)
    with pytest.raises(HpctrainError, match="its record's vocabulary has 256: a damaged file"):
        check_fit("model m.h5", "tokens", prepared["bytes"], classes=100, text={"kind": "bytes"})


def test_a_model_meeting_the_other_kind_of_data_is_one_line_both_ways(prepared):
    with pytest.raises(HpctrainError) as e:
        check_fit("model gpt.h5", "tokens", prepared["images"], classes=256, text={"kind": "bytes"})
    assert str(e.value) == (f"model gpt.h5 is a language model and data {prepared['images']} holds images: a "
                            f"language model cannot read images")
    with pytest.raises(HpctrainError) as e:
        check_fit("model mlp.h5", "image", prepared["chars"], classes=4)
    assert str(e.value) == (f"model mlp.h5 is an image model and data {prepared['chars']} holds text: an image "
                            f"model cannot read text")
    assert check_fit("model mlp.h5", "image", prepared["images"], classes=4)["num_classes"] == 4
    # training's words, before anything is built from the data's shapes (run/startup.py)
    assert [input_kind_of(m) for m in ("lenet", "mlp", "gpt:layers=1,heads=1,width=8", "m.py:build")] == \
        ["image", "image", "tokens", None]
    with pytest.raises(HpctrainError, match=r"^--model lenet is an image model and --data d holds text: an image "
                                            r"model cannot train on text; for text, a language model is --model "
                                            r"gpt:"):
        check_kind("--model lenet", "image", "tokens", "--data d", verb="train on")
    with pytest.raises(HpctrainError, match=r"a language model cannot train on images; a language model trains on "
                                            r"text prepared with `hpctrain data prepare --text`"):
        check_kind("--model gpt:layers=1,heads=1,width=8", "tokens", "image", "--data d", verb="train on")
