"""Where a GPT's training step goes, by kind of work, beside PyTorch's
(`bench layers --model gpt:...`): the 2-D matrix products (every Linear's
and attention's projections), attention's per-head products and softmax,
GELU, LayerNorm, the Linears' own passes (bias), the embeddings, the
token cross-entropy with the head's logits, the optimizer (Adam), and
the rest of the step, in milliseconds a step and shares of it, on one
thread, forward, backward and the update of real steps in order, so the
operands are as cold or warm as a training step leaves them (bench
layers' image models time each layer alone, hot).

hpctrain's side is timed around its own calls (blas.matmul, each leaf
layer's forward and backward less the products inside it, the loss, the
optimizer); PyTorch's twin (bench/torch_gpt.py: the same model and
shapes, its own initial values) from torch.profiler's self CPU time of
its operators, sorted into the same kinds (KIND_OF_OP). On each side the
parts add up to the timed (profiled) step, the rest taking what no part
names (residual sums, copies, Python, autograd, the timers themselves);
the whole step is also measured without timers.

    python -m hpctrain.bench layers --model gpt:layers=4,heads=4,width=128 --block-size 64 --batch 12
"""
import functools
import os
import time
from collections import defaultdict

import numpy as np

from .common import table

PRODUCTS, REST = "2-D products", "the rest"
KINDS = (PRODUCTS, "attention: heads, softmax", "GELU", "LayerNorm", "Linear: bias", "embeddings", "loss",
         "optimizer", REST)
# hpctrain's leaf layers by class name; what is not here (dropout, residual sums) is the rest
KIND_OF_LAYER = {"CausalSelfAttention": KINDS[1], "GELU": KINDS[2], "LayerNorm": KINDS[3], "Linear": KINDS[4],
                 "Embedding": KINDS[5], "PositionEmbedding": KINDS[5]}
# PyTorch's operators (self CPU time) by the same kinds; the rest is every other operator and the gaps
KIND_OF_OP = {"aten::mm": PRODUCTS, "aten::addmm": PRODUCTS,
              "aten::bmm": KINDS[1], "aten::baddbmm": KINDS[1], "aten::_softmax": KINDS[1],
              "aten::_softmax_backward_data": KINDS[1],
              "aten::_scaled_dot_product_flash_attention_for_cpu": KINDS[1],
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward": KINDS[1],
              "aten::gelu": KINDS[2], "aten::gelu_backward": KINDS[2],
              "aten::native_layer_norm": KINDS[3], "aten::native_layer_norm_backward": KINDS[3],
              "aten::embedding": KINDS[5], "aten::embedding_dense_backward": KINDS[5],
              "aten::index_select": KINDS[5],
              "aten::_log_softmax": KINDS[6], "aten::_log_softmax_backward_data": KINDS[6],
              "aten::nll_loss_forward": KINDS[6], "aten::nll_loss_backward": KINDS[6]}
OPTIMIZER = "optimizer step"   # torch.profiler.record_function's label around Adam's step


def _leaves(layers):
    """The layers under `layers` that are timed whole: those of KIND_OF_LAYER
    (attention with its dropout) and the others without inner layers (a
    container's through its `inner`)."""
    for layer in layers:
        inner = getattr(layer, "inner", None)
        if inner and type(layer).__name__ not in KIND_OF_LAYER:
            yield from _leaves(child for _, child in inner)
        else:
            yield layer


class _Timers:
    """Milliseconds by kind, from wrappers put on blas.matmul and on each
    leaf layer's forward and backward (instance attributes: the classes
    are not touched); a layer's own time is its calls' less the products
    inside them."""

    def __init__(self):
        self.ms = defaultdict(float)
        self.products = 0.0   # seconds inside blas.matmul so far

    def wrap_products(self, blas):
        inner = blas.matmul

        def matmul(*args):
            t = time.perf_counter()
            out = inner(*args)
            self.products += time.perf_counter() - t
            return out
        blas.matmul = matmul
        return inner

    def wrap(self, obj, name, kind):
        inner = getattr(obj, name)

        def call(*args, **kw):
            t, p = time.perf_counter(), self.products
            out = inner(*args, **kw)
            self.ms[kind] += 1e3 * ((time.perf_counter() - t) - (self.products - p))
            return out
        setattr(obj, name, call)


def _ms_a_step(step, n):
    """Milliseconds a step over n calls of step()."""
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n * 1e3


