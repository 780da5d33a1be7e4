"""Waiting without taking a core (comm/waits.py): where ranks outnumber
cores (or with --wait-mode nap), a rank that waits for others' work (a
pipeline receive, the loss-and-stop allreduce, a ps round) naps between
polls instead of busy-polling, and the messages and sums are the same as
MPI's blocking calls give.

    .venv/bin/python -m pytest -q tests/test_waits.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_waits.py
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from conftest import MPIRUN, REPO, saved
from hpctrain.comm.waits import Waits
from hpctrain.run.cluster import child_env


def test_a_napping_rank_leaves_the_core_to_the_ones_it_waits_for():
    """Rank 1 waits 1 s for rank 0 in each kind of wait (tests/napping_ranks.py):
    napping, it uses a small part of that second's CPU; MPI's blocking calls
    (MPICH) spin through all of it, which on shared cores is taken from the
    rank that computes. (The spinning run is not made here: under load it
    spins less than 100%, so its figure could prove nothing; the spinning
    waits' results are test_wait_mode_decides_the_naps_and_not_the_numbers's.)"""
    r = subprocess.run([MPIRUN, "-n", "2", sys.executable, os.path.join(REPO, "tests", "napping_ranks.py"), "1"],
                       capture_output=True, text=True, timeout=120, env=child_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    used = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(used) == {"one", "pipeline receive", "loss and stop"}
    for kind, cpu in used.items():
        # 1 s of waiting: a poll every 160 us at most costs ~10% here; spinning costs up to 100% (less under load)
        assert cpu < 0.25, (kind, used)


@pytest.mark.mpi(min_size=2)
def test_waits_allreduce_is_mpis_allreduce_and_nodes_may_differ_in_naps():
    """Each rank's own nap (here every other rank naps) makes the same
    collective calls: the sums are MPI_Allreduce's bits."""
    comm = MPI.COMM_WORLD
    values = np.random.default_rng(comm.rank).standard_normal(5)
    want = values.copy()
    comm.Allreduce(MPI.IN_PLACE, want, op=MPI.SUM)
    got = values.copy()
    Waits(comm.rank % 2 == 0).allreduce(comm, got, MPI.SUM)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("nap", [False, True])
def test_all_and_one_complete_with_or_without_naps(nap):
    comm, waits = MPI.COMM_SELF, Waits(nap)
    out, back = np.arange(4, dtype=np.int64), np.zeros(4, np.int64)
    waits.all([comm.Irecv(back, 0, 3), comm.Isend(out, 0, 3)])
    assert list(back) == [0, 1, 2, 3]
    got = np.zeros(1, np.int64)
    request = comm.Irecv(got, 0, 9)
    comm.Send(np.full(1, 11, np.int64), 0, 9)
    waits.one(request)
    assert got[0] == 11


def test_wait_mode_decides_the_naps_and_not_the_numbers(job, tmp_path):
    """--wait-mode: auto naps with 4 ranks on this machine's 2 cores (the
    chief's start line says so), spin does not; a pipelined run ends with
    the same parameters either way."""
    assert os.cpu_count() < 4, "this test needs more ranks than cores"
    common = ("--pipeline-stages", 2, "--micro-batches", 4, "--hidden", "64,32", "--steps", 12)
    auto = job(4, *common, "--save", tmp_path / "auto.h5")
    spin = job(4, *common, "--wait-mode", "spin", "--save", tmp_path / "spin.h5")
    assert auto.returncode == 0 and spin.returncode == 0, auto.stderr + spin.stderr
    assert "waiting ranks nap" in auto.stdout and "waiting ranks nap" not in spin.stdout, auto.stdout + spin.stdout
    a = saved(tmp_path / "auto.h5")
    b = saved(tmp_path / "spin.h5")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
