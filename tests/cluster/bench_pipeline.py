"""Where the pipeline pays (issue 22, docs/pipeline.md, docs/clusters.md): on
the simulated cluster, 2 nodes x 2 ranks, links shaped to RATE (default
1gbit), a wide MLP (--hidden 4096,4096: 20,037,642 parameters, 80.2 MB of
float32 gradients) trained two ways with the same samples per step:

  hier  data parallelism on the 4 ranks: --allreduce hier --batch-size B
        --accumulate-steps 2 (4 x 2 x B samples per step). Each node sends
        2(N-1)/N x G over its link per step for N = 2 nodes, i.e. G = 80.2 MB
        each way (its 2 ranks 40 MB each: every rank's half of the node's
        reduce-scattered sum, in a ring of 2).
  pipe  --pipeline-stages 2 --micro-batches 4 --batch-size B, stage 0
        (ranks 0, 1) on hpt-n1, stage 1 (ranks 2, 3) on hpt-n2 (2 replicas x
        4 x B samples per step). Per step each way over each link: 2 replicas
        x 4 micro-batches x B x 4096 x 4 bytes (activations out of hpt-n1,
        their gradients back); the stages' gradients stay inside the nodes.

Repeats interleave (hier, pipe, hier, pipe, ...) so a shared, noisy machine
slows both alike; each row is one run. Figures come from the steady state:
the metrics records of steps WARM..STEPS (--log-every 1), samples/s from
their times, and bytes per step from the veth counters read as each record
appears (polled every 5 ms from the root namespace). Then the same two runs
on one node (mpirun -n 4 on this host, no links): where it does not pay.

Run as root from the repository root after `make test-serial`:

    .venv/bin/python tests/cluster/bench_pipeline.py 1gbit

Brings up 3 nodes (hpt-n0 login, hpt-n1, hpt-n2), shapes hpt-n1/2's links,
and takes both down at the end. Env: BENCH_STEPS (30), BENCH_WARM (5),
BENCH_REPEATS (3), BENCH_BATCH (32), BENCH_ONE_NODE (1; 0 leaves out the
one-node runs), BENCH_WAIT_MODE (auto; --wait-mode for both runs). About
10 minutes on 2 cores.

Each simulated node believes it has the machine's 2 cores for its 2 ranks,
so hpctrain does not throttle MPI's progress there (cluster.configure_process
does when ranks outnumber cores), and a rank waiting for a neighbour stage
busy-polls the cores the computing ranks need, which a real node's own cores
would not suffer. MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 in the environment (it
reaches every rank) makes waiting ranks yield as on one node, and
BENCH_WAIT_MODE=nap makes the pipeline's waiting stage nap as hpctrain's
auto does on one node (docs/usage.md; the ring's exchanges spin in either
mode); the header says which was run.
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
HIDDEN, PARAMS, MICRO, REPLICAS = 4096, 20_037_642, 4, 2
STEPS = int(os.environ.get("BENCH_STEPS", "30"))
WARM = int(os.environ.get("BENCH_WARM", "5"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
BATCH = int(os.environ.get("BENCH_BATCH", "32"))
WAIT_MODE = os.environ.get("BENCH_WAIT_MODE", "auto")
COMMON = ("--hidden", f"{HIDDEN},{HIDDEN}", "--batch-size", str(BATCH), "--steps", str(STEPS), "--log-every", "1",
          "--wait-mode", WAIT_MODE)
CASES = {
    "hier": (("--allreduce", "hier", "--accumulate-steps", "2"), 4 * 2 * BATCH, 4 * PARAMS),
    "pipe": (("--pipeline-stages", "2", "--micro-batches", str(MICRO)), REPLICAS * MICRO * BATCH,
             REPLICAS * MICRO * BATCH * HIDDEN * 4),
}


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
    flags, per_step, _ = CASES[name]
    metrics, out = Path(tmp, f"{name}-{index}.jsonl"), Path(tmp, f"{name}-{index}.out")
    marks, done = {}, 0
    with open(out, "w") as log:
        proc = launch(across, flags, metrics, log)
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
    (t0, c0), (t1, c1) = marks[WARM], marks[STEPS]
    steps = STEPS - WARM
    per_link = [(b - a) / steps for a, b in zip(c0, c1)] if across else None
    return {"samples_per_s": steps * per_step / (t1 - t0), "step_s": (t1 - t0) / steps, "per_link": per_link}


def bench(across, what):
    throttle = os.environ.get("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "unset")
    print(f"\n== {what}: {STEPS} steps, steady state over steps {WARM}..{STEPS}, "
          f"{REPEATS} interleaved repeats, --hidden {HIDDEN},{HIDDEN}, batch {BATCH}, "
          f"MPIR_CVAR_CH4_PROGRESS_THROTTLE {throttle}, --wait-mode {WAIT_MODE}")
    for name, (flags, per_step, must) in CASES.items():
        print(f"   {name}: {' '.join(flags)} ({per_step} samples/step"
              + (f"; must send {must / 1e6:.2f} MB per step each way per link)" if across else ")"))
    runs = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(REPEATS):
            for name in CASES:
                r = one_run(across, name, tmp, i)
                runs[name].append(r)
                row = f"   run {i + 1} {name}: {r['samples_per_s']:7.1f} samples/s, {r['step_s'] * 1e3:7.1f} ms/step"
                if across:
                    must = CASES[name][2]
                    row += ("; MB/step out of, into hpt-n1: {:.2f}, {:.2f}; hpt-n2: {:.2f}, {:.2f}".format(
                        *(b / 1e6 for b in r["per_link"]))
                        + f" (must {must / 1e6:.2f}: x{min(r['per_link']) / must:.3f}..{max(r['per_link']) / must:.3f})")
                print(row, flush=True)
    med = {name: statistics.median(r["samples_per_s"] for r in rs) for name, rs in runs.items()}
    pairs = [p["samples_per_s"] / h["samples_per_s"] for h, p in zip(runs["hier"], runs["pipe"])]
    print(f"   median samples/s: hier {med['hier']:.1f}, pipe {med['pipe']:.1f}: pipe / hier {med['pipe'] / med['hier']:.2f}"
          f" (per interleaved pair: {', '.join(f'{x:.2f}' for x in pairs)})")


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
