"""Where a model's training step spends its time, layer by layer, on this
machine: each layer's forward+backward milliseconds at a batch size, the
GFLOP/s of the layers that multiply matrices (Dense, Conv2d, Residual) and
how much of it is the GEMMs themselves (the rest: im2col, col2im, bias,
copies), beside this machine's single-thread SGEMM GFLOP/s measured in the
same run (the ceiling of an im2col design), and images/s for the whole
forward_backward. One process, --threads BLAS threads (default 1: one rank's
share); the load average is printed since the machine may be shared. With
torch installed, beside each layer the same layer in torch (its twin from
bench/torch_models.py, the same threads): which layers are behind, by how much.

    python -m hpctrain.bench layers --model small_cnn --shape 32,32,3 --batch 32
"""
import json
import os
import time

import numpy as np

from ..nn import MODELS, Conv2d, Linear
from ..report.mfu import sgemm_gflops
from .common import table


def _best_ms(fn, seconds, least=5):
    """(CPU ms, wall ms) of the fastest of repeated calls, repeated for about
    `seconds`. CPU time (this process's, one BLAS thread) does not count the
    time other processes on a shared machine take the core away, and the
    minimum is the call their load disturbed least."""
    fn()
    cpu, wall, end = [], [], time.perf_counter() + seconds
    while len(cpu) < least or time.perf_counter() < end:
        t, c = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - t)
    return 1e3 * min(cpu), 1e3 * min(wall)


def _gemms(layer, ctx, need_dx):
    """The layer's own GEMMs on its own buffers (its context's), as a callable (None if it has none)."""
    if isinstance(layer, Conv2d):
        cols, w = layer.columns(ctx), layer.W2
    elif isinstance(layer, Linear):
        cols, w = ctx.rows, layer.params["W"]
    else:
        return None
    y, dy = np.empty((cols.shape[0], w.shape[1]), w.dtype), np.ones((cols.shape[0], w.shape[1]), w.dtype)
    dw, dcols = np.empty(w.shape, w.dtype), np.empty(cols.shape, w.dtype)

    def run():
        np.matmul(cols, w, out=y)
        np.matmul(cols.T, dy, out=dw)
        if need_dx:
            np.matmul(dy, w.T, out=dcols)
    return run


def profile(model, batch, seconds, seed=0, clock=0):
    """Per layer: ms forward+backward, ms of its GEMMs or None, GEMM flops
    (CPU time, or wall time where clock is 1: several threads); and the
    whole step's best (CPU ms, wall ms)."""
    rng = np.random.default_rng(seed)
    x = rng.random((batch, *model.spec.input_shape)).astype(model.dtype)
    y = rng.integers(0, model.spec.classes, batch)
    noise = (seed, 0, np.arange(batch))
    model.forward_backward(x, y, noise=noise)   # (each layer's context keeps the noise)
    ctxs = model.ctx.inner
    # Each layer's input and incoming gradient, captured from one step.
    inputs, grads, a = [], [None] * len(model.layers), x.reshape(batch, *model.spec.input_shape)
    for layer, ctx in zip(model.layers, ctxs):
        inputs.append(a.copy())
        a = layer.forward(ctx, a, True)
    loss, d = model.run.loss_forward_backward(a, y)
    for i in range(len(model.layers) - 1, -1, -1):
        grads[i] = d.copy()
        d = model.layers[i].backward(ctxs[i], d, need_dx=True)
    rows = []
    for i, (layer, ctx) in enumerate(zip(model.layers, ctxs)):
        need_dx = i > model.run.first
        if i < model.run.first:   # before the first layer with parameters: no backward at all
            ms = _best_ms(lambda: layer.forward(ctx, inputs[i], True), seconds / len(model.layers))
        else:
            ms = _best_ms(lambda: (layer.forward(ctx, inputs[i], True), layer.backward(ctx, grads[i], need_dx)),
                          seconds / len(model.layers))
        # the GEMMs alone run on this thread: their share says nothing of a threaded layer
        gemm = None if clock else _gemms(layer, ctx, need_dx)
        mults = 2 * layer.flops() * (3 if need_dx else 2) * batch if layer.param_shapes() else None
        rows.append(dict(layer=layer.describe(), out="x".join(map(str, model.spec.shapes[i])), ms=ms[clock],
                         gemm_ms=_best_ms(gemm, 0.1)[0] if gemm else None, flop=mults))
    step = _best_ms(lambda: model.forward_backward(x, y, noise=noise), seconds)
    return rows, step


