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

On top of them, what the pipeline loop (loops/pipe.py) calls: `model_on_chief`
(the whole model built on the chief for an evaluation, or on everyone at the
end), `save_checkpoint` (ring mode's file: parameters, model state, the
optimizer state, a sharded one's parts gathered over the stage's replicas
first, and the replicas' data positions) and `resume_stage` (a checkpoint's
whole buffers back into every stage's slices, whatever cut, P or R wrote it).

The slices' sizes follow from the spec and the cut points, the same on every
rank, so nothing about the layout travels; mpi4py takes the MPI type from
the float32 buffers.

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --checkpoint-dir ckpt --steps 20
"""
import numpy as np

from .. import device
from ..errors import HpctrainError
from ..checkpoints.sharded import ShardedState
from . import compression as pipeline_compression
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


# --- the model whole: the chief's evaluations and checkpoints, a resume ----------

class Layouts:
    """Where each stage's slices lie in the whole flat buffers (py)."""

    def __init__(self, spec, cuts):
        self.params, self.state = spans(spec, cuts), spans(spec, cuts, of="state")


def model_on_chief(world, spec, engine, layouts, everyone=False):
    """The whole model built on the chief (None elsewhere) from every
    stage's slice (engine: this rank's engine.Engine); everyone: on every
    rank (ring mode's end)."""
    grid, stage, watchdog = engine.grid, engine.stage, world.watchdog
    if everyone:
        params = to_everyone(world.comm, grid, stage.params, layouts.params, watchdog, "parameters")
        state = to_everyone(world.comm, grid, stage.state, layouts.state, watchdog, "model state")
    else:
        params = to_chief(grid, stage.params, layouts.params, watchdog, "parameters")
        state = to_chief(grid, stage.state, layouts.state, watchdog, "model state")
        if not world.chief:
            return None
    xp = world.xp
    return spec.build(xp, params=xp.asarray(params), state=xp.asarray(state))


def save_checkpoint(world, checkpoints, engine, layouts, reader, step):
    """The chief writes the whole model's checkpoint, the file ring mode
    writes: every stage's parameters, model state and optimizer state
    gathered into full-length buffers, and the replicas' data positions
    (the first stage's ranks: one per replica)."""
    grid, stage, watchdog = engine.grid, engine.stage, world.watchdog
    params = to_chief(grid, stage.params, layouts.params, watchdog, "parameters")
    state = to_chief(grid, stage.state, layouts.state, watchdog, "model state")
    optimizer = {name: to_chief(grid, array, layouts.params, watchdog, f"optimizer state {name}")
                 for name, array in sorted(stage_optimizer_state(world, grid, engine.optimizer).items())}
    positions = checkpoints.gather_positions(reader, grid.stage_comm) if grid.first else None
    compressed = pipeline_compression.gather(world, grid, engine.compression, layouts) \
        if engine.compression is not None else None   # --compression powersgd's state, whole
    checkpoints.save(world.comm, step, params, optimizer, engine.optimizer.t, positions, state,
                     compression=compressed)   # the chief's


def replicas_state(world, grid, optimizer):
    """A sharded optimizer's parts over the stage's replicas (checkpoints/sharded.py), replica 0 their root."""
    return ShardedState(grid.stage_comm, optimizer, 0, grid.world_rank(grid.stage, 0), world.watchdog, world.xp)


def stage_optimizer_state(world, grid, optimizer):
    """name -> the stage's whole optimizer state on its replica 0 (a sharded
    optimizer's parts gathered there; unsharded: every replica's own)."""
    if getattr(optimizer, "ranges", None) is None:
        return optimizer.state()
    full = replicas_state(world, grid, optimizer).gather()   # {} on the other replicas
    return {name: full.get(name) for name in optimizer.state()}


def resume_stage(world, spec, grid, stage, optimizer, layouts, resume):
    """The checkpoint's whole buffers (the chief's) into every stage's
    slices, the optimizer's step count too: whatever cut and replica count
    wrote it (a ring mode checkpoint as well)."""
    ckpt, watchdog, xp = resume.checkpoint, world.watchdog, world.xp
    if ckpt is not None:
        for what, have, want in (("parameters", ckpt.params.size, spec.num_params),
                                 ("model state", ckpt.model_state.size, spec.num_state)):
            if have != want:   # the model identity was compared: a crafted file
                raise HpctrainError(f"{ckpt.path}: {have} floats of {what}, this model has {want}")
    from_chief(grid, ckpt.params if ckpt else None, stage.params, layouts.params, watchdog, "parameters", xp)
    if spec.num_state:   # collective: every stage alike, with state of its own or not
        from_chief(grid, ckpt.model_state if ckpt else None, stage.state, layouts.state, watchdog, "model state", xp)
    sharded = getattr(optimizer, "ranges", None) is not None
    stage_state = {}
    for name, array in sorted(optimizer.state().items()):
        source = ckpt.optimizer_state[name] if ckpt else None
        if sharded:   # the stage's whole state on its replica 0, then each replica its part
            stage_state[name] = to_stages(grid, source, stage.hi - stage.lo, layouts.params, watchdog,
                                          f"optimizer state {name}")
        else:
            from_chief(grid, source, array, layouts.params, watchdog, f"optimizer state {name}", xp)
    if sharded:
        replicas_state(world, grid, optimizer).scatter(stage_state)
    optimizer.t = resume.optimizer_t
    device.synchronize(xp)
