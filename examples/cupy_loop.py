"""A CuPy training loop on the GPU, data-parallel with hpctrain.dist: an MLP
with a hand-written backward (examples/numpy_mlp.py's, on the device), the
gradients averaged over the ranks with Horovod's lines (marked # hvd).

    pip install 'hpctrain[gpu]'
    mpirun -n 2 python examples/cupy_loop.py --steps 200        # a GPU per rank (local_rank picks it)

hpctrain.dist moves host memory: each gradient is copied to its slot in a
host buffer as backward finishes it (`.get(out=...)` returns once the copy
is done, so the stream that wrote the gradient is synchronized before MPI
reads it: the house rule), handed to the optimizer's buckets with
`ready(i)`, summed there while backward goes on, and copied back after
`synchronize()`. The data are random points of a fixed random linear
classifier, each rank's own (seed + rank), so the loop needs no files.

Not run here: the machine that wrote it has no GPU. Without CuPy it says
so in one line and exits 2; the tests run the same loop with NumPy standing
in for CuPy (`train(np, ...)`, tests/test_dist_torch.py), which checks
the staging and the averaging, not the device.
"""
import argparse
import sys

import numpy as np

import hpctrain.dist as hvd


def train(xp, steps=200, batch=64, hidden=256, dim=32, classes=10, lr=0.1, seed=0, log=print):
    """The loop on array module xp (cupy; numpy stands in for tests);
    returns the parameters (on the host) and each step's averaged loss."""
    rank = hvd.rank()
    init = np.random.default_rng(seed)   # the same start everywhere; broadcast makes sure
    shapes = [(dim, hidden), (hidden,), (hidden, classes), (classes,)]
    host = [(init.standard_normal(s) * (np.sqrt(2.0 / s[0]) if len(s) == 2 else 0.0)).astype(np.float32)
            for s in shapes]
    hvd.broadcast_parameters(host, root_rank=0)                                        # hvd
    params = [xp.asarray(p) for p in host]
    _, slots = hvd.flat_like(shapes, np.float32)   # the gradients' host slots, one buffer: summed in place
    opt = hvd.DistributedOptimizer(slots)                                              # hvd
    truth = np.random.default_rng(seed + 1).standard_normal((dim, classes)).astype(np.float32)
    data = np.random.default_rng(seed + 2 + rank)   # each rank its own samples
    losses = []
    for step in range(steps):
        x = data.standard_normal((batch, dim)).astype(np.float32)
        y = (x @ truth).argmax(axis=1)
        x, y = xp.asarray(x), xp.asarray(y)
        h = xp.maximum(x @ params[0] + params[1], 0)
        logits = h @ params[2] + params[3]
        p = xp.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        loss = float(-xp.log(xp.maximum(p[xp.arange(batch), y], 1e-30)).mean())
        d = p
        d[xp.arange(batch), y] -= 1.0
        d /= batch
        grads = [None, None, h.T @ d, d.sum(axis=0)]
        for i in (3, 2):
            _to_host(grads[i], slots[i])
            opt.ready(i)                                                               # hvd: on the wire now
        d = (d @ params[2].T) * (h > 0)
        grads[0], grads[1] = x.T @ d, d.sum(axis=0)
        for i in (1, 0):
            _to_host(grads[i], slots[i])
            opt.ready(i)
        opt.synchronize()                                                              # hvd
        for param, slot in zip(params, slots):
            param -= lr * xp.asarray(slot)
        losses.append(float(hvd.allreduce(np.array([loss]), name="loss")[0]))
        if log and rank == 0 and (step % 50 == 0 or step == steps - 1):
            log(f"step {step + 1} loss {losses[-1]:.4f}")
    return [_host_copy(p) for p in params], losses


def _to_host(grad, slot):
    """A device gradient into its host slot (NumPy standing in: a copy)."""
    if isinstance(grad, np.ndarray):
        slot[...] = grad
    else:
        grad.get(out=slot)   # synchronous: the data are on the host when it returns


def _host_copy(a):
    return a.copy() if isinstance(a, np.ndarray) else a.get()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64, help="samples per rank and step")
    ap.add_argument("--lr", type=float, default=0.1)
    args = ap.parse_args(argv)
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:   # no CuPy, or no driver or device behind it
        print(f"hpctrain: error: examples/cupy_loop.py needs CuPy and a GPU (pip install 'hpctrain[gpu]'): "
              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return 2
    hvd.init()                                                                         # hvd
    cupy.cuda.Device(hvd.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()    # hvd: pin the GPU
    train(cupy, args.steps, args.batch_size, lr=args.lr * hvd.size())                 # hvd: lr scaled
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
