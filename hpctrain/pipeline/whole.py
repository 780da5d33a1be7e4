"""A pipeline's model as the run's outputs see it, held by no rank whole: each
stage holds its slice of the parameters, the model state and the optimizer
state (the stages' slices lie in stage order, pipeline/stages.py `ranges`).
What needs the whole model goes a stage at a time:

- checkpoints (`save_checkpoint`): ring mode's one file, written by the
  chief a dataset at a time and each dataset a stage at a time (stage 0's
  slice its own, then each stage's from its replica 0, received as the file
  takes it: checkpoints/file.Pieces), so the chief holds one stage's slice
  of one buffer at once; a sharded optimizer's parts are first gathered on
  the stage's replica 0;
- evaluations (`Pipelined.evaluate`): forward-only batches through the
  stages, each replica its part of the test set (or val part), the last
  stage counting loss and accuracy, one world Allreduce of the sums;
  finiteness, --save and --keep-best are report/evaluated.Evaluated's,
  over the stage's parts (state/layouts.pipeline), and so is a resume
  (loops/pipe.py, state/consumers.py).

With --tensor-parallel each stage's ranks hold slices of its layers: its
replica 0's tensor ranks gather theirs on tensor rank 0, which goes
between the whole model's slice and the chief (`WholeSlices`), so the file
holds whole tensors whatever the layout.

Transfers to and from the chief go along replica 0's pipe communicator
(the chief is world rank 0: stage 0, replica 0, tensor rank 0), blocking sends and receives
in one fixed order that both ends follow, each under the watchdog; a chief
that fails to write still takes every piece (`drain`), so no sender is left
waiting. Takes the grid's communicators; imports mpi4py only for the
constants of its two world Allreduces (IN_PLACE, MIN and SUM).

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --checkpoint-dir ckpt --steps 20
"""
import numpy as np

from .. import device
from ..checkpoints.file import Pieces
from ..checkpoints.sharded import ShardedState
from ..comm.tensor_group import gather_whole
from ..errors import HpctrainError
from ..report.evaluated import Evaluated
from . import stage_compression as pipeline_compression
from .stages import ranges

TAG = 31000          # checkpoint, --save and resume pieces, on the pipe communicator (engine.py: 31001)


class Layouts:
    """Where each stage's slices lie in the whole flat buffers: (counts,
    displacements) (a tensor-parallel spec's: the whole model's)."""

    def __init__(self, spec, cuts):
        spec = spec.full
        self.params, self.state = spans(spec, cuts), spans(spec, cuts, of="state")


class WholeSlices:
    """--tensor-parallel: this stage's chunks' slices of its (split) buffers
    as slices of the whole model's, on the stage's tensor rank 0 (a
    checkpoint's); collective over the stage's tensor group (grid.tensor_comm). spec: the
    split spec; chunks: this stage's (pipeline/stage.Stage)."""

    def __init__(self, world, grid, spec, chunks):
        self.world, self.grid, self.full, self.cuts = world, grid, spec.full, spec.cuts
        self.spans = [ranges(spec.full, c.a, c.b) for c in chunks]

    def whole(self, k, local):
        """Chunk k's slice of the whole model from every tensor rank's `local`
        (its slice of the chunk's buffer): on tensor rank 0, None elsewhere."""
        (lo, hi), grid = self.spans[k], self.grid
        return gather_whole(grid.tensor_comm, self.full, self.cuts, local,
                            self.world.waiting("pipeline tensor slices to the stage's tensor rank 0",
                                               peer=grid.world_rank(grid.stage, tensor=0) if grid.tensor else None),
                            lo, hi)


def spans(spec, cuts, of="params"):
    """(counts, displacements) of every stage's slice, in stage order."""
    lohi = [ranges(spec, a, b, of) for a, b in zip(cuts, cuts[1:])]
    return [hi - lo for lo, hi in lohi], [lo for lo, _ in lohi]


# --- the stages' slices to the chief, one at a time ------------------------------