def torch_profile(model, batch, seconds, threads, seed=0, clock=0):
    """The same per layer for the torch twin (bench/torch_models.py) at
    `threads` threads: ([ms forward+backward of each layer, None for a
    view], whole forward+backward ms), CPU time (wall where clock is 1);
    None without torch."""
    try:
        import torch
    except ImportError:
        return None
    from ..nn.layers import ReLU
    from . import torch_models
    torch.set_num_threads(threads)
    spec = model.spec
    twin, copies = torch_models.build(spec, model.layers)
    torch_models.copy_parameters(copies)
    twin.train()
    rng = np.random.default_rng(seed)
    x = rng.random((batch, *spec.input_shape)).astype(np.float32)
    a = torch.from_numpy(np.ascontiguousarray(torch_models.to_torch_batch(spec, x)))
    out = []
    for i, (layer, mod) in enumerate(zip(model.layers, twin.per_layer)):
        if isinstance(layer, ReLU):
            mod = torch.nn.ReLU()   # not in place: its input is a leaf that needs a gradient here
        with torch.no_grad():
            y = mod(a)
        if layer.view:
            out.append(None)
        else:
            leaf = a.detach().requires_grad_(i > model.run.first)
            dy = torch.ones_like(y)
            if i < model.run.first:
                def run():
                    with torch.no_grad():
                        mod(leaf)
            else:
                def run():
                    mod.zero_grad(set_to_none=True)
                    leaf.grad = None
                    mod(leaf).backward(dy)
            out.append(_best_ms(run, seconds / len(model.layers))[clock])
        a = y.detach()
    target = torch.from_numpy(rng.integers(0, spec.classes, batch))
    xs = torch.from_numpy(np.ascontiguousarray(torch_models.to_torch_batch(spec, x)))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        twin.zero_grad(set_to_none=True)
        loss_fn(twin(xs), target).backward()
    return out, _best_ms(step, seconds)[clock]


def main(args):
    load = os.getloadavg()
    spec = MODELS[args.model](args.shape, args.classes)
    model = spec.build()
    model.init(0)
    # One thread: CPU time (what other processes take is left out). Several
    # (hpctrain's compute threads, nn/threads.py, as a rank with that many
    # cores trains; torch at as many): wall time, CPU time adding every
    # thread's; the peak then N single-thread SGEMMs.
    clock = 1 if args.threads > 1 else 0
    peak = sgemm_gflops(min(1.0, args.seconds), n=1024)
    rows, (step_cpu, step_wall) = profile(model, args.batch, args.seconds, clock=clock)
    step_cpu = (step_cpu, step_wall)[clock]
    theirs = torch_profile(model, args.batch, args.seconds, args.threads, clock=clock)
    if theirs is not None:
        for r, ms in zip(rows, theirs[0]):
            r["torch_ms"] = ms
            r["x_torch"] = ms / r["ms"] if ms and r["ms"] > 0.01 else None
    peak = max(peak, sgemm_gflops(min(1.0, args.seconds), n=1024)) * args.threads   # before and after: the less disturbed
    total = sum(r["ms"] for r in rows)
    for r in rows:
        r["share"] = 100 * r["ms"] / total
        if r["flop"]:
            r["gflops"] = r["flop"] / r["ms"] / 1e6
            r["of_sgemm"] = 100 * r["gflops"] / peak
            if r["gemm_ms"] is not None:
                r["gemm_share"] = 100 * min(r["gemm_ms"], r["ms"]) / r["ms"]
    flop = sum(r["flop"] or 0 for r in rows)
    out = dict(bench="layers", model=args.model, shape=list(args.shape), batch=args.batch,
               threads=args.threads, compiled_layers=args.compiled_layers, clock=("cpu", "wall")[clock], load_before=load, load_after=os.getloadavg(),
               sgemm_gflops=peak, layers=rows, step_cpu_ms=step_cpu, step_wall_ms=step_wall,
               torch_step_cpu_ms=theirs[1] if theirs else None,
               images_per_s=args.batch / step_cpu * 1e3, images_per_s_wall=args.batch / step_wall * 1e3,
               step_gflops=flop / step_cpu / 1e6, step_of_sgemm=100 * flop / step_cpu / 1e6 / peak)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.model} on {'x'.join(map(str, args.shape))}, batch {args.batch}, "
          + f"compiled layers {args.compiled_layers}, "
          + (f"{args.threads} compute threads (BLAS at one each), wall time; " if clock else "one thread, CPU time; ")
          + f"load average {load[0]:.2f} before, {out['load_after'][0]:.2f} after")
    print(f"single-thread SGEMM (1024^3, float32){f' x {args.threads}' if clock else ''}: {peak:.1f} GFLOP/s")
    print(table(rows, [("layer", "layer", "{}"), ("output", "out", "{}"), ("fwd+bwd ms", "ms", "{:.3f}"),
                       ("share %", "share", "{:.1f}"), ("GFLOP/s", "gflops", "{:.1f}"),
                       ("% SGEMM", "of_sgemm", "{:.0f}"), ("GEMM % of layer", "gemm_share", "{:.0f}"),
                       ("torch ms", "torch_ms", "{:.3f}"), ("torch ms / ours", "x_torch", "{:.2f}")]))
    unit = ("CPU", "wall")[clock]
    print(f"whole forward_backward: {step_cpu:.2f} ms {unit} = {out['images_per_s']:.0f} images/s"
          + ("" if clock else f" ({step_wall:.2f} ms wall = {out['images_per_s_wall']:.0f} images/s)")
          + f"; layers' sum {total:.2f} ms {unit}")
    if theirs is not None:
        print(f"torch (the same layers, {args.threads} thread(s)): {theirs[1]:.2f} ms {unit} = "
              f"{args.batch / theirs[1] * 1e3:.0f} images/s; torch ms / ours {theirs[1] / step_cpu:.2f}")
    else:
        print("(torch is not installed: pip install torch for its column)")
    print(f"the step's matrix products: {flop / args.batch / 1e6:.1f} MFLOP per image, "
          f"{out['step_gflops']:.1f} GFLOP/s = {out['step_of_sgemm']:.0f}% of SGEMM")
    print("(fastest call of each, " + ("wall time: run it on a quiet machine)" if clock else
                                       "CPU time of this process: other processes' load on a shared machine left out)"))
    return 0
