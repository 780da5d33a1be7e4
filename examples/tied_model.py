"""A model with a tied tensor: the output head reads the embedding's matrix,
transposed (nanoGPT's `lm_head.weight = wte.weight`), on the images we
have. Each pixel becomes a token (its brightness in `classes` levels), the
embedding gives each token a vector, Dense layers make one vector of the
image, and the head scores it against every token's vector: logits over
the vocabulary, whose `classes` tokens are read as the digits 0..9. The
head keeps a bias of its own; its weight is the embedding's E, one tensor
in the flat buffer whose gradient is the sum of both uses (docs/models.md,
"Tied tensors").

    mpirun -n 2 python -m hpctrain.mnist --model examples/tied_model.py:build --steps 200
    mpirun -n 2 python -m hpctrain.mnist --model examples/tied_model.py:build --steps 200 \
        --pipeline-stages 2 --micro-batches 4 --pipeline-split 3    # the embedding and the head on two stages

Every rank imports this file itself; nothing of it is sent between ranks.
"""
import math

from hpctrain.nn import Dense, Embedding, Flatten, Layer, ReLU

WIDTH = 8   # the embedding's vectors, and the last hidden layer's: the head reads E transposed


class Tokens(Layer):
    """Pixels in [0, 1] -> one token id a pixel, floor(x * levels) in
    0..levels-1 (as float32 whole numbers: a layer hands on float32, and the
    embedding takes those as ids). Nothing to learn, no gradient through it."""
    keeps_output = False

    def __init__(self, levels):
        self.levels = int(levels)

    def configure(self, in_shape):
        super().configure(in_shape)
        self.out_shape = (math.prod(self.in_shape),)
        return self.out_shape

    def forward(self, ctx, x, train):
        xp = self.xp
        t = ctx.buffer(("tokens", train), (x.shape[0], *self.out_shape), x.dtype)
        xp.multiply(x.reshape(t.shape), self.levels, out=t)
        xp.floor(t, out=t)
        xp.clip(t, 0, self.levels - 1, out=t)
        return t

    def backward(self, ctx, dy, need_dx):
        return ctx.zeroed("dx", (dy.shape[0], *self.in_shape), dy.dtype) if need_dx else None

    def describe(self):
        return f"Tokens({self.levels})"


def build(input_shape, classes):
    embedding = Embedding(classes, WIDTH)   # the vocabulary: `classes` brightness levels
    return [Tokens(classes), embedding, Flatten(), Dense(64), ReLU(), Dense(WIDTH),
            Dense(classes).tie("W", embedding, "E", transposed=True)]
