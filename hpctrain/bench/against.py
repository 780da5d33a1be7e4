"""Another commit's code against this one, in one run (issue 42: "no step
slower", b4056b6 and main interleaved):

    python -m hpctrain.bench train --ranks 1,2,4 --against b4056b6 --repeats 5 -- --hidden 500,500
    python -m hpctrain.bench train --ranks 2 --against b4056b6 -- --model small_cnn --batch-size 16
    python -m hpctrain.bench train --ranks 2 --against b4056b6 -- --pipeline-stages 2 --micro-batches 4

The commit's hpctrain/ is taken from git (`git archive`, from the repository
this package is in) into a temporary folder, and its jobs run with that folder
as their working directory (`python -m` puts it first on sys.path, so its
package is the one imported). For each rank count every repeat runs the
commit's code, then this code, with the same flags: a shared machine's noise
falls on both alike. Per code the medians (bench train's figures), and the
ratio this/commit of samples/s (above 1: this code is faster), with the range
of the repeats' own ratios. Both read the same --data: this code's default,
prepared here on first use, unless the flags after -- give one.
"""
import json
import os
import subprocess
import tempfile

from ..base.errors import HpctrainError
from .common import table
from .train import header, one_run, row_rate, summarise


def extract(commit, into, repo=None):
    """`commit`'s hpctrain/ package, unpacked under the folder `into`, from
    the git repository at `repo` (default: the one holding this package);
    one error line if git, the repository or the commit is missing."""
    from ..data.manifest import repo_root
    repo = str(repo or repo_root())
    try:
        found = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                               capture_output=True, text=True)
    except FileNotFoundError:
        raise HpctrainError(f"{commit}: needs git (not found on PATH)") from None
    if found.returncode:
        raise HpctrainError(f"{commit}: not a commit of the git repository at {repo} "
                            f"(a shallow clone, or not a clone at all?)")
    archive = subprocess.run(["git", "-C", repo, "archive", found.stdout.strip(), "hpctrain"], capture_output=True)
    if archive.returncode:
        raise HpctrainError(f"{commit}: git archive of its hpctrain/ failed: "
                            f"{archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return str(into)


def with_data(extra):
    """extra with --data: this code's default (prepared on first use) unless
    given, so that the commit's code, run from elsewhere, reads the same shards."""
    if any(a == "--data" or a.startswith("--data=") for a in extra):
        return extra
    from .. import data
    where = data.default_data_dir()
    if not data.is_prepared(where):
        data.prepare(data.bundled_sample_dir(), where, log=None)
    return [*extra, "--data", str(where)]


def against(args, extra):
    """bench train --against COMMIT: rows per rank count, the commit's then this code's."""
    if args.compare or args.versus_ring:
        raise HpctrainError("--against: not with --compare or --versus-ring (one comparison a run)")
    from ..flags.cli import parse
    flags = parse(["--mode", args.mode, *extra])
    both = with_data(extra)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old_code = os.path.join(tmp, "code")
        os.mkdir(old_code)
        try:
            extract(args.against, old_code)
        except HpctrainError as e:
            raise HpctrainError(f"--against {e}") from None
        for ranks in args.ranks:
            old, new = [], []
            for _ in range(args.repeats):
                old.append(one_run(ranks, args.mode, args.steps, both, tmp, cwd=old_code))
                new.append(one_run(ranks, args.mode, args.steps, both, tmp))
            rows += pair(args, ranks, old, new, flags)
    return report(args, rows, flags, extra)


def pair(args, ranks, old, new, flags):
    """The two rows of one rank count: medians per code; on this code's,
    samples/s this/commit and the range of the repeats' own ratios."""
    ratios = [row_rate(b) / row_rate(a) for a, b in zip(old, new)]
    before = dict(summarise(args.mode, ranks, old, flags), code=args.against)
    after = dict(summarise(args.mode, ranks, new, flags), code="this", ratio_min=min(ratios), ratio_max=max(ratios))
    after["x_commit"] = after["samples_per_s"] / before["samples_per_s"]
    return [before, after]


def report(args, rows, flags, extra):
    if args.json:
        print(json.dumps({"bench": "train", "mode": args.mode, "steps": args.steps, "repeats": args.repeats,
                          "against": args.against, "flags": extra, "rows": rows}))
        return 0
    for row in rows:
        if "x_commit" in row:
            row["range"] = f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f}"
    print(header(f"{args.mode} mode, {args.steps} steps x {args.repeats} interleaved repeats, "
                 f"this code against {args.against}", flags, extra))
    print(table(rows, [
        ("ranks", "ranks", "{}"), ("code", "code", "{}"), ("samples/s", "samples_per_s", "{:,.0f}"),
        ("this/commit", "x_commit", "{:.3f}"), ("repeats' ratios", "range", "{}"),
        ("step ms", "step_ms", "{:.3f}"), ("compute ms", "compute_ms", "{:.3f}"),
        ("comm not hidden ms", "comm_ms", "{:.3f}"), ("optimizer ms", "optimizer_ms", "{:.3f}"),
        ("peak MB", "peak_mb", "{:.1f}")]))
    return 0
