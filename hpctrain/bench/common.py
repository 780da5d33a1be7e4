"""What the benchmarks share: finding mpirun, launching a job, printing tables."""
import json
import os
import shlex
import shutil
import subprocess
import sys

from ..cluster import child_env


def mpirun_path():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else (shutil.which("mpirun") or "mpirun")


def launch(ranks, args, timeout=1800):
    """Run `mpirun -n ranks $HPCTRAIN_MPIRUN_ARGS python args...`; returns
    CompletedProcess (text). HPCTRAIN_MPIRUN_ARGS (the variable jobs/env.sh
    reads too) places the ranks, e.g. on several hosts:
    "-launcher ssh -hosts n1:2,n2:2" (docs/clusters.md)."""
    more = shlex.split(os.environ.get("HPCTRAIN_MPIRUN_ARGS", ""))
    cmd = [mpirun_path(), "-n", str(ranks), *more, sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())


def table(rows, columns):
    """A plain-text table: columns = [(header, key, format)]."""
    cells = [[h for h, _, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(k) is None else fmt.format(row[k])) for _, k, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def dump(obj):
    print(json.dumps(obj, indent=1))
