"""nanoGPT's model as a layer list and its loss (karpathy/nanoGPT model.py):

    Embedding(vocab, E)            token vectors (nn/embedding.py), N(0, 0.02)
    PositionEmbedding              a learned (T, E) table added, N(0, 0.02)
    Dropout(p)                     on the sum
    Block(E, heads, p) x L         pre-LN residual blocks (nn/transformer.py)
    LayerNorm                      the final one

act="gelu_tanh" gives every block's MLP GPT-2's tanh GELU (nn/gelu.py;
transformers' gelu_new) instead of the exact one; eps is every LayerNorm's
epsilon (1e-5: PyTorch's, nanoGPT's and GPT-2's).
    Linear(vocab, bias=False)      the head, tied to the token embedding
                                   transposed (nanoGPT's lm_head.weight = wte.weight)

scored per token by TokenCrossEntropy (nn/losses.py). Weights N(0, 0.02),
the two projections into the residual stream of every block (attention's
Wo, the MLP's proj.W) N(0, 0.02 / sqrt(2 L)), biases 0, LayerNorm 1 and 0.
The dropout layers are there at p = 0 too (identities), so the layer
indices, and with them the initial parameters ((seed, layer index),
nn/sequential.py), do not depend on p.

A model file (`--model FILE.py:build`, nn/user.py) returns the pair:

    def build(input_shape, classes):    # (T,) token ids, the vocabulary
        return gpt_layers(classes, input_shape[0], layers=4, heads=4, width=128)

    python -c "from hpctrain.nn.gpt import gpt; print(*gpt(65, 64, 4, 4, 128).summary(), sep='\\n')"
"""
import math

from ..flags.model_names import ACTS, DEFAULT_ACT, DEFAULT_EPS
from .embedding import Embedding
from .layers import Dropout, LayerError
from .linear import Linear
from .losses import TokenCrossEntropy
from .norm import LayerNorm
from .spec import ModelSpec
from .transformer import Block, PositionEmbedding

STD = 0.02   # nanoGPT's weight scale


def gpt_layers(vocab, block_size, layers, heads, width, dropout=0.0, act=DEFAULT_ACT, eps=DEFAULT_EPS):
    """(the layer list, its loss): what a user's model file returns
    (nn/user.py) to train nanoGPT's model on tokens of (block_size,)."""
    vocab, layers, heads, width = int(vocab), int(layers), int(heads), int(width)
    if min(vocab, int(block_size), layers, heads, width) < 1:
        raise LayerError(f"gpt(vocab={vocab}, block_size={block_size}, layers={layers}, heads={heads}, "
                         f"width={width}): each must be at least 1")
    if width % heads:
        raise LayerError(f"gpt: the width {width} is not a multiple of the heads ({heads})")
    if act not in ACTS:
        raise LayerError(f"gpt: act={act!r} is not one of {', '.join(ACTS)}")
    if not 0 < eps < 1:
        raise LayerError(f"gpt: eps={eps!r} is not in (0, 1)")
    approximate = "tanh" if act == "gelu_tanh" else "none"
    out_std = STD / math.sqrt(2 * layers)
    # --tensor-parallel: the vocabulary split over the group (the embedding's rows, the tied head's
    # units), each Block by its inner layers' roles (nn/transformer.py)
    # Each layer named by its path in the model (nanoGPT's wte, wpe, h.i, ln_f, lm_head): the checkpoints' names
    embedding = Embedding(vocab, width, std=STD, role="vocab").named("embedding")
    model = [embedding, PositionEmbedding(STD).named("position"), Dropout(dropout).named("drop")]
    model += [Block(width, heads, dropout, std=STD, out_std=out_std, approximate=approximate, eps=eps)
              .named(f"blocks.{b}") for b in range(layers)]
    model += [LayerNorm(eps).named("ln_f"), Linear(vocab, bias=False, role="vocab").named("head")
              .tie("W", embedding, "E", transposed=True)]
    return model, TokenCrossEntropy()


def gpt(vocab, block_size, layers, heads, width, dropout=0.0, act=DEFAULT_ACT, eps=DEFAULT_EPS, name="gpt"):
    """nanoGPT's model as a spec: input (block_size,) token ids, logits
    (block_size, vocab)."""
    model, loss = gpt_layers(vocab, block_size, layers, heads, width, dropout, act, eps)
    return ModelSpec(model, (int(block_size),), int(vocab), name=name, loss=loss)
