"""What gradient compression buys on slow links (issue 31, docs/ring.md
"Compression"): on the simulated cluster, 2 nodes x 2 ranks, links shaped
to RATE (default 1gbit), a wide MLP (--hidden 4096,4096: 20,037,642
parameters, 80.15 MB of float32 gradients) trained with --allreduce hier
and each --compression, the same samples per step (4 x B):

  none      float32; --shard-optimizer auto is on here (the same bytes)
  fp16      16-bit words across the nodes, float32 inside them
  bf16      the same words, bfloat16
  powersgd  rank 4 from step 0 (--powersgd-start 0, so the figures'
            window is compressed)
  zero2, zero2-bf16  --zero 2 (the gradient sharded too: the same bytes
            as none), alone and with bf16; not run by default
  zero3, zero3-bf16, zero1-overlap  --zero 3 with --overlap on (its
            gathers prefetched on the communication thread), alone and
            with bf16, and stage 1 with --overlap on beside them; not run
            by default
  tp2       --tensor-parallel 2 (issue 45): each node's 2 ranks one tensor
            group (the Dense pair split column, then row), the replicas
            across the nodes, at the same global batch (2 x B a replica);
            not run by default

Bytes each way per link per step, the arithmetic: hier on 2 nodes carries
2(M-1)/M = 1 x what each rank hands its allreduce per step over each
node's link (each of a node's 2 inter-node rings half of it): 4 x (n + 2)
for none (n parameters, the loss and stop slots), 2 x (n + 2) + 8 for
fp16/bf16 (the slots float32), and for PowerSGD the final record's
`sent_bytes_per_step` (the factors P and Q and the uncompressed tensors).

Repeats interleave (none, fp16, bf16, powersgd, none, ...) so a shared,
noisy machine slows all alike; each row is one run. Figures come from the
steady state: the metrics records of steps WARM..STEPS (--log-every 1),
samples/s from their times, bytes per step from the veth counters read as
each record appears (polled every 5 ms from the root namespace). Then the
same runs on one node (mpirun -n 4 on this host, no links): what
compression costs where links are free. The load average is printed with
every run (the machine is shared).

Run as root from the repository root after `make test-serial`:

    MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 .venv/bin/python tests/cluster/bench_compression.py 1gbit

Brings up 3 nodes (hpt-n0 login, hpt-n1, hpt-n2), shapes hpt-n1/2's links,
and takes both down at the end. Env: BENCH_STEPS (30), BENCH_WARM (5),
BENCH_REPEATS (3), BENCH_BATCH (8), BENCH_CASES (none,fp16,bf16,powersgd),
BENCH_ONE_NODE (1; 0 leaves out the one-node runs). About 15 minutes on 2
cores. MPIR_CVAR_CH4_PROGRESS_THROTTLE=1: as in bench_pipeline.py, waiting
ranks yield the cores the others compute on, as on one node.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PYTHON = Path(os.environ.get("HPCTRAIN_PYTHON", REPO / ".venv" / "bin" / "python"))
MPIRUN = PYTHON.parent / "mpirun"
NODES = ("hpt-n1", "hpt-n2")
# The host ends of the nodes' veths: names of this checkout's (names.sh).
VETHS = {node: subprocess.run([str(HERE / "names.sh"), "veth", node], capture_output=True, text=True,
                              check=True).stdout.strip() for node in NODES}
HIDDEN, PARAMS = 4096, 20_037_642
PARAMS_TP2 = 10_041_354   # a tensor rank's slice at --tensor-parallel 2 (the last Dense whole on both)
STEPS = int(os.environ.get("BENCH_STEPS", "30"))
WARM = int(os.environ.get("BENCH_WARM", "5"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
BATCH = int(os.environ.get("BENCH_BATCH", "8"))
COMMON = ("--hidden", f"{HIDDEN},{HIDDEN}", "--batch-size", str(BATCH), "--steps", str(STEPS), "--log-every", "1",
          "--allreduce", "hier")
ALL = {
    "none": (),
    "fp16": ("--compression", "fp16"),
    "bf16": ("--compression", "bf16"),
    "powersgd": ("--compression", "powersgd", "--powersgd-start", "0"),
    # the ZeRO stages against none (stage 1): the same float32 bytes (issue 44)
    "zero2": ("--zero", "2"),
    "zero2-bf16": ("--zero", "2", "--compression", "bf16"),
    # stage 3 (the parameters gathered before use, one bucket ahead with --overlap on): 1.5x the bytes at most
    "zero3": ("--zero", "3", "--overlap", "on"),
    "zero3-bf16": ("--zero", "3", "--overlap", "on", "--compression", "bf16"),
    "zero1-overlap": ("--overlap", "on"),
    # tensor parallelism inside each node, data parallelism across (issue 45)
    "tp2": ("--tensor-parallel", "2", "--batch-size", str(2 * int(os.environ.get("BENCH_BATCH", "8")))),
}
CASES = {name: ALL[name] for name in os.environ.get("BENCH_CASES", "none,fp16,bf16,powersgd").split(",")}
PER_STEP = 4 * BATCH


def must(name, record):
    """Bytes each way per link per step by the arithmetic (hier, 2 nodes)."""
    if name in ("none", "zero2", "zero1-overlap"):
        return 4 * (PARAMS + 2)
    if name == "tp2":   # each tensor rank's 2-rank replica ring sends its whole slice out of its node: 2 a node
        return 2 * 4 * PARAMS_TP2
    if name.startswith("zero3"):
        return None   # the gathers' bytes depend on which buckets stay in their slots: measured only
    if name in ("fp16", "bf16", "zero2-bf16"):
        return 2 * (PARAMS + 2) + 8
    return record["sent_bytes_per_step"]


def loadavg():
    return Path("/proc/loadavg").read_text().split()[:3]


def link_bytes():
    """(out of hpt-n1, into hpt-n1, out of hpt-n2, into hpt-n2): the host end
    of a veth receives what its node sends."""
    out = []
    for node in NODES:
        stats = Path(f"/sys/class/net/{VETHS[node]}/statistics")
        out += [int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())]
    return out


def launch(across, flags, metrics, log):
    argv = [str(PYTHON), "-m", "hpctrain.mnist", *COMMON, *flags, "--metrics", str(metrics)]
    if across:
        argv = [str(HERE / "on.sh"), "hpt-n0", str(MPIRUN), "-launcher", "ssh", "-launcher-exec",
                str(HERE / "fake-ssh"), "-hosts", "hpt-n1:2,hpt-n2:2", "-n", "4", *argv]
    else:
        argv = [str(MPIRUN), "-n", "4", *argv]
    return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def one_run(across, name, tmp, index):
    """Steady-state samples/s and bytes per step (per node and direction) of one run."""
    metrics, out = Path(tmp, f"{name}-{index}.jsonl"), Path(tmp, f"{name}-{index}.out")
    marks, done, load = {}, 0, loadavg()
    with open(out, "w") as log:
        proc = launch(across, CASES[name], metrics, log)
        while proc.poll() is None:
            time.sleep(0.005)
            if not metrics.exists():
                continue
            text = metrics.read_text()
            lines = text[:text.rfind("\n") + 1].splitlines()
            for line in lines[done:]:
                record = json.loads(line)
                if "step" in record and "event" not in record:
                    marks[record["step"]] = (record["time_s"], link_bytes() if across else None)
            done = len(lines)
    if proc.returncode != 0:
        sys.exit(f"{name} run failed (exit {proc.returncode}):\n{out.read_text()[-3000:]}")
    final = json.loads(metrics.read_text().splitlines()[-1])
    (t0, c0), (t1, c1) = marks[WARM], marks[STEPS]
    steps = STEPS - WARM
    per_link = [(b - a) / steps for a, b in zip(c0, c1)] if across else None
    return {"samples_per_s": steps * PER_STEP / (t1 - t0), "step_s": (t1 - t0) / steps, "per_link": per_link,
            "must": must(name, final), "load": load + loadavg()[:1]}


def bench(across, what):
    throttle = os.environ.get("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "unset")
    print(f"\n== {what}: {STEPS} steps, steady state over steps {WARM}..{STEPS}, {REPEATS} interleaved repeats, "
          f"--hidden {HIDDEN},{HIDDEN} --allreduce hier, batch {BATCH} ({PER_STEP} samples/step), "
          f"MPIR_CVAR_CH4_PROGRESS_THROTTLE {throttle}; load average {' '.join(loadavg())}")
    for name, flags in CASES.items():
        print(f"   {name}: {' '.join(flags) or '(no --compression)'}")
    runs = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(REPEATS):
            for name in CASES:
                r = one_run(across, name, tmp, i)
                runs[name].append(r)
                row = (f"   run {i + 1} {name:8}: {r['samples_per_s']:7.1f} samples/s, {r['step_s'] * 1e3:7.1f} ms/step; "
                       f"load {'/'.join(r['load'][:1])} -> {r['load'][3]}")
                if across:
                    m = r["must"]
                    row += ("; MB/step out of, into hpt-n1: {:.2f}, {:.2f}; hpt-n2: {:.2f}, {:.2f}".format(
                        *(b / 1e6 for b in r["per_link"]))
                        + (f" (must {m / 1e6:.2f}: x{min(r['per_link']) / m:.3f}..{max(r['per_link']) / m:.3f})"
                           if m else ""))
                print(row, flush=True)
    med = {name: statistics.median(r["samples_per_s"] for r in rs) for name, rs in runs.items()}
    if "none" in runs:
        for name in CASES:
            if name == "none":
                continue
            pairs = [c["samples_per_s"] / n["samples_per_s"] for n, c in zip(runs["none"], runs[name])]
            print(f"   median samples/s: none {med['none']:.1f}, {name} {med[name]:.1f}: x{med[name] / med['none']:.2f}"
                  f" (per interleaved pair: {', '.join(f'{x:.2f}' for x in pairs)})")
    print(f"   load average at the end: {' '.join(loadavg())}", flush=True)


def sh(*argv):
    subprocess.run([str(a) for a in argv], check=True, cwd=REPO)


def main():
    rate = sys.argv[1] if len(sys.argv) > 1 else "1gbit"
    try:
        sh(HERE / "netns.sh", "up", "3")
        sh(HERE / "shape.sh", rate)
        bench(True, f"2 nodes x 2 ranks, links shaped to {rate}")
    finally:
        subprocess.run([str(HERE / "shape.sh"), "off"], cwd=REPO)
        subprocess.run([str(HERE / "netns.sh"), "down"], cwd=REPO)
    if os.environ.get("BENCH_ONE_NODE", "1") != "0":
        bench(False, "1 node x 4 ranks (this host, shared memory, no links)")


if __name__ == "__main__":
    main()
