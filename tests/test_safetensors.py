"""safetensors files (hpctrain/interop/safetensors.py) held to the
`safetensors` library's own reader and writer: what hpctrain writes (f32,
fp16, bf16, the metadata) the library reads back, what the library writes
hpctrain reads, whole or a box at a time; a damaged file or a bf16 file
without ml_dtypes is one line.

    .venv/bin/python -m pytest -q tests/test_safetensors.py
"""
import struct
import sys

import numpy as np
import pytest

from hpctrain.base.errors import HpctrainError
from hpctrain.interop import safetensors as st

torch = pytest.importorskip("torch")
library = pytest.importorskip("safetensors.torch")


def arrays():
    rng = np.random.default_rng(0)
    return [("layer0/E", rng.standard_normal((7, 5)).astype(np.float32)),
            ("layer2/attn.bqkv", rng.standard_normal(12).astype(np.float32)),
            ("scalar", np.array(3.5, np.float32))]


@pytest.mark.parametrize("dtype, torch_dtype, tol", [("fp32", "float32", 0), ("fp16", "float16", 1e-3),
                                                     ("bf16", "bfloat16", 1e-2)])
def test_what_hpctrain_writes_the_library_reads(tmp_path, dtype, torch_dtype, tol):
    path = tmp_path / "m.safetensors"
    st.write(path, arrays(), {"inference": '{"model": "x"}'}, dtype)
    theirs = library.load_file(str(path))
    for name, values in arrays():
        assert theirs[name].dtype == getattr(torch, torch_dtype)
        np.testing.assert_allclose(theirs[name].float().numpy(), values, rtol=tol, atol=0)
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"inference": '{"model": "x"}'}
    assert not [p for p in tmp_path.iterdir() if p.name != "m.safetensors"]   # no temporary left


@pytest.mark.parametrize("torch_dtype", ["float32", "float16", "bfloat16"])
def test_what_the_library_writes_hpctrain_reads_whole_and_by_boxes(tmp_path, torch_dtype):
    path = tmp_path / "lib.safetensors"
    tensors = {name: torch.from_numpy(values).to(getattr(torch, torch_dtype)) for name, values in arrays()}
    library.save_file(tensors, str(path), metadata={"format": "pt"})
    with st.SafeTensors(path) as f:
        assert sorted(f.names) == sorted(tensors) and f.metadata == {"format": "pt"}
        for name, t in tensors.items():
            want = t.float().numpy()
            got = f.read(name)
            assert got.dtype == np.float32 and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
        box = ((2, 5), (1, 4))   # a tensor-parallel rank's columns of a ZeRO shard's rows
        np.testing.assert_array_equal(f.read("layer0/E", box), tensors["layer0/E"].float().numpy()[2:5, 1:4])


def test_a_damaged_file_is_one_line(tmp_path):
    good = tmp_path / "good.safetensors"
    st.write(good, arrays())
    raw = good.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    cases = {"short": raw[:5], "huge": struct.pack("<Q", 1 << 40) + raw[8:], "json": raw[:8] + b"{" * n + raw[8 + n:],
             "cut": raw[:-8]}
    for name, content in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        with pytest.raises(HpctrainError, match=r"not a safetensors file \(") as e:
            st.SafeTensors(path)
        assert "\n" not in str(e.value)


def test_bf16_without_ml_dtypes_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "bf16.safetensors"
    st.write(path, arrays(), dtype="bf16")
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)   # import ml_dtypes now raises ImportError
    with st.SafeTensors(path) as f, pytest.raises(HpctrainError, match="bfloat16 tensors need ml_dtypes: pip install"):
        f.read("layer0/E")
    with pytest.raises(HpctrainError, match="--dtype bf16: bfloat16 tensors need ml_dtypes"):
        st.write(tmp_path / "again.safetensors", arrays(), dtype="bf16")
