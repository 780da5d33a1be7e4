"""The zoo's models built layer for layer in PyTorch, for the benchmarks that
measure hpctrain against it (bench compare --model NAME, bench layers); torch
is a benchmark-only dependency (`pip install torch`), imported here alone.

hpctrain is NHWC, torch NCHW: the same layers, the image's axes in another
order. `same_model(spec)` builds the torch twin, copies hpctrain's initial
parameters into it (a convolution's W (k, k, in, out) as (out, in, k, k); a
Dense after a Flatten of an image gets its input rows reordered from (h, w,
c) to (c, h, w)) and runs one forward pass on the same batch in evaluation
mode: the check that the two are the same network is the parameter counts
and that forward's largest logit difference.

    python -m hpctrain.bench.torch_models small_cnn   # the check, for one model
"""
import sys

import numpy as np

from ..nn import MODELS, MNIST_CLASSES, MNIST_SHAPE
from ..nn.conv import Channels, Conv2d
from ..nn.pool import AvgPool2d, GlobalAvgPool, MaxPool2d
from ..nn.layers import Dropout, Flatten, ReLU
from ..nn.linear import Dense
from ..nn.batchnorm import EPS, MOMENTUM, BatchNorm1d, BatchNorm2d
from ..nn.residual import Residual


def torch_input_shape(spec):
    """The per-sample input shape torch gets: (c, h, w) for an image model."""
    shape = spec.input_shape
    if any(isinstance(layer, Channels) for layer in spec.layers):
        return (shape[2], shape[0], shape[1]) if len(shape) == 3 else (1, *shape)
    return shape


def to_torch_batch(spec, x):
    """A batch of hpctrain's input layout (NHWC, or N x h x w) in torch's."""
    if any(isinstance(layer, Channels) for layer in spec.layers):
        x = x.reshape(x.shape[0], *spec.input_shape)
        return x.reshape(*x.shape, 1).transpose(0, 3, 1, 2) if x.ndim == 3 else x.transpose(0, 3, 1, 2)
    return x


def build(spec, layers=None):
    """(torch module, copies): copies are (torch module, hpctrain layer, flat
    image shape or None) for every layer with parameters, in order; layers:
    a built model's (bound to its parameters), else the spec's."""
    import torch.nn as tnn

    class Sum(tnn.Module):
        def __init__(self, block, skip):
            super().__init__()
            self.block, self.skip = block, skip

        def forward(self, x):
            return self.block(x) + self.skip(x)

    copies = []

    def walk(layers, in_shape, per_layer=None):
        mods, shape, flat = [], tuple(in_shape), None
        for layer in layers:
            out = tuple(layer.out_shape)
            before = len(mods)
            if isinstance(layer, Channels):
                mods.append(tnn.Identity())
            elif isinstance(layer, Conv2d):
                mods.append(tnn.Conv2d(shape[2], layer.out_channels, layer.k, layer.stride, layer.pad,
                                       bias=layer.bias))
                copies.append((mods[-1], layer, None))
            elif isinstance(layer, MaxPool2d):
                mods.append(tnn.MaxPool2d(layer.k, layer.stride))
            elif isinstance(layer, AvgPool2d):
                mods.append(tnn.AvgPool2d(layer.k, layer.stride))
            elif isinstance(layer, GlobalAvgPool):
                mods += [tnn.AdaptiveAvgPool2d(1), tnn.Flatten()]
            elif isinstance(layer, ReLU):
                mods.append(tnn.ReLU(inplace=True))
            elif isinstance(layer, Dropout):
                mods.append(tnn.Dropout(layer.p))
            elif isinstance(layer, Flatten):
                mods.append(tnn.Flatten())
                flat = shape if len(shape) == 3 else None
            elif isinstance(layer, Dense):
                mods.append(tnn.Linear(layer.fan_in, layer.units))
                copies.append((mods[-1], layer, flat))
                flat = None
            elif isinstance(layer, (BatchNorm2d, BatchNorm1d)):
                kind = tnn.BatchNorm2d if isinstance(layer, BatchNorm2d) else tnn.BatchNorm1d
                mods.append(kind(layer.channels, eps=EPS, momentum=MOMENTUM))
                copies.append((mods[-1], layer, None))
            elif isinstance(layer, Residual):
                block, _ = walk(layer.block, shape)
                skip = walk(layer.projection, shape)[0] if layer.projection else tnn.Identity()
                mods.append(Sum(block, skip))
            else:
                raise ValueError(f"no torch twin for {layer.describe()}")
            if per_layer is not None:
                per_layer.append(tnn.Sequential(*mods[before:]))
            shape = out
        return tnn.Sequential(*mods), shape

    per_layer = []
    module, _ = walk(spec.layers if layers is None else layers, spec.input_shape, per_layer)
    module.per_layer = per_layer   # the twin of each of hpctrain's layers (views of the same modules)
    return module, copies


