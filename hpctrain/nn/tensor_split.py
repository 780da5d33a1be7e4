"""Which layers of a model split over a tensor group (--tensor-parallel,
nn/tensor_parallel.py): the spec's copy of each layer built with a role
joins the group before the spec configures it; in a model built without
roles (a user's MLP) Linear layers pair up, column then row, where only
`elementwise` layers (ReLU, GELU, a user's subclass of either) lie between.

    python -c "from hpctrain.nn import mlp; print([l.role for l in mlp().layers])"
"""
from .embedding import Embedding
from .layer_errors import LayerError
from .linear import Linear
from .losses import TokenCrossEntropy
from .norm import LayerNorm
from .layers import Dropout
from .transformer import Block, PositionEmbedding

# What may lie between a language model's embedding and its head under
# --sequence-parallel: layers that work on each position alone (or a Block,
# which gathers every position where its attention needs them).
ON_POSITIONS = (PositionEmbedding, Dropout, Block, LayerNorm)


def split_model(layers, loss, group):
    """Join the layers (and the loss) that split to `group`, before they are
    configured; returns the indices of the split layers. A model with
    nothing to split is refused in one line (T ranks would each compute
    the whole model)."""
    split, pending = [], None   # pending: an undeclared Linear waiting for its row-parallel partner
    column = None               # a column layer's index, until its row layer
    for i, layer in enumerate(layers):
        if layer.role is not None:   # declared where it was built
            if column is not None and layer.role != "row":
                break   # refused below
            split.append(i)
            if layer.role == "row" and column is None:
                raise LayerError(f"layer {i} ({layer.describe()}) is row-parallel without a column-parallel layer "
                                 f"before it (only elementwise layers between them)")
            layer.join(group)
            column = i if layer.role == "column" else None
            pending = None
        elif column is not None and not layer.elementwise:
            break   # refused below: a column layer's slice would reach a layer that takes whole inputs
        elif isinstance(layer, Linear) and not layer.ties:
            if pending is None:
                pending = i
            else:   # a plain MLP's pair
                layers[pending].join(group, "column")
                layer.join(group, "row")
                split += [pending, i]
                pending = None
        elif not layer.elementwise:
            pending = None
    if column is not None:
        raise LayerError(f"layer {column} ({layers[column].describe()}) is column-parallel without a row-parallel "
                         f"layer after it (only elementwise layers between them)")
    heads = [i for i in split if isinstance(layers[i], Linear) and layers[i].role == "vocab"]
    if heads:
        if heads != [len(layers) - 1] or not isinstance(loss, TokenCrossEntropy):
            raise LayerError("the vocabulary splits over the tensor group, but the head tied to the embedding is not "
                             "the last layer before a per-token cross-entropy, which would need the whole logits")
        loss.join(group)
    if any(isinstance(layers[i], Embedding) for i in split) and not heads:
        raise LayerError("the embedding's vocabulary splits over the tensor group only with the output head tied "
                         "to it (transposed) and a per-token cross-entropy after it")
    if group.sequence:
        _sequence_parallel(layers, split, group)
    if not split:
        raise LayerError("it has no layer that splits over a tensor group (a transformer Block, Dense or Linear "
                         "layers in pairs with only ReLU or GELU between them, a tied embedding and head)")
    return sorted(split)


def _sequence_parallel(layers, split, group):
    """--sequence-parallel: between the embedding and its tied head every
    layer takes this rank's positions (Megatron-LM's sequence parallelism:
    the norms, dropouts and residual sums on 1/T of the positions, the
    allreduces become a reduce-scatter and an allgather); LayerError where
    the model is not such a language model."""
    if not (split and isinstance(layers[0], Embedding) and split[-1] == len(layers) - 1 and
            layers[-1].role == "vocab"):
        raise LayerError("--sequence-parallel cuts a language model's positions: it needs the embedding first and "
                         "the head tied to it last (a GPT)")
    for i, layer in enumerate(layers[1:-1], 1):
        if not isinstance(layer, ON_POSITIONS):
            raise LayerError(f"--sequence-parallel: layer {i} ({layer.describe()}) between the embedding and the head "
                             f"is not one that works on a slice of the positions ("
                             f"{', '.join(k.__name__ for k in ON_POSITIONS)})")
        if not isinstance(layer, Block):   # (a Block joined above, its norms and dropouts with it)
            layer.join(group)
