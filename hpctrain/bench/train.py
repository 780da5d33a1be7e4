"""Training throughput: runs `python -m hpctrain.mnist` through mpirun for each
rank count, repeats each, and reports the median of the repeats.

    python -m hpctrain.bench train --mode ring --ranks 1,2,4
    python -m hpctrain.bench train --mode ps --ranks 3,4 -- --num-ps 2 --async
    python -m hpctrain.bench train --ranks 2,4 --compare shard-optimizer=off,on
    python -m hpctrain.bench train --ranks 4 --compare zero=1,2,3 -- --data TEXT --model gpt:layers=4 --block-size 128
    python -m hpctrain.bench train --ranks 2,4 --compare tensor-parallel=1,2 -- --data TEXT --model gpt:layers=4
    python -m hpctrain.bench train --ranks 1,2 --plot train.png   # and a picture (hpctrain.plot)
    python -m hpctrain.bench train --mode ps --ranks 4 --versus-ring -- --num-ps 2
    python -m hpctrain.bench train --ranks 1,2 --against b4056b6   # that commit's code interleaved (bench/against.py)

Every configuration does equal work per worker (the same steps of the same
batch per worker). Steady-state figures come from the run's own per-step
timings with the first 10% of steps (warm-up) left out: samples/s = global
batch / median step time; the step splits into compute (forward+backward),
communication not hidden behind backprop, and optimizer (time the step
waited for parameter updates; "hidden" is update time that ran during backprop). Memory: the
largest rank's peak RSS above the interpreter with its imports, against
params + grads + optimizer state + one batch.
"""
import json
import math
import os
import sys
import tempfile

import numpy as np

from ..nn import MNIST_CLASSES, MNIST_SHAPE, mlp
from ..base.errors import EXIT_BAD_INPUT, HpctrainError
from .common import launch, table

STATE_COPIES = {"adam": 2, "momentum": 1, "sgd": 0}


def one_run(ranks, mode, steps, extra, tmp, cwd=None):
    """One job's final record; cwd: a folder holding another hpctrain/ to run (bench/against.py)."""
    metrics = os.path.join(tmp, f"m-{mode}-{ranks}.jsonl")
    args = ["-m", "hpctrain.mnist", "--mode", mode, "--steps", str(steps), "--log-every", str(steps),
            "--metrics", metrics, *extra]
    r = launch(ranks, args, cwd=cwd)
    if r.returncode != 0:
        raise run_failed(ranks, args, r)
    with open(metrics) as f:
        return [json.loads(line) for line in f][-1]


def run_failed(ranks, args, r):
    """The error for a failed run: its own one line where it refused its
    input (exit 2); otherwise its output's tail first, then our line."""
    run = f"mpirun -n {ranks} python {' '.join(args)}"
    lines = r.stderr.splitlines()
    said = [line for line in lines if line.startswith("hpctrain: error: ")]
    if r.returncode == EXIT_BAD_INPUT and said:
        return HpctrainError(f"{said[-1][len('hpctrain: error: '):]} (in: {run})")
    sys.stderr.write("\n".join(lines[-30:]) + "\n")
    return HpctrainError(f"bench run failed with exit code {r.returncode} ({run})", exit_code=r.returncode or 1)


def header(what, flags, extra):
    """The first line of a train table: what ran, the model and the extra flags."""
    model = f"hidden {','.join(map(str, flags.hidden))}" if flags.model == "mlp" else f"--model {flags.model}"
    return (f"train, {what}, {model}, {flags.optimizer}, "
            f"batch {flags.batch_size}/worker" + (f", flags: {' '.join(extra)}" if extra else ""))


def memory_target_mb(hidden, optimizer, batch, model_shape=(MNIST_SHAPE, MNIST_CLASSES)):
    shape, classes = model_shape
    n, inputs = mlp(shape, classes, hidden).num_params, math.prod(shape)
    return 2 * (4 * n * (2 + STATE_COPIES[optimizer]) + batch * (inputs * 4 + 8)) / 2**20


def model_shape(flags):
    """(image shape, classes) of the benched model: --data's manifest, else MNIST's."""
    if not flags.data:
        return MNIST_SHAPE, MNIST_CLASSES
    from ..data import load_manifest, model_shape as shape_of
    return shape_of(load_manifest(flags.data))


