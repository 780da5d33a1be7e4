"""The fault table for the issue note: every fault case of tests/faults (and a
few of tests/test_ps.py) run once as a real job, one markdown row each.

    PYTHONPATH=tests/faults:tests .venv/bin/python tests/faults/table.py > faults.md

A plain script, not collected by pytest (no test_ prefix); it asserts
nothing, it reports. Each case runs in its own fresh temporary directory `$T`
(with TMPDIR=$T/tmp for the job), under the venv's mpirun, with the
environment of hpctrain.cluster.child_env(), from the repository root.
Every job gets `--data $S`, shards prepared once from the bundled sample (so
no job prepares data/mnist in the repository). A job still running after
120 s is killed and reported as "hung".

Columns: the command with paths shortened ($T, $S, $R: the repository's
tests/faults, python, mpirun); the exit code; the `hpctrain: error:` lines;
seconds from the launch to the exit (and from the fault, for stops and
signals); what the run left in $T that was not there when it started
("removed:" for what it deleted); every other non-empty stderr line
(warnings, MPI's own lines, tracebacks), shortened.

Takes some 5-8 minutes on 2 busy cores.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

FAULTS = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(FAULTS)
REPO = os.path.dirname(TESTS)
sys.path[:0] = [FAULTS, TESTS, REPO]

from hpctrain import data  # noqa: E402
from hpctrain.run.cluster import child_env
from ranks import Stopped, rank_pid  # noqa: E402

MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
PY = [sys.executable, "-m", "hpctrain.mnist"]
TIMEOUT = 120
SHARDS = None   # set in main(): prepared once, --data of every job


# ---------------------------------------------------------------------------
# running one case

class Run:
    """One case's temporary directory and its measured job."""

    def __init__(self, name):
        self.name = name
        self.T = tempfile.mkdtemp(prefix="fault-")
        os.mkdir(os.path.join(self.T, "tmp"))
        self.cmd, self.rc, self.out, self.err = [], None, "", ""
        self.took, self.after, self.before = None, None, set()
        self.stopped = []

    def p(self, *parts):
        return os.path.join(self.T, *parts)

    def env(self, **extra):
        env = child_env()
        env.update(PYTHONPATH=os.pathsep.join([FAULTS, TESTS, REPO]), TMPDIR=self.p("tmp"))
        env.update(extra)
        return env

    def start(self, cmd, **env):
        """Launch the measured job (the snapshot of $T is taken just before)."""
        self.cmd = [str(c) for c in cmd]
        self.before = tree(self.T)
        self.t0 = time.monotonic()
        return subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env(**env), cwd=REPO, start_new_session=True)

    def finish(self, proc, fault_at=None):
        """Wait for the job (until TIMEOUT from its launch); kill it if it hangs."""
        try:
            self.out, self.err = proc.communicate(timeout=max(1, TIMEOUT - (time.monotonic() - self.t0)))
            self.rc = proc.returncode
        except subprocess.TimeoutExpired:
            self.rc = "hung"
            kill_group(proc)
            out, err = proc.communicate()
            self.out, self.err = self.out + out, self.err + err
        end = time.monotonic()
        self.took = f"{end - self.t0:.1f}"
        if fault_at is not None:
            self.after = f"{end - fault_at:.1f}"
        return self

    def run(self, cmd, **env):
        return self.finish(self.start(cmd, **env))

    def cleanup(self):
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.T, ignore_errors=True)


