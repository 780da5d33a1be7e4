"""The transformer's own layers on the layer contract (nn/layers.py):
`PositionEmbedding` (a learned (T, E) table added to each sample's token
vectors) and `Block`, nanoGPT's pre-LayerNorm residual block:

    x = x + dropout(attn(ln1(x)))                  attn: nn/attention.py
    x = x + dropout(proj(gelu(fc(ln2(x)))))        fc: E -> 4E, proj: 4E -> E (nn/linear.py, nn/gelu.py)

One layer to the spec, holding its inner layers as a Residual does
(nn/residual.py): their tensors named `ln1.gamma`, `attn.Wqkv`,
`fc.W`, `proj.b`, ...; their contexts in its context's `inner` (the
attention path's chain, then the MLP path's); each inner layer's noise
stream `stream * 64 + j + 1`, j its place in `inner`. The two
projections into the residual stream (attn.Wo, proj.W) start N(0,
out_std), nanoGPT's 0.02 / sqrt(2 layers) (nn/gpt.py passes it).

    python -m pytest -q tests/test_transformer_layers.py
"""
import math

from .attention import CausalSelfAttention
from .chain import Chain, Container
from .gelu import GELU
from .layers import Context, Dropout, Layer, LayerError
from .linear import Linear, normal
from .norm import EPS, LayerNorm


class PositionEmbedding(Layer):
    """(batch, T, E) -> the same plus P[t] at position t; P (T, E), T the
    input's positions (the block size), N(0, std) weights. A shorter
    sequence (t < T positions: a prompt, called outside a spec) gets P's
    first t rows, and the other rows' gradient is 0."""
    keeps_output = False   # its backward reads nothing
    # joined to a tensor group (--sequence-parallel): it gets this rank's positions (nn/tensor_parallel.py)

    def __init__(self, std=0.02):
        self.std = float(std)

    def configure(self, in_shape):
        if len(in_shape) != 2:
            raise LayerError(f"PositionEmbedding takes (positions, width) per sample, not "
                             f"{'x'.join(map(str, in_shape))}")
        super().configure(in_shape)
        # the table's rows: every position's; this rank's input from `first` on (a slice of them)
        self.table, self.first = self.in_shape, 0
        if self.group is not None:
            self.table = (self.in_shape[0] * self.group.size, self.in_shape[1])
            self.first = self.group.rank * self.in_shape[0]
        return self.out_shape

    def param_shapes(self):
        return [("P", self.table)]

    def init(self, rng, params, dtype):
        params["P"][...] = normal(rng, params["P"].shape, self.std, dtype)

    def forward(self, ctx, x, train):
        y = ctx.buffer(("out", train), x.shape, x.dtype)
        self.xp.add(x, self.params["P"][self.first:self.first + x.shape[1]], out=y)
        return y

    def backward(self, ctx, dy, need_dx):
        a, b, dP = self.first, self.first + dy.shape[1], self.grads["P"]
        dP[:a] = 0
        dP[b:] = 0
        dy.sum(axis=0, out=dP[a:b])
        if self.group is not None:   # --sequence-parallel: each rank its positions' rows, the others 0
            self.group.sum(dP)
        return dy if need_dx else None

    def train_floats(self):
        return math.prod(self.in_shape)   # its output (the gradient passes through)

    def flops(self):
        return math.prod(self.in_shape)

    def describe(self):
        return "PositionEmbedding"


