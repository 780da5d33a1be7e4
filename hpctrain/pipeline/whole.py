"""A pipeline's flat buffers, whole: each stage holds its slice of the
parameters, the model state and the optimizer state (the stages' slices lie
in stage order, pipeline/stages.py `ranges`); the chief's checkpoints,
evaluations and final record want them whole, and a resumed run gives each
stage its slice back. Takes the grid's communicators; never imports MPI.

- `to_chief`: the stages' replica 0 send their slices to the chief (world
  rank 0, stage 0's replica 0) along replica 0's pipe communicator, one
  Gatherv; the whole buffer on the chief, None elsewhere.
- `to_everyone`: the whole buffer on every rank (Allgatherv over the world of
  each stage's replica 0's slice): ring mode's end, where every worker holds
  the model for the shared test evaluation.
- `to_stages`: the reverse of `to_chief` (a Scatterv along replica 0's pipe
  communicator): each stage's slice on its replica 0; `from_chief` then
  Bcasts it to the stage's other replicas: resume.

The slices' sizes follow from the spec and the cut points, the same on every
rank, so nothing about the layout travels; mpi4py takes the MPI type from
the float32 buffers.

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --checkpoint-dir ckpt --steps 20
"""
import numpy as np

from .. import device
from .stages import ranges


def spans(spec, cuts, of="params"):
    """(counts, displacements) of every stage's slice, in stage order."""
    lohi = [ranges(spec, a, b, of) for a, b in zip(cuts, cuts[1:])]
    return [hi - lo for lo, hi in lohi], [lo for lo, _ in lohi]


def to_chief(grid, part, layout, watchdog, what):
    """The whole buffer (host float32) on world rank 0 from every stage's
    `part` (device or host); None on every other rank."""
    counts, displs = layout
    if grid.replica != 0:
        return None
    mine = np.ascontiguousarray(device.to_host(part), dtype=np.float32)
    whole = np.zeros(sum(counts), np.float32) if grid.first else None
    with watchdog.waiting(f"pipeline gather to the chief ({what})", peer=None if grid.first else grid.world_rank(0)):
        grid.pipe_comm.Gatherv(mine, [whole, (counts, displs)] if grid.first else None, root=0)
    return whole


def to_everyone(comm, grid, part, layout, watchdog, what):
    """The whole buffer (host float32) on every rank of the world `comm`."""
    counts, displs = layout
    mine = np.ascontiguousarray(device.to_host(part), dtype=np.float32) if grid.replica == 0 \
        else np.zeros(0, np.float32)
    world = comm.Get_size()
    # Rank r of the world sends its stage's slice if it is replica 0, else nothing.
    send_counts = [counts[r // grid.replicas] if r % grid.replicas == 0 else 0 for r in range(world)]
    send_displs = [displs[r // grid.replicas] for r in range(world)]
    whole = np.zeros(sum(counts), np.float32)
    with watchdog.waiting(f"pipeline allgather ({what})", peer=None):
        comm.Allgatherv(mine, [whole, (send_counts, send_displs)])
    return whole


def to_stages(grid, whole, n, layout, watchdog, what):
    """Every stage's slice (n floats) of `whole` (host, on world rank 0;
    ignored elsewhere) on its replica 0 (host); None on the other replicas."""
    if grid.replica != 0:
        return None
    counts, displs = layout
    host = np.zeros(n, np.float32)
    send = [np.ascontiguousarray(whole, np.float32), (counts, displs)] if grid.first else None
    with watchdog.waiting(f"pipeline scatter from the chief ({what})", peer=None if grid.first else grid.world_rank(0)):
        grid.pipe_comm.Scatterv(send, host, root=0)
    return host


def from_chief(grid, whole, part, layout, watchdog, what, xp):
    """Every stage's slice of `whole` (host, on world rank 0; ignored
    elsewhere) into `part` on all its replicas."""
    host = to_stages(grid, whole, part.size, layout, watchdog, what)
    if host is None:
        host = np.zeros(part.shape, np.float32)
    with watchdog.waiting(f"pipeline broadcast to the stage's replicas ({what})",
                          peer=None if grid.replica == 0 else grid.world_rank(grid.stage, 0)):
        grid.stage_comm.Bcast(host, root=0)
    part[...] = xp.asarray(host)