def copy_parameters(copies):
    """hpctrain's parameters (each layer's bound views) into the torch twin."""
    import torch
    for mod, layer, flat in copies:
        p = {k: np.asarray(v) for k, v in layer.params.items()}
        with torch.no_grad():
            if isinstance(layer, Conv2d):
                mod.weight.copy_(torch.from_numpy(np.ascontiguousarray(p["W"].transpose(3, 2, 0, 1))))
                if layer.bias:
                    mod.bias.copy_(torch.from_numpy(p["b"]))
            elif isinstance(layer, Dense):
                w = p["W"]
                if flat is not None:   # rows in (h, w, c) order; torch flattens (c, h, w)
                    h, wd, c = flat
                    w = w.reshape(h, wd, c, -1).transpose(2, 0, 1, 3).reshape(h * wd * c, -1)
                mod.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
                mod.bias.copy_(torch.from_numpy(p["b"]))
            else:
                mod.weight.copy_(torch.from_numpy(p["gamma"]))
                mod.bias.copy_(torch.from_numpy(p["beta"]))


def parameter_count(module):
    return sum(p.numel() for p in module.parameters())


def same_model(name, input_shape=MNIST_SHAPE, classes=MNIST_CLASSES, batch=8, seed=0):
    """Build `name` in both, with the same parameters; returns a dict:
    hpctrain's and torch's parameter counts and the largest |logit
    difference| of one evaluation forward on the same random batch."""
    import torch
    spec = MODELS[name](input_shape, classes)
    model = spec.build()
    model.init(seed)
    twin, copies = build(spec, model.layers)
    copy_parameters(copies)
    twin.eval()
    x = np.random.default_rng(seed).random((batch, *spec.input_shape)).astype(np.float32)
    ours = model.run.forward(x, False)
    with torch.no_grad():
        theirs = twin(torch.from_numpy(np.ascontiguousarray(to_torch_batch(spec, x)))).numpy()
    return {"model": name, "hpctrain_params": int(model.num_params), "torch_params": parameter_count(twin),
            "max_logit_diff": float(np.abs(ours - theirs).max()), "max_logit": float(np.abs(ours).max())}


def _rank(rank, world, name, steps, batch, threads, rendezvous, out):
    """One process of the torch run: the twin of `name` (DDP over gloo from 2
    ranks), Adam 1e-4, random batches of the model's input shape; rank 0
    writes samples/s from the slowest rank's median step."""
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(rank)
    spec = MODELS[name](MNIST_SHAPE, MNIST_CLASSES)
    module, _ = build(spec)
    x = torch.rand(batch, *torch_input_shape(spec))
    y = torch.randint(0, spec.classes, (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()
    timed_steps(rank, world, module, lambda m: loss_fn(m(x), y), steps, batch, rendezvous, out)


def timed_steps(rank, world, module, loss, steps, per_step, rendezvous, out, ddp=False):
    """Train `module` `steps` steps (DDP over gloo from 2 ranks, or at any
    count with `ddp`: the reference; Adam 1e-4, loss(module) each step);
    rank 0 writes world x per_step (samples, or tokens) / the slowest rank's
    median step, the first fifth of the steps left out as warm-up."""
    import time
    import torch
    import torch.distributed as dist
    ddp = ddp or world > 1
    if ddp:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        module = torch.nn.parallel.DistributedDataParallel(module)
    module.train()
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss(module).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([float(np.median(times[steps // 5:]))])
    if ddp:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(world * per_step / float(t)))
    if ddp:
        dist.barrier()
        dist.destroy_process_group()


def rate(name, ranks, steps, batch=32, threads=1):
    """samples/s of the torch twin of `name` on `ranks` processes (`threads`
    each), or None without torch."""
    return spawned(_rank, ranks, name, steps, batch, threads)


def spawned(fn, ranks, *args):
    """The rate rank 0 writes of fn(rank, ranks, *args, rendezvous, out) run
    on `ranks` spawned processes (rendezvous: a file for gloo's), or None
    without torch."""
    try:
        import torch.multiprocessing as mp
    except ImportError:
        return None
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rate")
        mp.start_processes(fn, args=(ranks, *args, os.path.join(tmp, "rdv"), out), nprocs=ranks,
                           start_method="spawn", join=True)
        with open(out) as f:
            return float(f.read())


if __name__ == "__main__":
    for name in sys.argv[1:] or [n for n in MODELS if n != "mlp"]:
        r = same_model(name)
        print(f"{name}: parameters hpctrain {r['hpctrain_params']:,}, torch {r['torch_params']:,}; "
              f"one forward on the same weights: max |logit diff| {r['max_logit_diff']:.2e} "
              f"(largest |logit| {r['max_logit']:.2f})")