def measure(args, extra):
    """One row per rank count: medians over args.repeats runs."""
    rows = []
    from ..flags.cli import parse
    flags = parse(["--mode", args.mode, *extra])
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            runs = [one_run(ranks, args.mode, args.steps, extra, tmp) for _ in range(args.repeats)]
            rows.append(summarise(args.mode, ranks, runs, flags))
    return rows, flags


def summarise(mode, ranks, runs, flags):
    med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]
           if isinstance(runs[0][k], (int, float)) and not isinstance(runs[0][k], bool)}
    step = med.get("step_median_s")
    return {
        "mode": mode, "ranks": ranks, "workers": int(med["workers"]),
        "global_batch": int(med["global_batch"]),
        "samples_per_s": row_rate(dict(runs[0], **med)),
        "loop_samples_per_s": med["samples_per_s"],
        "step_ms": step * 1e3 if step else None,
        "compute_ms": med.get("compute_median_s", 0) * 1e3,
        "wait_ms": med.get("wait_median_s", 0) * 1e3,
        "comm_ms": med.get("comm_exposed_median_s", 0) * 1e3,
        "comm_pct": 100 * med.get("comm_exposed_median_s", 0) / step if step else None,
        "optimizer_ms": med.get("optimizer_exposed_median_s", 0) * 1e3,
        "optimizer_total_ms": med.get("optimizer_total_median_s", 0) * 1e3,
        "optimizer_hidden_ms": (med.get("optimizer_total_median_s", 0)
                                - med.get("optimizer_exposed_median_s", 0)) * 1e3,
        "peak_mb": med.get("peak_rss_mb"),
        "above_base_mb": med.get("peak_rss_above_base_mb"),
        "mem_target_mb": memory_target_mb(flags.hidden, flags.optimizer, flags.batch_size,
                                          model_shape(flags)) if flags.model == "mlp" else None,
        "test_accuracy": med.get("test_accuracy"),
    }


def compare(args):
    """hpctrain ring mode vs the NumPy loop (1 rank) and DDP (each rank count);
    --model NAME (not the MLP): compare_model."""
    if args.model != "mlp":
        return compare_model(args)
    from . import reference
    args.mode = "ring"
    rows, _ = measure(args, [])
    numpy_rate = reference.numpy_loop(args.steps)
    out = []
    for row in rows:
        n = row["ranks"]
        ddp = reference.ddp(n, args.steps)
        out.append({"ranks": n, "hpctrain": row["samples_per_s"], "ddp": ddp,
                    "vs_ddp": row["samples_per_s"] / ddp if ddp else None,
                    "numpy_loop": numpy_rate if n == 1 else None,
                    "vs_numpy": row["samples_per_s"] / numpy_rate if n == 1 else None,
                    "comm_pct": row["comm_pct"], "above_base_mb": row["above_base_mb"],
                    "mem_target_mb": row["mem_target_mb"]})
    if args.json:
        print(json.dumps({"bench": "compare", "steps": args.steps, "rows": out}))
        return 0
    print(f"samples/s, 784-500-500-10, Adam, batch 32 per rank, {args.steps} steps "
          f"(hpctrain: median of {args.repeats} runs; DDP: gloo, 1 thread per rank)")
    print(table(out, [("ranks", "ranks", "{}"), ("hpctrain", "hpctrain", "{:,.0f}"),
                      ("PyTorch DDP", "ddp", "{:,.0f}"), ("hpctrain/DDP", "vs_ddp", "{:.2f}"),
                      ("NumPy loop", "numpy_loop", "{:,.0f}"), ("hpctrain/NumPy", "vs_numpy", "{:.2f}"),
                      ("comm not hidden %", "comm_pct", "{:.1f}"),
                      ("mem above base MB", "above_base_mb", "{:.1f}"), ("2x state MB", "mem_target_mb", "{:.1f}")]))
    return 0


