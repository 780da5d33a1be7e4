"""Models in and out of hpctrain: a trained model written in the formats the
world's serving tools read (ONNX: onnx_export.py), built on the model's
named tensors, never on a layout of them.

    python -c "from hpctrain.checkpoints import trained; from hpctrain.interop.onnx_export import write_onnx; write_onnx(trained.load(params='p.h5'), 'p.onnx')"
"""