def hpctrain_parts(options, vocab, block_size, batch, steps, warmup, seed=0):
    """(ms a step by kind, the timed step's ms, the untimed step's ms):
    medians are not taken per kind (they would not add up): totals over
    `steps` after `warmup`, divided by steps."""
    from ..nn import blas, gpt
    from ..optim.adam import Adam
    spec = gpt(vocab, block_size, **options)
    model = spec.build()
    model.init(seed)
    opt = Adam(model.num_params)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, block_size + 1))
    x, y = ids[:, :-1].astype(np.float32), ids[:, 1:]

    def step():
        model.forward_backward(x, y)
        opt.step(model.params, model.grads, 1e-4)
    run = functools.partial(_ms_a_step, step)
    run(warmup)
    plain = run(steps)
    timers = _Timers()
    matmul = timers.wrap_products(blas)
    try:
        for layer in _leaves(model.layers):
            kind = KIND_OF_LAYER.get(type(layer).__name__, REST)
            timers.wrap(layer, "forward", kind)
            timers.wrap(layer, "backward", kind)
        timers.wrap(model.loss, "forward_backward", KINDS[6])
        timers.wrap(opt, "step", KINDS[7])
        run(warmup)
        timers.ms.clear()
        timers.products = 0.0
        timed = run(steps)
    finally:
        blas.matmul = matmul
    ms = {kind: timers.ms[kind] / steps for kind in KINDS}
    ms[PRODUCTS] = timers.products * 1e3 / steps
    ms[REST] += timed - sum(ms.values())
    return ms, timed, plain


def torch_parts(options, vocab, block_size, batch, steps, warmup, seed=0):
    """The same for nanoGPT's twin on one torch thread (None without torch):
    its operators' self CPU time under the profiler, the optimizer's step
    as one part (its own operators are not sorted again)."""
    try:
        import torch
    except ImportError:
        return None
    from torch.profiler import ProfilerActivity, profile, record_function
    from .torch_gpt import build
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    twin = build(vocab, block_size, **options)
    opt = torch.optim.Adam(twin.parameters(), lr=1e-4)
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(0, vocab, (batch, block_size + 1)))
    x, y = ids[:, :-1], ids[:, 1:].reshape(-1)

    def step():
        logits = twin(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        with record_function(OPTIMIZER):
            opt.step()
    run = functools.partial(_ms_a_step, step)
    run(warmup)
    plain = run(steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed = run(steps)
    ms = dict.fromkeys(KINDS, 0.0)
    for event in prof.events():
        if event.name == OPTIMIZER:
            ms[KINDS[7]] += event.cpu_time_total / 1e3 / steps
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and parent.name != OPTIMIZER:
            parent = parent.cpu_parent
        if event.name == OPTIMIZER or parent is not None:   # the optimizer's operators: its part already
            continue
        ms[KIND_OF_OP.get(event.name, REST)] += event.self_cpu_time_total / 1e3 / steps
    ms[REST] += timed - sum(ms.values())
    return ms, timed, plain


def main(args, options):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    steps, warmup = max(3, int(args.steps)), 5
    load = os.getloadavg()
    ours, timed, plain = hpctrain_parts(options, args.vocab, args.block_size, args.batch, steps, warmup)
    theirs = torch_parts(options, args.vocab, args.block_size, args.batch, steps, warmup)
    rows = []
    for kind in KINDS:
        row = {"part": kind, "ms": ours[kind], "share": 100 * ours[kind] / timed}
        if theirs is not None:
            row["torch_ms"] = theirs[0][kind]
            row["torch_share"] = 100 * theirs[0][kind] / theirs[1]
        rows.append(row)
    out = dict(bench="layers", model=args.model, block_size=args.block_size, batch=args.batch, vocab=args.vocab,
               steps=steps, blas=args.blas, compiled_layers=args.compiled_layers, load_before=load,
               load_after=os.getloadavg(), parts=rows, step_timed_ms=timed, step_ms=plain,
               torch_step_timed_ms=theirs[1] if theirs else None, torch_step_ms=theirs[2] if theirs else None)
    if args.json:
        import json
        print(json.dumps(out))
        return 0
    print(f"{args.model}, block {args.block_size}, batch {args.batch}, vocab {args.vocab}: one thread, "
          f"{steps} steps (Adam) after {warmup}, --blas {args.blas}, compiled layers {args.compiled_layers}; "
          f"load average {load[0]:.2f} before, {out['load_after'][0]:.2f} after")
    print(table(rows, [("part of a step", "part", "{}"), ("ms", "ms", "{:.2f}"), ("share %", "share", "{:.1f}"),
                       ("torch ms", "torch_ms", "{:.2f}"), ("torch share %", "torch_share", "{:.1f}")]))
    print(f"step: {plain:.2f} ms ({timed:.2f} timed)"
          + (f"; torch {theirs[2]:.2f} ms ({theirs[1]:.2f} profiled); torch ms / ours {theirs[2] / plain:.2f}"
             if theirs else "; (torch is not installed: pip install torch for its columns)"))
    return 0
