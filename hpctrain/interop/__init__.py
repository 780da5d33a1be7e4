"""Models in and out of hpctrain (issue 56): safetensors files
(interop/safetensors.py), Hugging Face GPT-2 folders (interop/gpt2.py: the
names, the config, the tokenizer beside them), ONNX graphs of the zoo's
models and the GPT (interop/onnx_export.py), what `hpctrain train
--init-from`, `generate` and `evaluate` read a pretrained model from
(interop/pretrained.py) and the `hpctrain export` command
(interop/export.py). Built on whole named tensors (the model's spec and
state/ parts), never on a layout.

    hpctrain export --params gpt.h5 --format hf --to gpt-hf/
    hpctrain export --params gpt.h5 --format onnx --to gpt.onnx
    hpctrain train --init-from gpt-hf/ --data data/shakespeare-chars --steps 100
    python -m pytest -q tests/test_safetensors.py tests/test_interop_hf.py tests/test_onnx_export.py
"""
