"""The yardsticks of issue 4, measured in the same run as hpctrain:

- a straightforward single-process NumPy loop (the same MLP and Adam, written
  the obvious way: whole-array expressions, new temporaries every step);
- PyTorch DistributedDataParallel (gloo backend, one thread per rank), when
  torch is installed (it is not a dependency: `pip install torch`).

    python -m hpctrain.bench compare --ranks 1,2,4

Same model (784-500-500-10), Adam 1e-4, batch 32 per rank, float32. The
NumPy loop trains on the bundled MNIST sample (its zero border pixels give
zero gradients, whose Adam moments decay into slow subnormal floats: part of
what a plain implementation pays); DDP uses random inputs of MNIST's shape.
"""
import sys
import time

import numpy as np

HIDDEN = (500, 500)


def numpy_loop(steps, batch=32, hidden=HIDDEN, lr=1e-4):
    """samples/s of the plain NumPy implementation, median over the last 80% of steps."""
    rng = np.random.default_rng(0)
    sizes = [784, *hidden, 10]
    Ws = [(rng.standard_normal((i, o)) * np.sqrt(2 / i)).astype(np.float32) for i, o in zip(sizes, sizes[1:])]
    bs = [np.zeros(o, np.float32) for o in sizes[1:]]
    params = Ws + bs
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    from .. import data
    if not data.is_prepared(data.default_data_dir()):
        data.prepare(data.bundled_sample_dir(), data.default_data_dir(), log=None)
    reader = data.ShardReader(data.default_data_dir(), 0, 1, batch, 0)
    times = []
    for t in range(1, steps + 1):
        t0 = time.perf_counter()
        x, y = reader.next_batch()
        hs = [x]
        for i, (W, b) in enumerate(zip(Ws, bs)):
            z = hs[-1] @ W + b
            hs.append(np.maximum(z, 0) if i < len(Ws) - 1 else z)
        logits = hs[-1]
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        d = p
        d[np.arange(batch), y] -= 1
        d /= batch
        gW, gb = [None] * len(Ws), [None] * len(Ws)
        for i in range(len(Ws) - 1, -1, -1):
            gW[i] = hs[i].T @ d
            gb[i] = d.sum(0)
            if i:
                d = (d @ Ws[i].T) * (hs[i] > 0)
        for j, (pp, g) in enumerate(zip(params, gW + gb)):
            m[j] = 0.9 * m[j] + 0.1 * g
            v[j] = 0.999 * v[j] + 0.001 * g * g
            pp -= lr * (m[j] / (1 - 0.9 ** t)) / (np.sqrt(v[j] / (1 - 0.999 ** t)) + 1e-8)
        times.append(time.perf_counter() - t0)
    return batch / float(np.median(times[steps // 5:]))


def _ddp_rank(rank, world, steps, batch, rendezvous, out):
    import torch
    from .torch_models import timed_steps
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    layers, sizes = [], [784, *HIDDEN, 10]
    for i, o in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(i, o), torch.nn.ReLU()]
    x, y, loss_fn = torch.rand(batch, 784), torch.randint(0, 10, (batch,)), torch.nn.CrossEntropyLoss()
    timed_steps(rank, world, torch.nn.Sequential(*layers[:-1]), lambda m: loss_fn(m(x), y), steps, batch,
                rendezvous, out, ddp=True)   # DDP at 1 rank too: the reference is DDP's cost


def ddp(ranks, steps, batch=32):
    """samples/s of PyTorch DDP on `ranks` processes, or None without torch.
    (Rendezvous through a file; gloo itself talks TCP over loopback: torch's
    sockets, for this comparison only.)"""
    from .torch_models import spawned
    return spawned(_ddp_rank, ranks, steps, batch)


if __name__ == "__main__":
    print(numpy_loop(int(sys.argv[1]) if len(sys.argv) > 1 else 500))