def compare_model(args):
    """A zoo model (--model NAME) or nanoGPT's (--model gpt:...) in
    hpctrain's ring against its torch twin (bench/torch_models.py,
    bench/torch_gpt.py: checked to be the same network first, parameter
    counts and one forward on the same weights), both Adam 1e-4; per rank
    count the repeats interleaved (hpctrain, torch, hpctrain, torch, ...),
    medians and ranges. Both get the same BLAS or torch threads per rank:
    the cores shared out (configure_process). A zoo model: samples/s on
    MNIST's shape, --batch-size per rank (default 32). The GPT: tokens/s on
    the bundled Shakespeare as characters (prepared into a temporary folder;
    torch on random tokens of the same vocabulary), --block-size T,
    --batch-size per rank (default 12: nanoGPT's CPU recipe)."""
    from ..flags.model_names import gpt_options
    options = gpt_options(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        if options:
            bench = gpt_bench(args, options, tmp)
        else:
            bench = zoo_bench(args)
        check = twin_check(args.model, bench["check"])
        rows = [interleaved(args, ranks, bench, tmp) for ranks in args.ranks]
    load = os.getloadavg()
    if args.json:
        print(json.dumps({"bench": "compare", "model": args.model, "steps": args.steps, "repeats": args.repeats,
                          "batch_size": bench["batch"], "block_size": bench.get("block_size"), "unit": bench["unit"],
                          "compiled_layers": args.compiled_layers, "thread_split": args.thread_split,
                          "blas": args.blas, "check": check, "load_after": load, "rows": rows}))
        return 0
    print(f"{bench['unit']}, {bench['what']}, Adam 1e-4, batch {bench['batch']} per rank, {args.steps} steps, "
          f"--compiled-layers {args.compiled_layers}, --blas {args.blas}, {args.repeats} interleaved repeats (medians; "
          f"hpctrain ring against torch{' DDP over gloo' if max(args.ranks) > 1 else ''}, the same threads per rank); "
          f"load average {load[0]:.2f} after")
    print(f"same network: parameters {check['hpctrain_params']:,} = {check['torch_params']:,}; one forward on the "
          f"same weights, max |logit diff| {check['max_logit_diff']:.1e}")
    for r in rows:
        r["h_range"] = f"{r['hpctrain_min']:,.0f}-{r['hpctrain_max']:,.0f}"
        r["t_range"] = f"{r['torch_min']:,.0f}-{r['torch_max']:,.0f}"
    print(table(rows, [("ranks", "ranks", "{}"), ("threads/rank", "threads", "{}"),
                       ("thread split", "thread_split", "{}"),
                       ("hpctrain", "hpctrain", "{:,.0f}"), ("range", "h_range", "{}"),
                       ("PyTorch", "torch", "{:,.0f}"), ("range", "t_range", "{}"),
                       ("hpctrain/PyTorch", "ratio", "{:.2f}"), ("MFU", "mfu", "{:.1%}"),
                       ("PyTorch MFU", "torch_mfu", "{:.1%}"), ("step ms", "step_ms", "{:.2f}"),
                       ("compute ms", "compute_ms", "{:.2f}"), ("comm not hidden ms", "comm_ms", "{:.2f}"),
                       ("optimizer ms", "optimizer_ms", "{:.2f}")]))
    return 0


def zoo_bench(args):
    """compare_model's plan for a zoo model: its check, hpctrain's flags and
    torch's run (samples/s)."""
    from . import torch_models
    batch = args.batch_size or 32
    return {"unit": "samples/s", "what": f"{args.model} on {'x'.join(map(str, MNIST_SHAPE))}", "batch": batch,
            "per_sample": 1, "check": lambda: torch_models.same_model(args.model),
            "flags": ["--model", args.model, "--batch-size", str(batch)],
            "torch": lambda ranks, threads: torch_models.rate(args.model, ranks, args.steps, batch, threads)}


def gpt_bench(args, options, tmp):
    """compare_model's plan for the GPT: the Shakespeare characters prepared
    into tmp (a small held-out part: the final evaluation is not what is
    measured), its check, hpctrain's flags and torch's run (tokens/s)."""
    from . import torch_gpt
    from ..data import bundled_text_path, load_manifest, prepare_text
    data = os.path.join(tmp, "shakespeare")
    prepare_text(bundled_text_path(), data, text="chars", val_fraction=0.002, log=lambda *a: None)
    vocab, block, batch = load_manifest(data)["vocab_size"], args.block_size, args.batch_size or 12
    return {"unit": "tokens/s", "what": f"{args.model}, T {block}, vocabulary {vocab} (Shakespeare characters)",
            "batch": batch, "block_size": block, "per_sample": block,
            "check": lambda: torch_gpt.same_gpt(options, vocab, block),
            "flags": ["--model", args.model, "--data", data, "--block-size", str(block), "--batch-size", str(batch)],
            "torch": lambda ranks, threads: torch_gpt.rate(options, vocab, block, ranks, args.steps, batch, threads)}


def twin_check(model, check):
    """The twin's check run, or one error line: torch missing, or not the same network."""
    try:
        result = check()
    except ImportError:
        raise HpctrainError("compare --model needs torch (a benchmark-only dependency): pip install torch") from None
    if result["hpctrain_params"] != result["torch_params"] or \
            result["max_logit_diff"] > 1e-4 * max(1.0, result["max_logit"]):
        raise HpctrainError(f"the torch twin of {model} is not the same network: {result}")
    return result


def interleaved(args, ranks, bench, tmp):
    """One row of compare_model: hpctrain's runs and torch's, interleaved."""
    from ..run.cluster import cores_available
    from ..flags.cli import parse
    threads = max(1, cores_available() // ranks)
    # at one thread a rank the sample split only cuts the batch (each slice's fixed cost paid for nothing)
    split = ["--thread-split", args.thread_split] if threads > 1 else []
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(one_run(ranks, "ring", args.steps, [*bench["flags"], "--compiled-layers", args.compiled_layers,
                                                        "--blas", args.blas, *split], tmp))
        theirs.append(bench["torch"](ranks, threads))
    row = summarise("ring", ranks, ours, parse(["--model", args.model]))
    rates = [row_rate(r) * bench["per_sample"] for r in ours]
    # MFU (report/mfu.py) of both against the SGEMM hpctrain's runs measured (the same threads a rank):
    # a record's mfu over its samples/s is a sample's FLOPs over the ranks' peak
    per = [r["mfu"] / r["samples_per_s"] for r in ours if r.get("mfu") and r.get("samples_per_s")]
    scale = float(np.median(per)) / bench["per_sample"] if per else None
    return {"ranks": ranks, "threads": threads,
            "thread_split": ours[0]["config"]["thread_split"],   # as the runs took it, not the flag echoed
            "blas": ours[0]["config"]["blas"],
            "hpctrain": float(np.median(rates)),
            "mfu": scale * float(np.median(rates)) if scale else None,
            "torch_mfu": scale * float(np.median(theirs)) if scale else None,
            "hpctrain_min": min(rates), "hpctrain_max": max(rates),
            "torch": float(np.median(theirs)), "torch_min": min(theirs), "torch_max": max(theirs),
            "ratio": float(np.median(rates)) / float(np.median(theirs)),
            "ratios": [a / b for a, b in zip(rates, theirs)],
            "step_ms": row["step_ms"], "compute_ms": row["compute_ms"], "comm_ms": row["comm_ms"],
            "optimizer_ms": row["optimizer_total_ms"]}


def row_rate(run):
    """samples/s of one run's final record: the samples its updates take
    (global_batch, an update's) over its median step, a worker's. Async ps:
    each worker's step is an update of its own, so W updates a step."""
    step = run.get("step_median_s")
    updates = run["workers"] if run.get("sync") is False else 1
    return run["global_batch"] * updates / step if step else run["samples_per_s"]


def compare_settings(args, extra):
    """--compare FLAG=V1,V2,...: for each rank count, runs with `--FLAG V` for
    every value, repeats interleaved (V1, V2, V1, V2, ...) so that a noisy,
    shared machine slows each setting alike; medians per setting, and ratios
    against the first value. Beside them, the Amdahl bound for a change that
    divides the optimizer's work by N: 1 / (1 - f_opt * (1 - 1/N)), f_opt the
    optimizer's share of the first setting's step, from the same run."""
    flag, values = compare_values(args.compare, args.mode, extra)
    from ..flags.cli import parse
    flags = parse(["--mode", args.mode, *extra])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            runs = {v: [] for v in values}
            for _ in range(args.repeats):
                for v in values:
                    runs[v].append(one_run(ranks, args.mode, args.steps,
                                           [*extra, f"--{flag}", v, *same_global_batch(flag, v, values, flags)], tmp))
            base = None
            for v in values:
                row = dict(summarise(args.mode, ranks, runs[v], flags), setting=f"{flag}={v}")
                if base is None:
                    base = row
                    f_opt = (row["optimizer_total_ms"] / row["step_ms"]) if row["step_ms"] else 0.0
                    row["amdahl_bound"] = 1 / (1 - f_opt * (1 - 1 / row["workers"]))
                row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
                row["optimizer_ratio"] = (row["optimizer_total_ms"] / base["optimizer_total_ms"]
                                          if base["optimizer_total_ms"] else None)
                rows.append(row)
    if args.json:
        print(json.dumps({"bench": "train", "mode": args.mode, "steps": args.steps, "repeats": args.repeats,
                          "compare": args.compare, "flags": extra, "rows": rows}))
        return plot(args, rows, f"train, {args.mode} mode, {args.steps} steps, --compare {args.compare}")
    print(header(f"{args.mode} mode, {args.steps} steps x {args.repeats} interleaved repeats", flags, extra))
    print(table(rows, [
        ("ranks", "ranks", "{}"), ("setting", "setting", "{}"), ("samples/s", "samples_per_s", "{:,.0f}"),
        ("x first", "speedup", "{:.2f}"), ("Amdahl bound", "amdahl_bound", "{:.2f}"),
        ("step ms", "step_ms", "{:.3f}"), ("compute ms", "compute_ms", "{:.3f}"),
        ("comm not hidden ms", "comm_ms", "{:.3f}"), ("optimizer ms (all)", "optimizer_total_ms", "{:.3f}"),
        ("optimizer x first", "optimizer_ratio", "{:.2f}"), ("peak MB", "peak_mb", "{:.1f}")]))
    return plot(args, rows, f"train, {args.mode} mode, {args.steps} steps, --compare {args.compare}")


def same_global_batch(flag, value, values, flags):
    """--compare tensor-parallel=1,2,...: each T at the first value's global
    batch (T times the ranks per replica: T times the batch each), so the
    settings train the same samples a step and differ only in the split."""
    if flag != "tensor-parallel":
        return []
    return ["--batch-size", str(flags.batch_size * int(value) // int(values[0]))]


def plot(args, rows, title):
    """--plot: the picture after the figures (matplotlib only imported here)."""
    if args.plot:
        from ..plot import plot_train
        plot_train(rows, args.plot, title)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


# ps-only flags (with their value, or None for a switch): left out of the ring runs
PS_FLAGS = {"--num-ps": 1, "--ps-ranks": 1, "--placement": 1, "--replicas-to-aggregate": 1, "--backup-workers": 1,
            "--max-staleness": 1, "--dc-lambda": 1, "--ps-device": 1, "--sync": 0, "--async": 0}


def ring_flags(extra):
    out, skip = [], 0
    for a in extra:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in PS_FLAGS:
            skip = PS_FLAGS[name] if "=" not in a else 0
            continue
        out.append(a)
    return out


def ring_baseline_flags(extra):
    """The ring that ps is measured against: extra without the ps flags, and
    unsharded unless extra says otherwise (--shard-optimizer auto is on for CPUs)."""
    out = ring_flags(extra)
    if not any(a.split("=", 1)[0] in ("--shard-optimizer", "--zero") for a in out):
        out += ["--shard-optimizer", "off"]
    return out


def server_ms_per_update(runs):
    """The servers' loop time per update (ms, mean over servers, median over runs), by activity."""
    out = {}
    for name in runs[0]["ps_time_s"][0]:
        out[name] = float(np.median([np.mean([t[name] / max(1, u) for t, u in zip(r["ps_time_s"], r["ps_updates"])])
                                     for r in runs])) * 1e3
    out["other"] = out["total"] - sum(v for k, v in out.items() if k != "total")
    return out


def compare_values(spec, mode, extra):
    """--compare FLAG=V1,V2[,...] -> (FLAG, [V1, V2, ...]), or one error line;
    each `--FLAG V` is checked with the other flags before anything runs."""
    from ..flags.cli import parse
    flag, _, values = spec.partition("=")
    values = [v for v in values.split(",") if v]
    if not flag or flag.startswith("-") or len(values) < 2:
        raise HpctrainError(f"--compare {spec}: want FLAG=V1,V2[,...], e.g. shard-optimizer=off,on")
    for v in values:
        try:
            parse(["--mode", mode, *extra, f"--{flag}", v])
        except HpctrainError as e:
            raise HpctrainError(f"--compare {spec}: {e}") from None
    return flag, values


def versus_ring(args, extra):
    """ps against the unsharded ring on the same cores, in one run: for each
    rank count N (ps: N ranks, --num-ps of them servers), ring with the
    N - num_ps worker ranks, ps --sync and ps --async, repeats interleaved;
    medians, ratios to the ring. Equal work per worker: async gets
    workers x --steps updates (one worker's batch each). With --compare
    FLAG=V1,V2: ps sync and async with each value (e.g. ps-exchange=mpi,auto:
    before and after, in one run); x sync is against the sync of that value."""
    from ..flags.cli import parse
    flags = parse(["--mode", "ps", *extra])
    ring_extra = ring_baseline_flags(extra)
    ps_extra = [a for a in extra if a not in ("--sync", "--async")]
    flag, values = compare_values(args.compare, "ps", ps_extra) if args.compare else (None, [None])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            workers = ranks - flags.num_ps
            configs = [("ring", workers, "ring", args.steps, ring_extra)]
            for v in values:
                more, name = ([f"--{flag}", v], f" {flag}={v}") if flag else ([], "")
                configs += [("ps sync" + name, ranks, "ps", args.steps, [*ps_extra, *more, "--sync"]),
                            ("ps async" + name, ranks, "ps", args.steps * workers, [*ps_extra, *more, "--async"])]
            runs = {name: [] for name, *_ in configs}
            for _ in range(args.repeats):
                for name, n, mode, steps, more in configs:
                    runs[name].append(one_run(n, mode, steps, more, tmp))
            base = sync = None
            for name, n, mode, _, _ in configs:
                row = dict(summarise(mode, n, runs[name], flags), setting=name)
                base = base or row
                row["x_ring"] = row["samples_per_s"] / base["samples_per_s"]
                row["loop_x_ring"] = row["loop_samples_per_s"] / base["loop_samples_per_s"]
                if mode == "ps":
                    row["server_ms"] = server_ms_per_update(runs[name])
                    if name.startswith("ps sync"):
                        sync = row
                    row["x_sync"] = row["samples_per_s"] / sync["samples_per_s"]
                rows.append(row)
    if args.json:
        print(json.dumps({"bench": "train", "versus_ring": True, "steps": args.steps, "repeats": args.repeats,
                          "flags": extra, "rows": rows}))
        return 0
    print(header(f"ps vs ring, {args.steps} steps per worker x {args.repeats} interleaved repeats", flags, extra))
    print(table(rows, [
        ("ranks", "ranks", "{}"), ("setting", "setting", "{}"), ("samples/s", "samples_per_s", "{:,.0f}"),
        ("x ring", "x_ring", "{:.2f}"), ("x sync", "x_sync", "{:.2f}"),
        ("loop samples/s", "loop_samples_per_s", "{:,.0f}"), ("loop x ring", "loop_x_ring", "{:.2f}"),
        ("step ms", "step_ms", "{:.3f}"), ("compute ms", "compute_ms", "{:.3f}"),
        ("comm+wait ms", "comm_ms", "{:.3f}")]))
    print("servers, ms per update (mean over servers): "
          + ", ".join(f"{row['setting']}: " + " ".join(f"{k} {v:.3f}" for k, v in row["server_ms"].items())
                      for row in rows if "server_ms" in row))
    return 0


def main(args, extra):
    rows, flags = measure(args, extra)
    title = (f"train, {args.mode} mode, {args.steps} steps x {args.repeats} repeats"
             + (f", {' '.join(extra)}" if extra else ""))
    if args.json:
        print(json.dumps({"bench": "train", "mode": args.mode, "steps": args.steps, "repeats": args.repeats,
                          "flags": extra, "rows": rows}))
        return plot(args, rows, title)
    print(header(f"{args.mode} mode, {args.steps} steps x {args.repeats} repeats", flags, extra))
    print(table(rows, [
        ("ranks", "ranks", "{}"), ("workers", "workers", "{}"), ("samples/s", "samples_per_s", "{:,.0f}"),
        ("loop samples/s", "loop_samples_per_s", "{:,.0f}"), ("step ms", "step_ms", "{:.3f}"),
        ("compute ms", "compute_ms", "{:.3f}"), ("comm not hidden ms", "comm_ms", "{:.3f}"),
        ("% of step", "comm_pct", "{:.1f}"), ("optimizer ms", "optimizer_ms", "{:.3f}"),
        ("(of it hidden)", "optimizer_hidden_ms", "{:.3f}"),
        ("peak MB", "peak_mb", "{:.1f}"), ("above base MB", "above_base_mb", "{:.1f}"),
        ("2x state MB", "mem_target_mb", "{:.1f}")]))
    return plot(args, rows, title)
