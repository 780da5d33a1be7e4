"""nanoGPT's training loop (karpathy/nanoGPT's train.py, its CPU recipe on
Shakespeare's characters) in PyTorch, data-parallel over hpctrain's ring with
Horovod's five lines, each marked `# hvd`: the loop stays the user's.

    pip install 'hpctrain[torch]'
    mpirun -n 2 python -m mpi4py examples/torch_nanogpt.py --max-iters 200
    mpirun -n 2 python -m mpi4py examples/torch_nanogpt.py --max-iters 200 --ddp   # the same loop, PyTorch DDP (gloo)
    mpirun -n 2 python -m mpi4py examples/torch_nanogpt.py --max-iters 200 --alone # each rank alone: no exchange
    python examples/torch_nanogpt.py --max-iters 2000 --eval-interval 250          # one process

The recipe (nanoGPT's README, "I only have a macbook"): block 64, batch 12
per rank, 4 layers, 4 heads, width 128, no dropout; AdamW at 1e-3 (beta2
0.99, weight decay 0.1 on the matrices), warm-up 100 iterations then cosine
to 1e-4, gradients clipped to norm 1. The model is nanoGPT's GPT as
hpctrain's benchmark builds it (hpctrain/bench/torch_gpt.py: the head tied
to the token embedding), with nanoGPT's initialisation. Each rank draws its
own batches (seed 1337 + rank, nanoGPT's seed_offset); the learning rate is
scaled by the number of ranks, Horovod's recipe, under --ddp too, so that
the two runs are the same arithmetic and their losses can be compared.

--ddp runs the same loop under torch.nn.parallel.DistributedDataParallel
(gloo over loopback; mpirun only starts the processes and tells each its
rank): the reference hpctrain.dist is measured and tested against
(tests/test_dist_torch.py, `python -m hpctrain.bench torch`). --alone runs
it with no data parallelism at all: every rank trains its own copy on its
own batches and exchanges nothing (the ranks meet once, before the loop),
so its tokens/s is the most any gradient exchange on these cores could
reach: the bench's ceiling. --metrics FILE
writes rank 0's loss and step time per iteration as JSON Lines, then a
final line with tokens/s (the world's tokens of a step over the median step,
the first fifth left out as warm-up).

nanoGPT saves `ckpt.pt` with torch.save, which is pickle; hpctrain takes no
pickle, so this loop saves nothing: a user who wants the weights writes
`model.state_dict()` with safetensors on rank 0.
"""
import argparse
import json
import math
import os
import socket
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from hpctrain.bench.torch_gpt import build
from hpctrain.data import bundled_text_path


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    way = p.add_mutually_exclusive_group()
    way.add_argument("--ddp", action="store_true", help="PyTorch DDP (gloo) instead of hpctrain.dist")
    way.add_argument("--alone", action="store_true",
                     help="no exchange: each rank trains its own copy (the speed no data parallelism can beat)")
    p.add_argument("--data", default=bundled_text_path(), help="a text file (default: the bundled plays)")
    p.add_argument("--block-size", type=positive, default=64)
    p.add_argument("--batch-size", type=positive, default=12, help="sequences per rank and iteration")
    p.add_argument("--n-layer", type=positive, default=4)
    p.add_argument("--n-head", type=positive, default=4)
    p.add_argument("--n-embd", type=positive, default=128)
    p.add_argument("--max-iters", type=positive, default=2000)
    p.add_argument("--learning-rate", type=float, default=1e-3, help="one rank's; scaled by the ranks")
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-iters", type=int, default=100)
    p.add_argument("--lr-decay-iters", type=int, default=2000)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--eval-interval", type=int, default=0, help="iterations between evaluations (0: none)")
    p.add_argument("--eval-iters", type=positive, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: the cores shared out)")
    p.add_argument("--compression", choices=["none", "fp16", "bf16", "powersgd"], default="none",
                   help="hpctrain.dist: the gradients' type on the wire (powersgd: rank-4 factors from step 100, "
                        "the program's defaults)")
    p.add_argument("--wait-mode", choices=["auto", "nap", "spin"], default="auto",
                   help="hpctrain.dist.init's wait_mode: nap where ranks outnumber cores (auto), or always, or never")
    p.add_argument("--metrics", default=None, help="rank 0's per-iteration loss and time, JSON Lines")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} does not split into --n-head {args.n_head} heads")
    return args