def kill_group(proc):
    """SIGKILL the job's process group (mpirun and its ranks: its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tree(top):
    """Every path under top, relative to it (directories end in /)."""
    found = set()
    for root, dirs, files in os.walk(top):
        rel = os.path.relpath(root, top)
        for d in dirs:
            found.add(os.path.normpath(os.path.join(rel, d)) + "/")
        for f in files:
            found.add(os.path.normpath(os.path.join(rel, f)))
    return found


def job(n, *flags):
    return [MPIRUN, "-n", n, *PY, "--data", SHARDS, *flags]


def mpmd(*flag_lists):
    cmd = [MPIRUN]
    for i, flags in enumerate(flag_lists):
        cmd += ([":"] if i else []) + ["-n", 1, *PY, "--data", SHARDS, *flags]
    return cmd


def edited_shards(dst, edit):
    shutil.copytree(SHARDS, dst)
    manifest = json.loads((open(os.path.join(dst, data.MANIFEST)).read()))
    edit(manifest)
    with open(os.path.join(dst, data.MANIFEST), "w") as f:
        json.dump(manifest, f)
    return dst


# ---------------------------------------------------------------------------
# the cases: each takes a Run and leaves its result in it

def prepare_onto_its_source(r):
    shutil.copytree(data.bundled_sample_dir(), r.p("raw"), ignore=shutil.ignore_patterns("README.md"))
    r.run([sys.executable, "-m", "hpctrain.data", "prepare", "--source", r.p("raw"), "--out", r.p("raw"),
           "--force"])


def manifest_outside(r):
    d = edited_shards(r.p("d0"), lambda m: m["train"]["shards"][0].update(file="../elsewhere/train.h5"))
    os.mkdir(r.p("elsewhere"))
    shutil.copy(os.path.join(SHARDS, "train-00000-of-00002.h5"), r.p("elsewhere", "train.h5"))
    r.run([MPIRUN, "-n", 2, *PY, "--data", d, "--steps", 5, "--save", r.p("p.h5")])


def manifest_malformed(r):
    d = edited_shards(r.p("d"), lambda m: m.pop("image_shape"))
    r.run([MPIRUN, "-n", 2, *PY, "--data", d, "--steps", 5, "--save", r.p("p.h5")])


def classes_47(r):
    d = edited_shards(r.p("d"), lambda m: m.update(num_classes=47))
    r.run([MPIRUN, "-n", 2, *PY, "--data", d, "--steps", 5])


def mpmd_bad_flag(r):
    r.run(mpmd(["--steps", 30, "--timeout", 15], ["--steps", 30, "--timeout", 15, "--batch-size", 0]))


def bad_flag(*flags):
    def case(r):
        r.run(job(2, "--steps", 5, *flags, "--save", r.p("p.h5"), "--metrics", r.p("m.jsonl")))
    return case


def bad_output(kind):
    def case(r):
        out = r.p("out")
        os.mkdir(out)
        with open(os.path.join(out, "file"), "w") as f:
            f.write("kept")
        flags = {"dir": ["--save", out],
                 "same": ["--save", r.p("out", "x"), "--metrics", r.p("out", "x")],
                 "file": ["--checkpoint-dir", r.p("out", "file")]}[kind]
        r.run(job(2, "--steps", 100000, *flags))
    return case


def disk_full(with_checkpoint):
    def case(r):
        n, mode = (2, "ring") if with_checkpoint else (3, "ps")
        flags = ["--mode", mode, "--steps", 20, "--log-every", 10, "--save", r.p("p.h5"),
                 "--metrics", r.p("m.jsonl")] + (["--checkpoint-dir", r.p("ckpt")] if with_checkpoint else [])
        r.run([MPIRUN, "-n", n, sys.executable, "-m", "disk_full_on_save", "--data", SHARDS, *flags])
    return case


def stopped_at_launch(r):
    proc = r.start(job(2, "--steps", 300, "--timeout", 5))
    pid = rank_pid(proc, 1, poll=0.005)
    if pid is None:
        r.finish(proc)
        r.err += "\n(table.py: rank 1 not found)"
        return
    r.stopped.append(pid)
    with Stopped(pid):
        r.finish(proc, fault_at=time.monotonic())


def stopped_mid_training(r):
    proc = r.start(job(3, "--steps", 1000000, "--log-every", 1000000, "--hidden", 64, "--timeout", 4))
    pid = rank_pid(proc, 2)
    if pid is None:
        r.finish(proc)
        r.err += "\n(table.py: rank 2 not found)"
        return
    time.sleep(3)
    r.stopped.append(pid)
    with Stopped(pid):
        r.finish(proc, fault_at=time.monotonic())


def fifo_checkpoint_dir(r):
    os.mkdir(r.p("ckpt"))
    os.mkfifo(r.p("ckpt", "ckpt-00000010.h5"))
    return r.p("ckpt")


def hanging_file_system(r):
    r.run(job(2, "--steps", 30, "--hidden", 16, "--timeout", 4, "--checkpoint-dir", fifo_checkpoint_dir(r)))


def sigterm_in_start_up(r):
    proc = r.start(job(2, "--steps", 30, "--hidden", 16, "--timeout", 300,
                       "--checkpoint-dir", fifo_checkpoint_dir(r)))
    if rank_pid(proc, 1) is None:
        r.finish(proc)
        r.err += "\n(table.py: rank 1 not found)"
        return
    time.sleep(4)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)   # Hydra forwards it to every rank
    r.finish(proc, fault_at=t)


def diverging(mode):
    def case(r):
        r.run(job(2 if mode == "ring" else 3, "--mode", mode, "--optimizer", "sgd", "--lr", "1e30", "--steps", 50,
                  "--hidden", 32, "--checkpoint-dir", r.p("ckpt"), "--checkpoint-every", 1, "--save", r.p("p.h5")))
    return case


def different_checkpoint_dirs(r):
    common = ["--steps", 3, "--hidden", 16, "--timeout", 20]
    r.run(mpmd([*common, "--checkpoint-dir", r.p("c0")], [*common, "--checkpoint-dir", r.p("c1")]))


def renamed_checkpoint(r):
    flags = ["--hidden", 64, "--log-every", 10, "--checkpoint-dir", r.p("ckpt"), "--checkpoint-every", 10]
    first = subprocess.run([str(c) for c in job(2, "--steps", 20, *flags)], capture_output=True, text=True,
                           env=r.env(), cwd=REPO, timeout=TIMEOUT)
    if first.returncode != 0:
        r.rc, r.err = f"setup failed ({first.returncode})", first.stderr
        r.took = "-"
        return
    shutil.copytree(r.p("ckpt", "ckpt-00000010"), r.p("ckpt", "ckpt-99999999"))
    r.run(job(2, "--steps", 40, *flags, "--save", r.p("p.h5")))


def ctrl_c(r):
    proc = r.start(job(2, "--steps", 1000000, "--hidden", 64, "--log-every", 20, "--save", r.p("p.h5"),
                       "--metrics", r.p("m.jsonl"), "--checkpoint-dir", r.p("ckpt"), "--checkpoint-every", 10))
    watchdog = threading.Timer(TIMEOUT, kill_group, [proc])   # if no step line ever comes
    watchdog.start()
    try:
        for line in proc.stdout:
            if line.startswith("step "):
                break
    finally:
        watchdog.cancel()
    t = time.monotonic()
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
    r.finish(proc, fault_at=t)
    if t - r.t0 >= TIMEOUT:
        r.rc = "hung"


def async_worker_stopped_for_good(r):
    pids, progress = r.p("pids"), r.p("progress")
    os.mkdir(pids)
    os.mkdir(progress)
    proc = r.start([MPIRUN, "-n", 4, sys.executable, "-m", "inject_ps", "--data", SHARDS, "--mode", "ps",
                    "--async", "--steps", 600, "--log-every", 300, "--timeout", 8, "--metrics", r.p("m.jsonl")],
                   FAULT_PID_DIR=pids, PROBE_PROGRESS=progress, FAULT_STOP_WORKER="2:20")
    pid_file, pid, t = os.path.join(pids, "rank-3.pid"), None, None
    while proc.poll() is None and time.monotonic() - r.t0 < TIMEOUT:
        if pid is None and os.path.exists(pid_file):
            try:
                pid = int(open(pid_file).read())
                r.stopped.append(pid)
            except ValueError:   # being written
                pass
        if pid is not None and is_stopped(pid):
            t = time.monotonic()
            break
        time.sleep(0.05)
    r.finish(proc, fault_at=t)


def is_stopped(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


CASES = [
    ("1. prepare --out is its --source, --force", prepare_onto_its_source),
    ("2. manifest names ../elsewhere/train.h5", manifest_outside),
    ("3. manifest without image_shape", manifest_malformed),
    ("4. data with 47 classes, model with 10 outputs", classes_47),
    ("5. --batch-size 0 on rank 1 only (MPMD)", mpmd_bad_flag),
    ("6a. --lr inf", bad_flag("--lr", "inf")),
    ("6b. --seed -1", bad_flag("--seed", "-1")),
    ("6c. --fusion-mb inf", bad_flag("--fusion-mb", "inf")),
    ("6d. --batch-size 10000000", bad_flag("--batch-size", "10000000")),
    ("6e. --hidden 100000,100000", bad_flag("--hidden", "100000,100000")),
    ("7a. --save is a directory", bad_output("dir")),
    ("7b. --save and --metrics the same file", bad_output("same")),
    ("7c. --checkpoint-dir is a file", bad_output("file")),
    ("8a. --save ENOSPC at the end, with --checkpoint-dir (ring)", disk_full(True)),
    ("8b. --save ENOSPC at the end, no --checkpoint-dir (ps)", disk_full(False)),
    ("9. rank 1 SIGSTOPped at launch, --timeout 5", stopped_at_launch),
    ("10. rank 2 of 3 SIGSTOPped mid-training, --timeout 4", stopped_mid_training),
    ("11. newest checkpoint is a FIFO (hanging file system), --timeout 4", hanging_file_system),
    ("12. SIGTERM to mpirun stuck on the FIFO, --timeout 300", sigterm_in_start_up),
    ("13a. diverging: sgd --lr 1e30, ring", diverging("ring")),
    ("13b. diverging: sgd --lr 1e30, ps", diverging("ps")),
    ("14. ranks with different --checkpoint-dir (MPMD)", different_checkpoint_dirs),
    ("15. renamed copy ckpt-99999999 holding step 10", renamed_checkpoint),
    ("16. Ctrl-C (SIGINT to mpirun) mid-training", ctrl_c),
    ("17. async ps: worker 2 stopped for good, --timeout 8", async_worker_stopped_for_good),
]


# ---------------------------------------------------------------------------
# the table

def shorten(text, r):
    for long, short in ((r.T, "$T"), (SHARDS, "$S"), (FAULTS, "$R"), (MPIRUN, "mpirun"),
                        (sys.executable, "python")):
        text = text.replace(long, short)
    return text


def cell(text):
    return text.replace("|", "\\|").replace("\n", "<br>") or "-"


def row(r):
    lines = [s for s in r.err.splitlines() if s.strip()]
    errors = [s for s in lines if s.startswith("hpctrain: error:")]
    others = [s for s in lines if not s.startswith("hpctrain: error:")]
    if any(s.startswith("Traceback") for s in others):
        others = [s for s in others if s.startswith(("Traceback", "  File")) or not s.startswith(" ")][-6:]
    elif len(others) > 6:
        others = others[:3] + [f"... ({len(others) - 5} more lines)"] + others[-2:]
    after = tree(r.T)
    left = sorted(after - r.before) + [f"removed: {p}" for p in sorted(r.before - after)]
    left = [p for p in left if p != "tmp/"]
    took = r.took if r.after is None else f"{r.took} ({r.after} after the fault)"
    return "| " + " | ".join(cell(shorten(x, r)) for x in (
        r.name, " ".join(r.cmd), str(r.rc), "\n".join(errors), took, ", ".join(left) or "none",
        "\n".join(others))) + " |"


def main():
    global SHARDS
    only = sys.argv[1:]   # optional: case numbers to run ("6a", "12")
    cache = tempfile.mkdtemp(prefix="fault-shards-")
    try:
        SHARDS = os.path.join(cache, "mnist")
        data.prepare(data.bundled_sample_dir(), SHARDS, shards=2, log=None)
        print("| case | command | exit | `hpctrain: error:` line(s) | seconds | files left in $T | "
              "other stderr |")
        print("|---|---|---|---|---|---|---|")
        for name, case in CASES:
            if only and name.split(".")[0] not in only:
                continue
            r = Run(name)
            try:
                case(r)
            except Exception as e:   # a broken case is a row too, not the end of the table
                r.rc, r.err = "table.py failed", r.err + f"\n{type(e).__name__}: {e}"
            print(row(r), flush=True)
            r.cleanup()
        print(f"\n$S: shards prepared from the bundled sample ({os.path.basename(SHARDS)}, 2 shards); "
              f"$T: the case's own temporary directory; $R: tests/faults; TMPDIR=$T/tmp for every job.")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
