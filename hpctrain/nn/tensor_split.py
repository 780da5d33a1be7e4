"""Which layers of a model split over a tensor group (--tensor-parallel,
nn/tensor_parallel.py): marked before the spec configures them
(nn/spec.ModelSpec's `tensor`).

    python -c "from hpctrain.nn.tensor_split import ELEMENTWISE; print(ELEMENTWISE)"
"""
from .embedding import Embedding
from .layer_errors import LayerError
from .layers import Dense
from .linear import Linear
from .losses import TokenCrossEntropy
from .transformer import Block

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
    if not split:
        raise LayerError("it has no layer that splits over a tensor group (a transformer Block, Dense or Linear "
                         "layers in pairs with only ReLU or GELU between them, a tied embedding and head)")
    return sorted(split)