def mpi_world():
    """This rank, the world's size and this node's ranks, from the MPI job
    mpirun started (for --ddp and --alone, which do not call hvd.init)."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_size = node.size
    node.Free()
    return comm.rank, comm.size, local_size


def ddp_setup():
    """torch.distributed over gloo in a job mpirun started: rank 0's free
    loopback port to every rank (an int array, no pickle)."""
    import torch.distributed as dist
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    port = np.zeros(1, np.int64)
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    comm.Bcast(port, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(int(port[0]))
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    return mpi_world()


def main(argv=None):
    """The loop; returns this rank's loss at each iteration."""
    args = arguments(argv)
    if args.ddp:
        rank, world, local_size = ddp_setup()
    elif args.alone:
        rank, world, local_size = mpi_world()
    else:
        import hpctrain.dist as hvd
        hvd.init(wait_mode=args.wait_mode)                                              # hvd 1: init
        rank, world, local_size = hvd.rank(), hvd.size(), hvd.local_size()
    master_process = rank == 0
    # hvd 2, "pin the device": a GPU would be torch.cuda.set_device(hvd.local_rank());
    # on CPUs, each rank its share of this node's cores
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_size))
    torch.manual_seed(args.seed)

    # ------------------------------------------------------------------------------
    # data: the text as characters, 90% to train; each rank its own batches
    text = open(args.data, encoding="utf-8").read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.int64)
    n = int(0.9 * len(ids))
    splits = {"train": torch.from_numpy(ids[:n]), "val": torch.from_numpy(ids[n:])}
    batches = torch.Generator().manual_seed(args.seed + rank)

    def get_batch(split):
        data = splits[split]
        ix = torch.randint(len(data) - args.block_size, (args.batch_size,), generator=batches)
        x = torch.stack([data[i:i + args.block_size] for i in ix.tolist()])
        y = torch.stack([data[i + 1:i + 1 + args.block_size] for i in ix.tolist()])
        return x, y

    # ------------------------------------------------------------------------------
    # model and optimizer, as nanoGPT's model.py makes them
    vocab = len(chars)
    model = build(vocab, args.block_size, args.n_layer, args.n_head, args.n_embd)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.zeros_(p)
        elif "ln" in name:
            torch.nn.init.ones_(p)
        elif name.endswith(("c_proj.weight", "mlp.2.weight")):   # GPT-2's scaled residual projections
            torch.nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * args.n_layer))
        else:
            torch.nn.init.normal_(p, 0.0, 0.02)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # Horovod's recipe: the learning rate grows with the workers (the global batch does)
    learning_rate, min_lr = args.learning_rate * world, args.min_lr * world               # hvd 3: scale the lr
    optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.99))
    if args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.alone:
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()   # the ranks' loops start together, as the others' first exchange makes them
    else:
        compression = getattr(hvd.Compression, args.compression)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),  # hvd 4
                                             compression=compression)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)                     # hvd 5: same start
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def get_lr(it):
        """Linear warm-up, then cosine down to min_lr (nanoGPT's)."""
        if it < args.warmup_iters:
            return learning_rate * (it + 1) / (args.warmup_iters + 1)
        if it > args.lr_decay_iters:
            return min_lr
        ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {}
        for split in splits:
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                x, y = get_batch(split)
                losses[k] = F.cross_entropy(model(x).view(-1, vocab), y.view(-1)).item()
            out[split] = losses.mean().item()
        model.train()
        return out

    # ------------------------------------------------------------------------------
    # the loop
    metrics = open(args.metrics, "w") if master_process and args.metrics else None
    times, losses = [], []
    model.train()
    for it in range(args.max_iters):
        if args.eval_interval and it % args.eval_interval == 0 and master_process:
            losses = estimate_loss()
            print(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        t0 = time.perf_counter()
        x, y = get_batch("train")
        loss = F.cross_entropy(model(x).view(-1, vocab), y.view(-1))
        loss.backward()
        if args.grad_clip:
            if not (args.ddp or args.alone):
                optimizer.synchronize()   # the averaged gradients, before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        with nullcontext() if args.ddp or args.alone or not args.grad_clip else optimizer.skip_synchronize():
            optimizer.step()
        # flush the gradients as soon as we can, no need for this memory anymore
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item()
        times.append(time.perf_counter() - t0)
        losses.append(lossf)
        if master_process:
            print(f"iter {it}: loss {lossf:.4f}, time {times[-1] * 1000:.2f}ms", flush=True)
            if metrics:
                metrics.write(json.dumps({"step": it, "loss": lossf, "time_s": times[-1]}) + "\n")
    if metrics:
        step = float(np.median(times[len(times) // 5:]))
        mode = "ddp" if args.ddp else "alone" if args.alone else "hpctrain.dist"
        metrics.write(json.dumps({"event": "final", "mode": mode,
                                  "world_size": world, "steps": args.max_iters, "step_median_s": step,
                                  "tokens_per_s": world * args.batch_size * args.block_size / step}) + "\n")
        metrics.close()
    if args.ddp:
        torch.distributed.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
