"""A trained model as an ONNX graph (opset 17 or later), for ONNX Runtime and
the tools that serve ONNX: `write_onnx(model, path)`, `model` what
checkpoints/trained.load returns (a --save file's or a checkpoint's model).

    python -c "from hpctrain.checkpoints import trained; from hpctrain.interop.onnx_export import write_onnx; write_onnx(trained.load(params='p.h5'), 'p.onnx')"
    python -c "import onnxruntime as ort, numpy as np; s = ort.InferenceSession('p.onnx'); print(s.run(None, {'images': np.zeros((1, 28, 28), np.float32)})[0])"

What the graph takes and gives (docs/models.md, "ONNX"):
- an image model: `images`, float32 (batch, *the model's input shape), the
  pixels as hpctrain feeds them: uint8 / 255, in [0, 1], no mean taken
  off, (h, w) for one channel, (h, w, c) channels last, at the size
  prepare made them (Trained.logits does the same); out `logits`
  (batch, classes), before the softmax;
- a GPT: `tokens`, int64 ids (batch, positions), any batch and up to the
  model's context length in positions (a prompt shorter than it: the first
  rows of the position table, as hpctrain's decoder does); out `logits`
  (batch, positions, vocabulary).

Each layer becomes the ONNX operators of its inference forward: Linear as
MatMul (+ Add), Conv2d as Conv, the pools as MaxPool, AveragePool and
GlobalAveragePool, batch norm as BatchNormalization with its running
statistics, ReLU, Dropout as nothing, Flatten, Residual's two paths added;
the GPT's Embedding as Gather, its position table added, LayerNormalization,
causal self-attention (MatMul, scaled, the causal mask added, Softmax),
GELU exact through Erf (or the tanh form, where the layer says
`approximate = "tanh"`) and the head tied to the embedding as a MatMul with
E transposed (one tensor in the file, as in the model). The initializers
are the model's tensors by their --save names (`layer0/W`, ...; a
convolution's kernel reordered to ONNX's out x in x k x k), float32.

Why one module that dispatches by layer class (isinstance through the
class's bases, the most specific class first), not a method on each layer:
the layers' own files hold their math on NumPy and CuPy for training and
nothing of a file format (nn/ does not know onnx exists, as it does not know
MPI); ONNX's layout (NCHW around Conv and the pools, the transposes between,
opset rules, initializer names) is one idea and lives here whole. A user's
subclass of a known layer exports as that layer while its forward is the
layer's own; one whose forward is its own, or a layer this module does not
know, is one line naming it (exit 2), never a graph of other math.

Activations stay NHWC where hpctrain keeps them and turn NCHW only for the
operators that need it; a value remembers which it is, so a run of
convolutions and pools is transposed once in and once out (before Flatten,
whose order is NHWC's, as the dense layer after it was trained on).
"""
import json
import math
from typing import NamedTuple

import numpy as np

from ..base.errors import HpctrainError
from ..base.files import one_line, printable, write_atomically
from ..nn.attention import CausalSelfAttention
from ..nn.batchnorm import EPS as BN_EPS, BatchNorm1d, BatchNorm2d
from ..nn.conv import Channels, Conv2d
from ..nn.embedding import Embedding
from ..nn.gelu import GELU
from ..nn.layers import Dropout, Flatten, ReLU, describe
from ..nn.linear import Linear
from ..nn.norm import LayerNorm
from ..nn.pool import AvgPool2d, GlobalAvgPool, MaxPool2d
from ..nn.residual import Residual
from ..nn.transformer import Block, PositionEmbedding

OPSET = 17   # LayerNormalization's first opset
# A model file is one protobuf message, which cannot pass 2 GiB: the tensors
# and the graph around them (its causal mask: 4 MB at 1024 positions) must fit
# below it (a GPT-2 of 124M parameters is 0.5 GB).
MAX_BYTES = 2 ** 31 - 2 ** 26


class Value(NamedTuple):
    """An activation of the graph: its name, and whether it is an image
    turned NCHW (ONNX's Conv layout) rather than hpctrain's NHWC."""
    name: str
    nchw: bool = False


