"""hpctrain.dist under a PyTorch loop against PyTorch DDP, in one run:
nanoGPT's loop (examples/torch_nanogpt.py, its CPU recipe: block 64, batch
12 per rank, 4 layers, 4 heads, width 128) over hpctrain.dist, then the
same loop with --ddp (gloo), then with --alone (every rank its own copy,
no exchange at all), interleaved repeat by repeat for each rank count, so
that a shared machine's noise falls on all three alike.

    python -m hpctrain.bench torch --ranks 2,4 --steps 50 --repeats 3
    python -m hpctrain.bench torch --ranks 2 -- --compression bf16      # flags after -- go to the example

Per run the example's own figure: the world's tokens of a step over rank 0's
median step, the first fifth of the steps left out as warm-up. Per rank
count the medians, the ratio hpctrain.dist/DDP of the medians and the range
of the repeats' own ratios, and the ceiling alone/DDP: what the same
compute with no exchange at all does against DDP, the most that any
allreduce, however fast or well hidden, could give over DDP's on these
cores. The example lives in the repository
(examples/), not in an installed package: a pip-installed hpctrain has no
such case, and says so in one line.
"""
import importlib.util
import json
import os
import tempfile

import numpy as np

from ..base.errors import EXIT_BAD_INPUT, HpctrainError
from ..data.manifest import repo_root
from .common import launch, table

EXAMPLE = os.path.join("examples", "torch_nanogpt.py")


def example_path():
    path = repo_root() / EXAMPLE
    if not path.is_file():
        raise HpctrainError(f"bench torch runs {EXAMPLE} of the repository, not found at {path} "
                            f"(a pip-installed hpctrain: run it from a clone)")
    return str(path)


def one_run(ranks, way, steps, extra, tmp):
    """The final record of one run of the example, `way` one of dist, ddp
    (--ddp) and alone (--alone)."""
    metrics = os.path.join(tmp, f"{way}-{ranks}.jsonl")
    args = ["-m", "mpi4py", example_path(), "--max-iters", str(steps), "--metrics", metrics,
            *([f"--{way}"] if way != "dist" else []), *extra]
    r = launch(ranks, args)
    if r.returncode != 0:
        said = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error: ")]
        if r.returncode == EXIT_BAD_INPUT and said:
            raise HpctrainError(said[-1][len("hpctrain: error: "):])
        raise HpctrainError(f"bench torch: mpirun -n {ranks} python {' '.join(args)} failed with exit code "
                            f"{r.returncode}: {r.stderr.strip().splitlines()[-1:] or ''}",
                            exit_code=r.returncode if r.returncode > 0 else 1)
    with open(metrics) as f:
        return [json.loads(line) for line in f][-1]


def main(args, extra):
    if importlib.util.find_spec("torch") is None:   # one line now rather than a traceback from each rank
        raise HpctrainError("bench torch needs torch: pip install 'hpctrain[torch]'")
    example_path()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            ours, ddp, alone = [], [], []
            for _ in range(args.repeats):
                ours.append(one_run(ranks, "dist", args.steps, extra, tmp)["tokens_per_s"])
                ddp.append(one_run(ranks, "ddp", args.steps, extra, tmp)["tokens_per_s"])
                alone.append(one_run(ranks, "alone", args.steps, extra, tmp)["tokens_per_s"])
            rows.append({"ranks": ranks, "hpctrain": float(np.median(ours)), "ddp": float(np.median(ddp)),
                         "alone": float(np.median(alone)),
                         "ratio": float(np.median(ours) / np.median(ddp)),
                         "ceiling": float(np.median(alone) / np.median(ddp)),
                         "ratio_min": min(a / b for a, b in zip(ours, ddp)),
                         "ratio_max": max(a / b for a, b in zip(ours, ddp)),
                         "hpctrain_runs": ours, "ddp_runs": ddp, "alone_runs": alone})
    load = os.getloadavg()
    if args.json:
        print(json.dumps({"bench": "torch", "steps": args.steps, "repeats": args.repeats, "flags": extra,
                          "load_after": load, "rows": rows}))
        return 0
    for r in rows:
        r["range"] = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
    print(f"tokens/s, nanoGPT's CPU loop (examples/torch_nanogpt.py), {args.steps} steps x {args.repeats} "
          f"interleaved repeats (medians), hpctrain.dist against PyTorch DDP (gloo); alone: no exchange, "
          f"each rank its own copy (the ceiling of any allreduce)"
          f"{', flags: ' + ' '.join(extra) if extra else ''}; load average {load[0]:.2f} after")
    print(table(rows, [("ranks", "ranks", "{}"), ("hpctrain.dist", "hpctrain", "{:,.0f}"),
                       ("DDP", "ddp", "{:,.0f}"), ("dist/DDP", "ratio", "{:.2f}"),
                       ("repeats' ratios", "range", "{}"), ("alone", "alone", "{:,.0f}"),
                       ("alone/DDP", "ceiling", "{:.2f}")]))
    return 0
