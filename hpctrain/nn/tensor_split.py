"""Which layers of a model split over a tensor group (--tensor-parallel,
nn/tensor_parallel.py): marked before the spec configures them
(nn/spec.ModelSpec's `tensor`).

    python -c "from hpctrain.nn.tensor_split import ELEMENTWISE; print(ELEMENTWISE)"
"""
from .embedding import Embedding
from .layer_errors import LayerError
from .layers import Dense, Dropout
from .linear import Linear
from .losses import TokenCrossEntropy
from .norm import LayerNorm
from .transformer import Block, PositionEmbedding

# What may lie between a language model's embedding and its head under
# --sequence-parallel: layers that work on each position alone (or a Block,
# which gathers every position where its attention needs them).
ON_POSITIONS = (PositionEmbedding, Dropout, Block, LayerNorm)

# Layers between a column- and a row-parallel one that work on each element
# alone (their class names: nn/layers.ReLU, nn/gelu.GELU), so a slice of the
# activations goes through them as it is.
ELEMENTWISE = ("ReLU", "GELU")


def split_model(layers, loss, group):
    """Mark the layers (and the loss) that split over `group`, before they
    are configured; returns the indices of the split layers. A model with
    nothing to split is refused in one line (T ranks would each compute
    the whole model)."""
    split, pending = [], None   # pending: a Dense/Linear waiting for its row-parallel partner
    vocab_split = False
    for i, layer in enumerate(layers):
        name = type(layer).__name__
        if isinstance(layer, Embedding):
            layer.tensor = ("vocab", group)
            split.append(i)
            pending, vocab_split = None, True
        elif isinstance(layer, (Linear, Dense)) and any(isinstance(owner, Embedding) and transposed
                                                        for _, owner, _, transposed in layer.ties):
            # the tied head: column-parallel over the vocabulary, as its embedding's rows
            layer.tensor = ("column", group, "vocab")
            split.append(i)
            pending = None
            if isinstance(loss, TokenCrossEntropy) and vocab_split and i == len(layers) - 1:
                loss.tensor = group
        elif isinstance(layer, Block):
            layer.split(group)
            split.append(i)
            pending = None
        elif isinstance(layer, (Linear, Dense)):
            if pending is None:
                pending = i
            else:
                layers[pending].tensor = ("column", group, None)
                layer.tensor = ("row", group)
                split += [pending, i]
                pending = None
        elif name not in ELEMENTWISE:
            pending = None
    tied_heads = [i for i in split if getattr(layers[i], "tensor", (None,))[-1] == "vocab"]
    if tied_heads and getattr(loss, "tensor", None) is not group:
        raise LayerError("the vocabulary splits over the tensor group, but the head tied to the embedding is not "
                         "the last layer before a per-token cross-entropy, which would need the whole logits")
    if any(isinstance(layers[i], Embedding) for i in split) and not tied_heads:
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
            getattr(layers[-1], "tensor", (None,))[-1] == "vocab"):
        raise LayerError("--sequence-parallel cuts a language model's positions: it needs the embedding first and "
                         "the head tied to it last (a GPT)")
    for i, layer in enumerate(layers[1:-1], 1):
        if not isinstance(layer, ON_POSITIONS):
            raise LayerError(f"--sequence-parallel: layer {i} ({layer.describe()}) between the embedding and the head "
                             f"is not one that works on a slice of the positions ("
                             f"{', '.join(k.__name__ for k in ON_POSITIONS)})")
        if isinstance(layer, (PositionEmbedding, LayerNorm)):
            layer.tensor = group
        elif isinstance(layer, Dropout):
            layer.split = group
