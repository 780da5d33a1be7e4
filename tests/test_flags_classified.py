"""Every flag of cli.py is compared between ranks, recorded in checkpoints,
or deliberately local (issue 41: --momentum was none of these, so an MPMD
launch trained each worker with its own and a resume changed it silently).

    python -m pytest -q tests/test_flags_classified.py
"""
import subprocess
import sys

import pytest

from conftest import MPIRUN, REPO
from hpctrain.flags import cli
from hpctrain.checkpoints import read_back as reader
from hpctrain.nn.zoo import spec_for
from hpctrain.run import identity
from hpctrain.run.cluster import child_env

# Flags each rank may set for itself, and why that cannot make ranks train differently.
LOCAL = {
    "data": "compared by its manifest's digest, not its path (run/startup.py), and recorded as data_digest",
    "device": "where this rank computes; the same arithmetic on any device",
    "ps_device": "where a server keeps its slice; the same update",
    "cuda_aware": "how this rank's MPI reads device memory",
    "threads": "this rank's BLAS and numba threads",
    "wait_mode": "how this rank waits for its peers",
    "overlap": "whether this rank's buckets travel during backprop; the same sums",
    "compiled_layers": "agreed by its own Allreduce at start-up (run/startup.py): on only where every rank has numba",
    "config": "read into the other flags before they are parsed (arguments.with_config_file): what it sets is "
              "compared and recorded as theirs, and the merged flags are recorded as `config`",
}


def dests():
    # --help and --help-all print and exit: no setting of a run
    return {a.dest for a in cli.build_parser()._actions if a.dest not in ("help", "help_all")}


def test_every_flag_is_compared_recorded_or_deliberately_local():
    args = cli.parse([])
    compared = set(identity.same_on_every_rank(args))
    recorded = set(identity.recorded(args, 2, 2, spec_for(args, (28, 28), 10)))
    unclassified = sorted(dests() - compared - recorded - set(LOCAL))
    assert not unclassified, (f"flags neither compared between ranks, recorded in checkpoints nor in LOCAL "
                              f"(with a reason): {unclassified}; add each to run/identity.py's RANK_FLAGS "
                              f"(or OUTPUT_FLAGS), or to LOCAL here")
    assert not set(LOCAL) & compared, "a LOCAL flag is compared after all: take it off LOCAL"
    assert set(LOCAL) <= dests(), f"LOCAL names flags cli.py no longer has: {sorted(set(LOCAL) - dests())}"
    assert {"momentum"} <= compared & recorded


def test_momentum_must_match_on_resume_with_the_momentum_optimizer_only():
    spec = spec_for(cli.parse([]), (28, 28), 10)

    def key(*flags):
        return identity.same_on_resume(cli.parse(list(flags)), 2, spec, 100)
    assert key("--optimizer", "momentum", "--momentum", "0.5")["momentum"] == 0.5
    assert "momentum" not in key("--optimizer", "adam", "--momentum", "0.5")


def test_a_checkpoint_from_before_momentum_was_recorded_resumes_unchecked(tmp_path):
    from hpctrain.checkpoints.read_back import Checkpoint
    old = Checkpoint(path=str(tmp_path / "ckpt-00000010.h5"), step=10, optimizer_t=10, params=None,
                     optimizer_state={}, data_positions=None,
                     attrs={"format_version": reader.FORMAT_VERSION, "optimizer": "momentum"})
    reader.check_compatible(old, {"optimizer": "momentum", "momentum": 0.5})
    old.attrs["momentum"] = 0.9
    with pytest.raises(Exception, match="checkpoint was written with --momentum 0.9, this run has --momentum 0.5"):
        reader.check_compatible(old, {"optimizer": "momentum", "momentum": 0.5})


SMALL = ["--steps", "4", "--hidden", "16", "--log-every", "100", "--optimizer", "momentum", "--timeout", "30"]


def errors(r):
    return [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error")]


def test_an_mpmd_launch_with_two_momentums_stops_in_one_line():
    py = [sys.executable, "-m", "hpctrain.mnist", *SMALL]
    r = subprocess.run([MPIRUN, "-n", "1", *py, "--momentum", "0.9", ":", "-n", "1", *py, "--momentum", "0.5"],
                       capture_output=True, text=True, timeout=120, env=child_env(), cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert errors(r) == ["hpctrain: error: ranks disagree on the job: momentum: rank 0 has 0.9, rank 1 has 0.5"], \
        r.stderr


def test_a_resume_with_another_momentum_is_refused_in_one_line(tmp_path, job):
    ckpt = tmp_path / "ckpt"
    r = job(2, *SMALL, "--momentum", "0.9", "--checkpoint-dir", ckpt)
    assert r.returncode == 0, r.stderr
    r = job(2, *SMALL, "--steps", "8", "--momentum", "0.5", "--checkpoint-dir", ckpt, "--save", tmp_path / "p.h5")
    assert r.returncode == 2, r.stderr
    assert len(errors(r)) == 1 and "checkpoint was written with --momentum 0.9, this run has --momentum 0.5" \
        in errors(r)[0], r.stderr
    assert not (tmp_path / "p.h5").exists()


def test_a_long_model_name_is_kept_whole_and_a_checkpoint_with_it_cut_still_resumes(tmp_path):
    # Issue 54, 9: an identity kept a name's last 40 characters ("pt:layers=2,..." in every file and
    # listing); now the whole name, and a checkpoint written before resumes (the digest compares).
    from hpctrain.checkpoints.read_back import Checkpoint
    name = "gpt:layers=2,heads=2,width=8,dropout=0.125"
    spec = spec_for(cli.parse(["--model", name]), (16,), 11)
    assert len(name) > 40 and spec.identity.startswith(name + " "), spec.identity
    digest = spec.identity.rpartition(" ")[2]
    old = Checkpoint(path=str(tmp_path / "ckpt-00000010.h5"), step=10, optimizer_t=10, params=None,
                     optimizer_state={}, data_positions=None,
                     attrs={"format_version": reader.FORMAT_VERSION, "model": f"{name[-40:]} {digest}"})
    reader.check_compatible(old, {"model": spec.identity})
    for other in (f"{name[-39:]} {digest}", f"{name[-40:]} 0123456789ab"):
        old.attrs["model"] = other
        with pytest.raises(Exception, match="checkpoint was written with"):
            reader.check_compatible(old, {"model": spec.identity})