class Block(Container):
    """A pre-LN transformer block of `width` (the input's last axis),
    `heads` attention heads, dropout p on the attention and on both
    residual branches, its GELU `approximate` ("none" exact, "tanh"
    GPT-2's: nn/gelu.py), its two LayerNorms' epsilon `eps`."""
    keeps_output = False   # its backward reads its inner layers' own buffers
    recompute_unit = True  # --recompute's grain: one block (nn/sequential.LayerRange)
    role = "block"         # --tensor-parallel: its inner layers split by their own roles (join)

    def __init__(self, width, heads, dropout=0.0, std=0.02, out_std=0.02, approximate="none", eps=EPS):
        self.width = int(width)
        self.attn_path = [LayerNorm(eps), CausalSelfAttention(heads, dropout, std, out_std), Dropout(dropout)]
        # --tensor-parallel: the attention by heads, fc column- and proj row-parallel (Megatron's MLP)
        self.mlp_path = [LayerNorm(eps), Linear(4 * self.width, std=std, role="column"), GELU(approximate),
                         Linear(self.width, std=out_std, role="row"), Dropout(dropout)]
        self.inner = list(zip(("ln1", "attn", "drop1"), self.attn_path)) + \
            list(zip(("ln2", "fc", "gelu", "proj", "drop2"), self.mlp_path))
        self._chains = None

    def configure(self, in_shape):
        if len(in_shape) != 2 or in_shape[-1] != self.width:
            raise LayerError(f"{self.describe()} takes (positions, {self.width}) per sample, not "
                             f"{'x'.join(map(str, in_shape))}")
        super().configure(in_shape)
        for path in (self.attn_path, self.mlp_path):
            shape = self.in_shape
            for layer in path:
                shape = tuple(layer.configure(shape))
        return self.out_shape

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)   # the inner layers (nn/chain.Container), prefixed
        # each path's input is read again by the residual sum: an in-place layer gets a copy (nn/chain.py)
        self._chains = Chain(self.attn_path, xp, input_kept=True), Chain(self.mlp_path, xp, input_kept=True)

    def join(self, group):
        """--tensor-parallel: its inner layers by the roles they were built
        with (the attention by heads, fc column- and proj row-parallel over
        `group`: nn/tensor_parallel.py); with --sequence-parallel the rest
        (the norms, the dropouts, the residual sums) on this rank's positions."""
        self.group = group
        (ln1, attn, drop1), (ln2, fc, _, proj, drop2) = self.attn_path, self.mlp_path
        for layer in (attn, fc, proj) + ((ln1, drop1, ln2, drop2) if group.sequence else ()):
            layer.join(group)

    def tensor_cuts(self):
        return {f"{prefix}.{name}": cut for prefix, layer in self.inner
                for name, cut in getattr(layer, "tensor_cuts", dict)().items()}

    def context(self):
        return Context(self.xp, [chain.context() for chain in self._chains])

    def set_noise(self, ctx, noise):
        self._set_inner_noise(ctx, noise, ctx.inner[0].inner + ctx.inner[1].inner)

    # --- forward and backward -------------------------------------------------
    def forward(self, ctx, x, train):
        xp, (attn, mlp) = self.xp, self._chains
        h = ctx.buffer(("h", train), x.shape, x.dtype)
        xp.add(x, attn.forward(ctx.inner[0], x, train), out=h)
        y = ctx.buffer(("out", train), x.shape, x.dtype)
        xp.add(h, mlp.forward(ctx.inner[1], h, train), out=y)
        return y

    def backward(self, ctx, dy, need_dx):
        xp = self.xp
        d = self._back(self.mlp_path, ctx.inner[1].inner, dy, True)
        dh = ctx.buffer("dh", dy.shape, dy.dtype)
        xp.add(dy, d, out=dh)
        d = self._back(self.attn_path, ctx.inner[0].inner, dh, need_dx)
        if not need_dx:
            return None
        dx = ctx.buffer("dx", dy.shape, dy.dtype)
        xp.add(dh, d, out=dx)
        return dx

    @staticmethod
    def _back(path, contexts, d, need_dx):
        """Backprop d through a path, last layer first (its first layer's
        input gradient only where need_dx)."""
        for i in range(len(path) - 1, -1, -1):
            d = path[i].backward(contexts[i], d, need_dx or i > 0)
        return d

    def train_floats(self):
        # the inner layers', the residual sums h and out, dh and dx
        return sum(layer.train_floats() for _, layer in self.inner) + 4 * math.prod(self.in_shape)

    def flops(self):
        return sum(layer.flops() for _, layer in self.inner) + 2 * math.prod(self.in_shape)

    def describe(self):
        attn, gelu, eps = self.attn_path[1], self.mlp_path[2], self.attn_path[0].eps
        drop = f", dropout={self.attn_path[2].p:g}" if self.attn_path[2].p else ""
        act = ", act=gelu_tanh" if gelu.approximate == "tanh" else ""
        return f"Block({self.width}, heads={attn.heads}{drop}{act}{f', eps={eps:g}' if eps != EPS else ''})"