class _Graph:
    """The graph being built: nodes, initializers (the model's tensors
    under their names, once each), fresh names for the rest."""

    def __init__(self, onnx, source):
        self.onnx, self.helper, self.source = onnx, onnx.helper, source   # source: the graph's input
        self.nodes, self.initializers = [], []
        self._held, self._count = set(), 0   # the initializers' names
        self._positions = None   # the input's positions, a (1,) int64 tensor (a GPT's: positions)
        self._masks = {}         # causal masks by size, made once and shared by the blocks

    @property
    def positions(self):
        """The input's positions (its axis 1), a (1,) int64 tensor, made at first use."""
        if self._positions is None:
            self._positions = self.op("Shape", [self.source], start=1, end=2)
        return self._positions

    def first_rows(self, table, axes):
        """table's first `positions` entries along each of `axes` (a prompt
        shorter than the context reads the first rows, as the decoder does)."""
        ends = self.positions if len(axes) == 1 else self.op("Concat", [self.positions] * len(axes), axis=0)
        return self.op("Slice", [table, self.const("zeros", [0] * len(axes), np.int64), ends,
                                 self.const("axes", list(axes), np.int64)])

    def causal_mask(self, size):
        """(t, t) of a (size, size) mask, 0 on and below the diagonal, -inf
        above (nn/attention.py's), t the input's positions; one for every block."""
        if size not in self._masks:
            above = np.triu(np.ones((size, size), bool), 1)
            self._masks[size] = self.first_rows(self.const("causal_mask", np.where(above, -np.inf, 0)), (0, 1))
        return self._masks[size]

    def fresh(self, base):
        self._count += 1
        return f"{base}_{self._count}"   # never a tensor of the model's: theirs hold a '/' ('layer0/W')

    def tensor(self, name, array):
        """The initializer `name` holding array (added once: a tensor read by
        two layers, the tied embedding, is one tensor of the file)."""
        if name not in self._held:
            array = np.asarray(array, np.int64 if array.dtype.kind in "iu" else np.float32, order="C")
            self.initializers.append(self.onnx.numpy_helper.from_array(array, name))
            self._held.add(name)
        return name

    def const(self, base, values, dtype=np.float32):
        return self.tensor(self.fresh(base), np.asarray(values, dtype))

    def op(self, op_type, inputs, out=None, **attrs):
        """One node; its output's name (a fresh one unless `out` is given)."""
        out = out or self.fresh(op_type.lower())
        # named as its output: a runtime's error names the node
        self.nodes.append(self.helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out


class _Tensors:
    """One layer's tensors (parameters and state) as graph initializers:
    values by the layer's own names, each named in the graph by its full
    --save name; `inner(prefix)`: a container's inner layer's; `ties`: a
    tied name -> (the owner's full name, its value, transposed)."""

    def __init__(self, values, names, ties=None):
        self.values, self.names, self.ties = values, names, ties or {}

    def inner(self, prefix):
        def mine(d):
            return {k[len(prefix) + 1:]: v for k, v in d.items() if k.split(".", 1)[0] == prefix}
        return _Tensors(mine(self.values), mine(self.names))

    def get(self, g, name, reorder=None):
        """The initializer of tensor `name` (reorder(values): the form ONNX's
        operator wants, under the same name); a tied one read through a
        Transpose where the tie says so."""
        if name in self.ties:
            full, value, transposed = self.ties[name]
            owner = g.tensor(full, value)
            return g.op("Transpose", [owner], perm=[1, 0]) if transposed else owner
        value = self.values[name]
        return g.tensor(self.names[name], value if reorder is None else reorder(value))


# --- layouts --------------------------------------------------------------------
def _nchw(g, x):
    return x if x.nchw else Value(g.op("Transpose", [x.name], perm=[0, 3, 1, 2]), True)


def _nhwc(g, x):
    return Value(g.op("Transpose", [x.name], perm=[0, 2, 3, 1])) if x.nchw else x


# --- the layers -------------------------------------------------------------------
def _channels(g, layer, x, t, where):
    if len(layer.in_shape) == 3:
        return x
    return Value(g.op("Unsqueeze", [x.name, g.const("channel_axis", [-1], np.int64)]))


def _flatten(g, layer, x, t, where):
    return Value(g.op("Flatten", [_nhwc(g, x).name], axis=1))


def _relu(g, layer, x, t, where):
    return Value(g.op("Relu", [x.name]), x.nchw)


def _dropout(g, layer, x, t, where):
    return x   # inference: the identity


def _linear(g, layer, x, t, where):
    y = g.op("MatMul", [_nhwc(g, x).name, t.get(g, "W")])
    return Value(g.op("Add", [y, t.get(g, "b")]) if layer.bias else y)


def _conv(g, layer, x, t, where):
    # hpctrain's kernel is (k, k, in, out); ONNX's (out, in, k, k)
    inputs = [_nchw(g, x).name, t.get(g, "W", lambda w: w.transpose(3, 2, 0, 1))]
    if layer.bias:
        inputs.append(t.get(g, "b"))
    return Value(g.op("Conv", inputs, kernel_shape=[layer.k] * 2, strides=[layer.stride] * 2,
                      pads=[layer.pad] * 4), True)


def _max_pool(g, layer, x, t, where):
    return Value(g.op("MaxPool", [_nchw(g, x).name], kernel_shape=[layer.k] * 2, strides=[layer.stride] * 2), True)


def _avg_pool(g, layer, x, t, where):
    return Value(g.op("AveragePool", [_nchw(g, x).name], kernel_shape=[layer.k] * 2, strides=[layer.stride] * 2),
                 True)


def _global_pool(g, layer, x, t, where):
    return Value(g.op("Flatten", [g.op("GlobalAveragePool", [_nchw(g, x).name])], axis=1))


def _batch_norm(g, layer, x, t, where):
    # evaluation's form: the running statistics, (x - mean) / sqrt(var + eps) * gamma + beta, per
    # channel: ONNX's channel axis is 1, an NCHW image's or a flat input's
    x = _nchw(g, x) if isinstance(layer, BatchNorm2d) else x
    inputs = [x.name] + [t.get(g, name) for name in ("gamma", "beta", "running_mean", "running_var")]
    return Value(g.op("BatchNormalization", inputs, epsilon=BN_EPS), x.nchw)


def _gelu(g, layer, x, t, where):
    """x Phi(x): 0.5 x (1 + erf(x / sqrt 2)), or GPT-2's tanh form
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    form = getattr(layer, "approximate", "none")
    if form == "none":
        inner = g.op("Erf", [g.op("Mul", [x.name, g.const("inv_sqrt2", 1 / math.sqrt(2))])])
    elif form == "tanh":
        cube = g.op("Mul", [g.op("Mul", [x.name, x.name]), x.name])
        arg = g.op("Add", [x.name, g.op("Mul", [cube, g.const("gelu_c", 0.044715)])])
        inner = g.op("Tanh", [g.op("Mul", [arg, g.const("sqrt_2_over_pi", math.sqrt(2 / math.pi))])])
    else:
        raise HpctrainError(f"{where} ({describe(layer)}): GELU approximate={printable(form)!r}, neither 'none' "
                            f"nor 'tanh': the ONNX export writes those two")
    half = g.op("Mul", [x.name, g.const("half", 0.5)])
    return Value(g.op("Mul", [half, g.op("Add", [inner, g.const("one", 1.0)])]), x.nchw)


def _layer_norm(g, layer, x, t, where):
    return Value(g.op("LayerNormalization", [x.name, t.get(g, "gamma"), t.get(g, "beta")], axis=-1,
                      epsilon=layer.eps))


def _embedding(g, layer, x, t, where):
    return Value(g.op("Gather", [t.get(g, "E"), x.name], axis=0))


def _position(g, layer, x, t, where):
    return Value(g.op("Add", [x.name, g.first_rows(t.get(g, "P"), (0,))]))


def _attention(g, layer, x, t, where):
    """nanoGPT's attention as nn/attention.py computes it: the fused q, k, v
    projection, per head softmax(q k^T / sqrt(head width) + mask) v, the
    heads side by side, the output projection (its dropout: none at inference)."""
    h, hw, e = layer.heads, layer.head_width, layer.width
    qkv = g.op("Add", [g.op("MatMul", [x.name, t.get(g, "Wqkv")]), t.get(g, "bqkv")])
    # (n, t, 3E) -> (n, t, 3, heads, head width) -> (3, n, heads, t, head width); 0 keeps a dimension
    split = g.op("Transpose", [g.op("Reshape", [qkv, g.const("qkv_shape", [0, 0, 3, h, hw], np.int64)])],
                 perm=[2, 0, 3, 1, 4])
    q, k, v = (g.op("Gather", [split, g.const("part", j, np.int64)], axis=0) for j in range(3))
    scores = g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])])
    scores = g.op("Add", [g.op("Mul", [scores, g.const("scale", 1 / math.sqrt(hw))]), g.causal_mask(layer.T)])
    heads = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
    merged = g.op("Reshape", [g.op("Transpose", [heads], perm=[0, 2, 1, 3]), g.const("merged", [0, 0, e], np.int64)])
    return Value(g.op("Add", [g.op("MatMul", [merged, t.get(g, "Wo")]), t.get(g, "bo")]))


def _path(g, container, layers, x, t, where):
    """A container's inner layer list run on x, each with its own tensors (by its prefix)."""
    prefix = {id(layer): p for p, layer in container.inner}
    for layer in layers:
        x = _emit(g, layer, x, t.inner(prefix[id(layer)]), f"{where}.{prefix[id(layer)]}")
    return x


def _residual(g, layer, x, t, where):
    a = _path(g, layer, layer.block, x, t, where)
    skip = _path(g, layer, layer.projection, x, t, where)
    skip = _nchw(g, skip) if a.nchw else _nhwc(g, skip)
    return Value(g.op("Add", [a.name, skip.name]), a.nchw)


def _block(g, layer, x, t, where):
    h = Value(g.op("Add", [x.name, _path(g, layer, layer.attn_path, x, t, where).name]))
    return Value(g.op("Add", [h.name, _path(g, layer, layer.mlp_path, h, t, where).name]))


# Each layer class the export knows and the function that writes its
# inference forward. A subclass is found through its bases, the most
# specific first (Dense is a Linear).
EMIT = {Channels: _channels, Flatten: _flatten, ReLU: _relu, Dropout: _dropout, Linear: _linear, Conv2d: _conv,
        MaxPool2d: _max_pool, AvgPool2d: _avg_pool, GlobalAvgPool: _global_pool, BatchNorm1d: _batch_norm,
        BatchNorm2d: _batch_norm, GELU: _gelu, LayerNorm: _layer_norm, Embedding: _embedding,
        PositionEmbedding: _position, CausalSelfAttention: _attention, Residual: _residual, Block: _block}


def _emit(g, layer, x, t, where):
    for known in type(layer).__mro__:
        if known in EMIT:
            if type(layer).forward is not known.forward:   # its own math: exporting the base's would lie
                raise HpctrainError(f"{where} ({describe(layer)}) is a {type(layer).__name__}, a subclass of "
                                    f"{known.__name__} with a forward of its own: the ONNX export cannot write it")
            return EMIT[known](g, layer, x, t, where)
    raise HpctrainError(f"{where} ({describe(layer)}) is a {type(layer).__name__}, a layer the ONNX export does not "
                        f"know (it writes {', '.join(sorted(k.__name__ for k in EMIT))})")


# --- the model ----------------------------------------------------------------------
def _layer_tensors(spec, net, i):
    """Layer i's tensors (parameters and state) for the graph, its tied ones included."""
    entries = spec.layer_tensors[i] + spec.layer_state[i]
    values = {**spec.views(net.params, i), **spec.views(net.state, i, of="state")}
    names = {full.split("/", 1)[1]: full for full, _, _, _ in entries}
    ties = {}
    for tie in spec.ties:
        if tie.user == i:
            full = next(n for n, _, lo, _ in spec.layer_tensors[tie.owner] if lo == tie.lo)
            ties[tie.name] = (full, net.params[tie.lo:tie.hi].reshape(tie.shape), tie.transposed)
    return _Tensors(values, names, ties)


def to_onnx(model, opset=OPSET):
    """The ONNX ModelProto of a trained model (checkpoints/trained.Trained),
    unchecked; one line (HpctrainError) for a layer it cannot write."""
    onnx = _onnx()
    spec, net = model.spec, model.model
    size = 4 * (spec.num_params + spec.num_state)   # float32, before any is copied into the graph
    if size > MAX_BYTES:
        raise HpctrainError(f"{model.source}: {size / 2**30:.1f} GiB of parameters, more than one ONNX file "
                            f"holds (2 GiB, protobuf's limit); export --format safetensors instead")
    proto_type = onnx.TensorProto
    tokens = spec.input_kind == "tokens"
    if tokens:
        name, dims, elem = "tokens", ["batch", "positions"], proto_type.INT64
    else:
        name, dims, elem = "images", ["batch", *spec.input_shape], proto_type.FLOAT
    g = _Graph(onnx, name)
    x = Value(name)
    for i, layer in enumerate(spec.layers):
        x = _emit(g, layer, x, _layer_tensors(spec, net, i), f"{model.source}: layer {i}")
    g.op("Identity", [_nhwc(g, x).name], out="logits")
    out_dims = ["batch", "positions", *spec.shapes[-1][1:]] if tokens else ["batch", *spec.shapes[-1]]
    graph = g.helper.make_graph(g.nodes, spec.name, [g.helper.make_tensor_value_info(name, elem, dims)],
                                [g.helper.make_tensor_value_info("logits", proto_type.FLOAT, out_dims)],
                                g.initializers, doc_string=_input_doc(model, tokens))
    opsets = [g.helper.make_opsetid("", opset)]
    proto = g.helper.make_model(graph, opset_imports=opsets, producer_name="hpctrain",
                                ir_version=g.helper.find_min_ir_version_for(opsets))
    props = {"hpctrain.identity": spec.identity, "hpctrain.step": str(model.step)}
    if not tokens:
        props["hpctrain.class_names"] = json.dumps(model.class_names)
    g.helper.set_model_props(proto, props)
    return proto


def _input_doc(model, tokens):
    if tokens:
        return (f"tokens: int64 ids (batch, positions <= {model.spec.input_shape[0]}) of the model's vocabulary; "
                f"logits: (batch, positions, {model.spec.classes}), before the softmax")
    shape = "x".join(map(str, model.spec.input_shape))
    return (f"images: float32 (batch, {shape}), pixels / 255 in [0, 1], channels last, as hpctrain feeds them; "
            f"logits: (batch, {model.spec.classes}), before the softmax")


def _onnx():
    try:
        import onnx
    except ImportError:
        raise HpctrainError("the ONNX export needs the onnx package: pip install 'hpctrain[interop]'") from None
    return onnx


def write_onnx(model, path, opset=OPSET):
    """The trained model `model` (checkpoints/trained.load's) as an ONNX file
    at path: checked by onnx.checker (shapes inferred through the graph),
    written whole or not at all. One line (HpctrainError, exit 2) for a
    layer the export cannot write, an opset it does not write to, a model
    too large for one file, or a path that takes no file."""
    onnx = _onnx()
    newest = onnx.defs.onnx_opset_version()
    if not isinstance(opset, int) or not OPSET <= opset <= newest:
        raise HpctrainError(f"ONNX opset {printable(opset)}: the export writes opsets {OPSET} to {newest} "
                            f"(LayerNormalization needs {OPSET}; this onnx package knows up to {newest})")
    proto = to_onnx(model, opset)
    onnx.checker.check_model(proto, full_check=True)
    data = proto.SerializeToString()
    try:
        write_atomically(str(path), lambda f: f.write(data), binary=True)
    except OSError as e:
        raise HpctrainError(f"{path}: cannot write the ONNX file ({one_line(e)})") from None
