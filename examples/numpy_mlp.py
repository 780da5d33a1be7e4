"""A NumPy MLP with a hand-written backward, trained data-parallel by
hpctrain.dist: the user's loop stays the user's, Horovod's five lines make it
distributed (marked # hvd below).

    mpirun -n 4 python examples/numpy_mlp.py --hidden 32,32 --steps 20 \
        --batch-size 64 --lr 0.1 --save mlp.npz

It reads the data and draws the initial parameters as a user of hpctrain's
library would (data.ShardReader, the model zoo's initializer), so, at the
same global batch, it trains the parameters of

    python -m hpctrain.train --model mlp --hidden 32,32 --steps 20 \
        --batch-size 64 --optimizer sgd --lr 0.1 --save mlp.h5

within float32 rounding, at any number of ranks (tests/test_dist.py). The
global batch is --batch-size (each rank takes batch-size / ranks), so the
learning rate is not scaled by the number of ranks here; a script that keeps
the per-rank batch fixed scales it (Horovod's `lr * hvd.size()`).
--save writes the parameters by hpctrain's names as .npz (no pickle).
"""
import argparse

import numpy as np

import hpctrain.dist as hvd
from hpctrain.data import ShardReader, bundled_sample_dir, default_data_dir, load_manifest, prepare
from hpctrain.data.manifest import model_shape
from hpctrain.nn import mlp


def forward_backward(params, grads, x, y, opt):
    """Mean cross-entropy over the batch; each layer's gradient handed to
    the optimizer as soon as it is final (last layer first)."""
    layers = len(params) // 2
    acts = [x]
    for k in range(layers):
        z = acts[-1] @ params[2 * k] + params[2 * k + 1]
        acts.append(np.maximum(z, 0) if k < layers - 1 else z)
    logits = acts[-1]
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.log(np.maximum(p[np.arange(len(y)), y], 1e-30)).mean()
    d = p
    d[np.arange(len(y)), y] -= 1.0
    d *= 1.0 / len(y)
    for k in reversed(range(layers)):
        np.matmul(acts[k].T, d, out=grads[2 * k])
        np.sum(d, axis=0, out=grads[2 * k + 1])
        opt.ready(2 * k + 1)                                  # hvd: summed while backward goes on
        opt.ready(2 * k)
        if k:
            d = (d @ params[2 * k].T) * (acts[k] > 0)
    return loss


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(default_data_dir()),
                    help="prepared shards (default: data/mnist, prepared from the bundled sample on first use)")
    ap.add_argument("--hidden", default="32,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64, help="the global batch (all ranks together)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="the parameters as .npz, by hpctrain's tensor names")
    args = ap.parse_args(argv)

    hvd.init()                                                                         # hvd
    if args.batch_size % hvd.size():
        raise hvd.DistError(f"--batch-size {args.batch_size} does not split over {hvd.size()} ranks", collective=True,
                            report=hvd.rank() == 0)
    batch = args.batch_size // hvd.size()
    if args.data == str(default_data_dir()) and not (default_data_dir() / "manifest.json").exists():
        if hvd.rank() == 0:   # as hpctrain train does on first use
            prepare(bundled_sample_dir(), args.data, log=None)
        hvd.barrier()
    reader = ShardReader(args.data, hvd.rank(), hvd.size(), batch, args.seed)  # this rank's share of each step
    shape, classes = model_shape(load_manifest(args.data))
    spec = mlp(shape, classes, hidden=[int(h) for h in args.hidden.split(",")])
    model = spec.build()
    model.init(args.seed)
    names = [name for name, _ in model.tensors()]
    params = [view.copy() for _, view in model.tensors()]
    hvd.broadcast_parameters(params, root_rank=0)                                      # hvd
    _, grads = hvd.flat_like([p.shape for p in params], params[0].dtype)
    opt = hvd.DistributedOptimizer(grads)                                              # hvd

    for step in range(args.steps):
        x, y = reader.next_batch()
        loss = forward_backward(params, grads, x, y, opt)
        opt.synchronize()                                                              # hvd
        for p, g in zip(params, grads):
            p -= args.lr * g
        loss = hvd.allreduce(np.array([loss]))[0]
        if hvd.rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step + 1} loss {loss:.4f}", flush=True)
    if args.save and hvd.rank() == 0:
        np.savez(args.save, **dict(zip(names, params)))
    hvd.shutdown()


if __name__ == "__main__":
    main()