class ToChief:
    """Flat buffers whose slices the stages hold, to the chief chunk by chunk
    (a stage's slice is its chunk's with one chunk a stage; with V, chunk c
    is stage c mod P's local chunk c // P), in the order of `names` (the
    order its file takes them). parts: name -> (layout (counts,
    displacements) over the chunks, this stage's chunks' slices [one per
    local chunk], or None where this rank sends nothing: every replica but
    0). The chief asks `pieces(name)`; every stage's replica 0 but the
    chief's `send()`s. dtype: the stages' buffers' (the run's
    precision.params), what goes between the ranks."""

    def __init__(self, grid, watchdog, names, parts, dtype):
        self.grid, self.watchdog, self.names, self.parts = grid, watchdog, list(names), parts
        self.dtype = np.dtype(dtype)
        self._taken = set()   # (name, chunk) the chief has received

    def pieces(self, name):
        """The chief: chunk 0's slice of `name`, then each other chunk's, its own or as it arrives."""
        P = self.grid.stages
        counts, _ = self.parts[name][0]
        for c in range(len(counts)):
            s, k = c % P, c // P
            if s == 0:
                piece = np.ascontiguousarray(device.to_host(self.parts[name][1][k]), dtype=self.dtype)
            else:
                piece = self._receive(name, s, counts[c])
            self._taken.add((name, c))
            yield piece

    def _receive(self, name, s, count):
        piece = np.empty(count, self.dtype)
        with self.watchdog.waiting(f"pipeline {name} from stage {s} to the chief", peer=self.grid.world_rank(s, 0)):
            self.grid.pipe_comm.Recv(piece, source=s, tag=TAG)
        return piece

    def drain(self):
        """The chief, after a failed write: receive what is still to come (discarded)."""
        P = self.grid.stages
        for name in self.names:
            counts, _ = self.parts[name][0]
            for c in range(len(counts)):
                if c % P and (name, c) not in self._taken:
                    self._receive(name, c % P, counts[c])
                    self._taken.add((name, c))

    def send(self):
        """A stage's replica 0 (not the chief's stage; its tensor rank 0): its chunks' slices, in order."""
        grid = self.grid
        if grid.first or grid.replica != 0 or grid.tensor != 0:
            return
        for name in self.names:
            for slice_ in self.parts[name][1]:
                part = np.ascontiguousarray(device.to_host(slice_), dtype=self.dtype)
                with self.watchdog.waiting(f"pipeline {name} from stage {grid.stage} to the chief",
                                           peer=grid.world_rank(0, 0)):
                    grid.pipe_comm.Send(part, dest=0, tag=TAG)


def all_finite(world, grid, parts):
    """Every stage's `parts` (its chunks' slices) finite, known on every rank (one world Allreduce)."""
    from mpi4py import MPI
    ok = np.array([1 if all(device.all_finite(part) for part in parts) else 0], np.int64)
    with world.waiting("pipeline finiteness allreduce", peer=None):
        world.comm.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
    return bool(ok[0])


# --- checkpoints ----------------------------------------------------------------------

def sent_slices(engine, arrays, slices):
    """What a rank of replica 0 hands ToChief for one buffer (`arrays`: its
    chunks'): the arrays, or with --tensor-parallel (`slices`: WholeSlices)
    the whole model's slices on tensor rank 0, None on the others."""
    if slices is None:
        return arrays
    wholes = [slices.whole(k, a) for k, a in enumerate(arrays)]
    return wholes if engine.grid.tensor == 0 else None


