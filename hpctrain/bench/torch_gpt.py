"""nanoGPT's model (nn/gpt.py) in PyTorch, for `bench compare --model
gpt:...`: the yardstick hpctrain's GPT is measured against. torch is a
benchmark-only dependency (`pip install torch`), imported here alone.

The twin is karpathy/nanoGPT's model.py as PyTorch users run it on a CPU:
token and position embeddings, pre-LN blocks (one fused qkv Linear,
F.scaled_dot_product_attention(is_causal=True), the output projection;
MLP E -> 4E, exact GELU (act=gelu_tanh: the tanh form), 4E -> E), the final LayerNorm, the head tied to
the token embedding (lm_head.weight = wte.weight). torch keeps a Linear's
weight as (out, in), hpctrain as (in, out): `same_gpt` copies hpctrain's
initial parameters across transposed (the qkv columns are q, k, v, each
heads x head width, in both) and compares one forward's logits.

    python -m hpctrain.bench.torch_gpt gpt:layers=4,heads=4,width=128 64   # the check
"""
import sys

import numpy as np


def build(vocab, block_size, layers, heads, width, dropout=0.0, act="gelu", eps=1e-5):
    """The torch module: (batch, T) token ids -> (batch, T, vocab) logits."""
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F

    class Attention(tnn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.c_proj = tnn.Linear(width, 3 * width), tnn.Linear(width, width)

        def forward(self, x):
            n, t, e = x.shape
            q, k, v = (a.view(n, t, heads, e // heads).transpose(1, 2) for a in self.c_attn(x).split(e, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if self.training else 0.0, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(n, t, e))

    class Block(tnn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = tnn.LayerNorm(width, eps), Attention(), tnn.LayerNorm(width, eps)
            gelu = tnn.GELU(approximate="tanh" if act == "gelu_tanh" else "none")
            self.mlp = tnn.Sequential(tnn.Linear(width, 4 * width), gelu, tnn.Linear(4 * width, width))
            self.drop1, self.drop2 = tnn.Dropout(dropout), tnn.Dropout(dropout)

        def forward(self, x):
            x = x + self.drop1(self.attn(self.ln_1(x)))
            return x + self.drop2(self.mlp(self.ln_2(x)))

    class GPT(tnn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = tnn.Embedding(vocab, width), tnn.Embedding(block_size, width)
            self.drop = tnn.Dropout(dropout)
            self.h = tnn.ModuleList(Block() for _ in range(layers))
            self.ln_f = tnn.LayerNorm(width, eps)
            self.lm_head = tnn.Linear(width, vocab, bias=False)
            self.lm_head.weight = self.wte.weight   # tied, as nanoGPT's

        def forward(self, idx):
            x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return GPT()


def copy_parameters(model, twin):
    """hpctrain's bound parameters (a built gpt spec's model) into the twin."""
    import torch
    layers = model.layers
    p = [{k: np.asarray(v) for k, v in layer.params.items()} for layer in layers]
    pairs = [(twin.wte.weight, p[0]["E"]), (twin.wpe.weight, p[1]["P"]),
             (twin.ln_f.weight, p[-2]["gamma"]), (twin.ln_f.bias, p[-2]["beta"])]
    for block, q in zip(twin.h, p[3:-2]):
        pairs += [(block.ln_1.weight, q["ln1.gamma"]), (block.ln_1.bias, q["ln1.beta"]),
                  (block.attn.c_attn.weight, q["attn.Wqkv"].T), (block.attn.c_attn.bias, q["attn.bqkv"]),
                  (block.attn.c_proj.weight, q["attn.Wo"].T), (block.attn.c_proj.bias, q["attn.bo"]),
                  (block.ln_2.weight, q["ln2.gamma"]), (block.ln_2.bias, q["ln2.beta"]),
                  (block.mlp[0].weight, q["fc.W"].T), (block.mlp[0].bias, q["fc.b"]),
                  (block.mlp[2].weight, q["proj.W"].T), (block.mlp[2].bias, q["proj.b"])]
    with torch.no_grad():
        for mine, theirs in pairs:
            mine.copy_(torch.from_numpy(np.ascontiguousarray(theirs)))


def same_gpt(options, vocab, block_size, batch=4, seed=0):
    """hpctrain's gpt (options: cli.gpt_options' dict) and its twin on the
    same parameters (hpctrain's initial ones, each moved by N(0, 0.05)): the
    parameter counts (a tied tensor once in each) and the largest |logit
    difference| of one evaluation forward on the same random tokens."""
    import torch
    from ..nn import gpt
    spec = gpt(vocab, block_size, **options)
    model = spec.build()
    model.init(seed)
    rng = np.random.default_rng(seed)
    for layer in model.layers:   # off the initial values: biases (0) and LayerNorm's gamma (1) checked too
        for v in layer.params.values():
            v += rng.normal(0, 0.05, v.shape).astype(v.dtype)
    twin = build(vocab, block_size, **options)
    copy_parameters(model, twin)
    twin.eval()
    ids = rng.integers(0, vocab, (batch, block_size))
    ours = np.asarray(model.run.forward(ids.astype(np.float32), False))
    with torch.no_grad():
        theirs = twin(torch.from_numpy(ids)).numpy()
    return {"model": "gpt", "hpctrain_params": int(model.num_params),
            "torch_params": sum(p.numel() for p in twin.parameters()),
            "max_logit_diff": float(np.abs(ours - theirs).max()), "max_logit": float(np.abs(ours).max())}


def _rank(rank, world, shape, steps, batch, threads, rendezvous, out):
    """One process of the torch run: the twin (DDP over gloo from 2 ranks),
    Adam 1e-4, random (batch, T) tokens and targets (the speed does not
    depend on their values); rank 0 writes tokens/s from the slowest rank's
    median step (the first fifth of the steps left out as warm-up)."""
    import torch
    import torch.nn.functional as F
    from .torch_models import timed_steps
    torch.set_num_threads(threads)
    torch.manual_seed(rank)
    vocab, block_size, options = shape
    module = build(vocab, block_size, **options)
    x = torch.randint(0, vocab, (batch, block_size))
    y = torch.randint(0, vocab, (batch * block_size,))
    timed_steps(rank, world, module, lambda m: F.cross_entropy(m(x).view(-1, vocab), y), steps,
                batch * block_size, rendezvous, out)


def rate(options, vocab, block_size, ranks, steps, batch, threads=1):
    """tokens/s of the twin on `ranks` processes (`threads` each)."""
    from .torch_models import spawned
    return spawned(_rank, ranks, (vocab, block_size, options), steps, batch, threads)


if __name__ == "__main__":
    from ..flags.model_names import gpt_options
    name, block = (sys.argv[1:] + ["gpt:layers=4,heads=4,width=128", "64"][len(sys.argv[1:]):])[:2]
    r = same_gpt(gpt_options(name), 65, int(block))
    print(f"{name}, T {block}: parameters hpctrain {r['hpctrain_params']:,}, torch {r['torch_params']:,}; one "
          f"forward on the same weights: max |logit diff| {r['max_logit_diff']:.2e} (largest |logit| "
          f"{r['max_logit']:.2f})")
