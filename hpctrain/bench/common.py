"""What the benchmarks share: finding mpirun, launching a job and taking it
down with the bench on every exit path, checking rank counts, printing tables."""
import ctypes
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

from ..base.launcher import in_mpi_job
from ..run.cluster import child_env
from ..base.errors import EXIT_TIMEOUT, HpctrainError, signals_raise

# Set by the bench for the jobs it launches, to a value of its own: a rank
# that finds it is one of the bench's ranks (a world of one rank included,
# which no launcher variable tells from a plain process), and the bench finds
# every process of its job by it, wherever mpirun's proxies have put them
# (Hydra starts each proxy and rank in a session of its own).
CHILD = "HPCTRAIN_BENCH_CHILD"
RANKS_PER_CORE = 4
_launches = itertools.count()


def parse_size(text):
    """'4K' -> 4096 (K, M, G suffixes; a ValueError for anything else)."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def is_rank():
    """True in a rank of a benchmark's job (ours, or the user's mpirun)."""
    return bool(os.environ.get(CHILD)) or in_mpi_job()


def check_ranks(counts, oversubscribe_ok=False, least=1, why=""):
    """Refuse rank counts this machine cannot run, in one line."""
    cores = os.cpu_count() or 1
    most = RANKS_PER_CORE * cores
    for n in counts:
        if n < least:
            raise HpctrainError(f"--ranks {n}: at least {least} rank{'s' if least > 1 else ''}{why}")
        if n > most and not oversubscribe_ok:
            raise HpctrainError(f"--ranks {n}: more than {RANKS_PER_CORE} ranks per core on the {cores} cores "
                                f"here ({most}); --oversubscribe-ok runs it anyway (e.g. when "
                                f"HPCTRAIN_MPIRUN_ARGS spreads the ranks over several hosts)")


class Stopped(HpctrainError):
    """SIGTERM, SIGINT or SIGHUP: the bench and its job end (128 + the signal, as shells report it)."""

    def __init__(self, signum):
        super().__init__(f"stopped by {signal.Signals(signum).name}; its MPI job was taken down",
                         exit_code=128 + signum)


def stopping_on_signals():
    """SIGTERM, SIGINT and SIGHUP raise Stopped, so that every `finally` (the
    job's take-down, temporary folders) runs; a second signal is ignored,
    not to cut that short; the previous handlers come back after
    (errors.signals_raise, every one-process command's way)."""
    return signals_raise(Stopped)


def mpirun_path():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else (shutil.which("mpirun") or "mpirun")


def _die_with_parent_setup():
    """preexec_fn for mpirun: SIGTERM when the bench dies, even of SIGKILL
    (mpirun then takes its ranks down itself). Linux only; elsewhere nothing."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)   # 1: PR_SET_PDEATHSIG


def launch(ranks, args, timeout=1800, cwd=None):
    """Run `mpirun -n ranks $HPCTRAIN_MPIRUN_ARGS python args...`; returns
    CompletedProcess (text). HPCTRAIN_MPIRUN_ARGS (the variable jobs/env.sh
    reads too) places the ranks, e.g. on several hosts:
    "-launcher ssh -hosts n1:2,n2:2" (docs/clusters.md). However this call
    ends (done, an exception, a signal, its timeout), no process of the job
    is left on this machine. cwd: the job's working directory (python -m
    imports the hpctrain/ found there first)."""
    more = shlex.split(os.environ.get("HPCTRAIN_MPIRUN_ARGS", ""))
    cmd = [mpirun_path(), "-n", str(ranks), *more, sys.executable, *args]
    tag = f"{os.getpid()}.{next(_launches)}.{time.time_ns()}"
    env = dict(child_env(), **{CHILD: tag})
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                          start_new_session=True, preexec_fn=_die_with_parent_setup()) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise HpctrainError(f"mpirun -n {ranks} {' '.join(args)} did not finish in {timeout} s",
                                exit_code=EXIT_TIMEOUT) from None
        finally:
            take_down(proc, tag)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def tagged(tag):
    """Pids of this machine's processes started with CHILD=tag."""
    mark = f"{CHILD}={tag}".encode() + b"\0"
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark in f.read():
                    pids.append(int(name))
        except OSError:   # gone, or not ours to read
            pass
    return pids


def take_down(proc, tag, grace=3.0):
    """mpirun first gets SIGTERM (it ends its ranks, remote ones included);
    whatever of the job is still here after `grace` seconds gets SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + grace
    while (pids := tagged(tag)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def table(rows, columns):
    """A plain-text table: columns = [(header, key, format)]."""
    cells = [[h for h, _, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(k) is None else fmt.format(row[k])) for _, k, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(rows, columns):
    """The same as a markdown table (numbers right-aligned), to paste into docs."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join("-" if row.get(k) is None else fmt.format(row[k]) for _, k, fmt in columns)
                     + " |")
    return "\n".join(lines)


def dump(obj):
    print(json.dumps(obj, indent=1))