def save_checkpoint(world, checkpoints, engine, layouts, reader, step, slices=None):
    """The chief writes the whole model's checkpoint, the file ring mode
    writes (every stage's parameters, model state and optimizer state, the
    replicas' data positions: the first stage's ranks, one per replica),
    receiving each stage's slice of each buffer as the file takes it.
    slices: --tensor-parallel's WholeSlices (None without)."""
    grid, chunks, optimizers = engine.grid, engine.chunks, engine.optimizers
    if not all_finite(world, grid, [c.params for c in chunks]):   # before any piece moves: every rank stops alike
        from ..errors import EXIT_DIVERGED
        raise HpctrainError(f"the parameters of step {step} are not finite: training diverged (try a lower --lr); "
                            f"no checkpoint written", exit_code=EXIT_DIVERGED, collective=True, report=world.chief)
    # each chunk's whole optimizer state on the stage's replica 0
    states = [stage_optimizer_state(world, grid, optimizer) for optimizer in optimizers]
    mine = grid.replica == 0
    parts = {"params": (layouts.params, sent_slices(engine, [c.params for c in chunks], slices) if mine else None)}
    parts.update({f"optimizer/{name}": (layouts.params, sent_slices(engine, [st[name] for st in states], slices)
                                        if mine else None) for name in states[0]})
    spec_state = sum(layouts.state[0])
    if spec_state:
        parts["model_state"] = (layouts.state, [c.state for c in chunks] if mine and grid.tensor == 0 else None)
    stream = ToChief(grid, world.watchdog, sorted(parts), parts,   # the file's order: checkpoints/file.py
                     chunks[0].params.dtype)
    positions = checkpoints.gather_positions(reader, grid.stage_comm) if grid.first and grid.tensor == 0 else None
    compressed = pipeline_compression.gather(world, grid, engine.compression, layouts) \
        if engine.compression is not None else None   # --compression powersgd's state, whole on the chief
    n = sum(layouts.params[0])
    optimizer_state = {name: Pieces(n, _lazy(stream, f"optimizer/{name}")) for name in sorted(states[0])}
    model_state = Pieces(spec_state, _lazy(stream, "model_state")) if spec_state else None
    checkpoints.save(world.comm, step, Pieces(n, _lazy(stream, "params")), optimizer_state, optimizers[0].t, positions,
                     model_state, senders=stream.send, on_failure=stream.drain, compression=compressed)


def _lazy(stream, name):
    """stream.pieces(name), started only when the file asks for it."""
    yield from stream.pieces(name)


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


# --- the model as the report sees it ----------------------------------------------------

class Pipelined(Evaluated):
    """The pipeline's model for the report and the frame (report/evaluated.py's
    interface), collective: every rank takes part in each call. engine:
    this rank's pipeline/engine.Engine; parts: the layout's (state/layouts.pipeline);
    plan: run/plan.Plan."""

    def __init__(self, world, plan, engine, parts):
        super().__init__(world, plan, plan.spec, parts, world.comm)
        self.engine, self.grid, self.chunks = engine, engine.grid, engine.chunks
        self._parts = {}   # split -> this replica's part (images on the first stage, labels on the last)

    def share_state(self):
        """Nothing to share: each evaluation runs with its stage's replica 0's state (evaluate)."""

    def _part(self, split):
        """This replica's part of `split`: (x or None, y or None, count)."""
        if split not in self._parts:
            from .. import data as data_mod
            from ..data.splits import held_out, held_out_count
            grid, data_dir, block_size = self.grid, self.plan.data.dir, self.plan.data.block_size
            eval_tokens = self.plan.data.eval_tokens
            count = held_out_count(data_mod.load_manifest(data_dir), grid.replica, grid.replicas, block_size, split,
                                   eval_tokens)
            x = y = None
            if grid.first or grid.last:
                with self.world.waiting(f"reading the {split} part of {data_dir}", peer="the file system"):
                    x, y = held_out(data_dir, grid.replica, grid.replicas, block_size, split, eval_tokens)
                x, y = (x if grid.first else None), (y if grid.last else None)
            self._parts[split] = (x, y, count)
        return self._parts[split]

    def evaluate(self, split="test"):
        """(loss sum, correct, count) over the whole split: each replica its
        part, forward only through the stages, with each stage's replica 0's
        non-trainable state (a replica's own is kept and put back)."""
        from mpi4py import MPI
        from ..comm.device_buffers import bcast
        world, grid = self.world, self.grid
        x, y, count = self._part(split)
        own = {}
        for k, stage in enumerate(self.chunks):
            if stage.state.size and grid.replicas > 1:
                own[k] = stage.state.copy()
                device.synchronize(world.xp)
                with world.waiting("model state broadcast over the stage's replicas (evaluation)",
                                   peer=None if grid.replica == 0 else grid.world_rank(grid.stage, 0)):
                    bcast(grid.stage_comm, stage.state, root=0)
        sums = self.engine.evaluate(x, y, count)
        for k, state in own.items():
            self.chunks[k].state[...] = state
        totals = np.array([sums["loss"], sums.get("correct", 0), sums["count"]], np.float64) \
            if grid.last and grid.tensor == 0 \
            else np.zeros(3, np.float64)
        with world.waiting("evaluation allreduce", peer=None):
            world.comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        return totals[0], totals[1], int(totals[2])

    def evaluate_parts(self, inputs):
        return self.evaluate("test")
