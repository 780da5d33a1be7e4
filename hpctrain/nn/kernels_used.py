"""Which of a model's layers run nn/compiled.py's kernels on the CPU, as
the start-up line says it (`layers: compiled (...)` or `layers: NumPy`):
the kernels the model's layers declare (`kernel`, nn/layers.py), looked
for inside containers too (a Residual's block, a transformer Block's
attention, LayerNorms and GELU).

    python -c "from hpctrain.nn import compiled, resnet; from hpctrain.nn.kernels_used import layers_line; compiled.use(True); print(layers_line(resnet((32, 32, 3), 10)))"
"""
from ..base import vector_width
from . import compiled


def layers_line(spec):
    """The start-up line saying how the layers of a CPU run compute: the
    compiled kernels this model's layers run (nn/compiled.py), none it has
    no layer for; or NumPy's (im2col, where it has convolutions)."""
    kinds = set(_layer_kinds(spec.layers))
    if compiled.on():
        used = [text for kind, text in _COMPILED if kind in kinds]
        if used:
            return ("layers: compiled (nn/compiled.py: " + ", ".join(used)
                    + ("; 512-bit vectors" if vector_width.wide() else "") + ")")
    if "conv" in kinds or "direct conv" in kinds:
        return "layers: NumPy (convolutions by im2col)"
    return "layers: NumPy" + (" (no layer of this model has a compiled kernel)" if compiled.on() else "")


# nn/compiled.py's kernels, by the name a layer declares as its `kernel` (_layer_kinds)
_COMPILED = (("direct conv", "direct convolutions with 16, 32 or 64 output channels"),
             ("batch norm", "batch norm"), ("max pool", "max pooling"), ("relu", "ReLU"),
             ("attention", "attention's causal softmax"), ("layer norm", "LayerNorm"), ("gelu", "GELU"))


def _layer_kinds(layers):
    """The kernels (a layer's `kernel` declaration, nn/layers.py: "conv" for
    a convolution that runs im2col with compiled layers on) of `layers` and
    of the layers inside them (a Residual's, a transformer Block's)."""
    for layer in layers:
        if layer.kernel is not None:
            yield layer.kernel
        yield from _layer_kinds(inner for _, inner in getattr(layer, "inner", ()))
