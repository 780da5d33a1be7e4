"""A pipeline's model as the run's outputs see it, held by no rank whole: each
stage holds its slice of the parameters, the model state and the optimizer
state (the stages' slices lie in stage order, pipeline/stages.py `ranges`).

- `Layouts`: where each stage's slices lie in the whole flat buffers
  (--compression powersgd's state goes between them and the chief:
  pipeline/stage_compression.py);
- evaluations (`Pipelined.evaluate`): forward-only batches through the
  stages, each replica its part of the test set (or val part), the last
  stage counting loss and accuracy, one world Allreduce of the sums;
  finiteness, --save and --keep-best are report/evaluated.Evaluated's,
  over the stage's parts (state/layouts.pipeline), and so are checkpoints
  and a resume (loops/pipe.py, checkpoints/resume.py: each rank writes and
  reads its own boxes).

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --checkpoint-dir ckpt --steps 20
"""
import numpy as np

from ..base import device
from ..report.evaluated import Evaluated
from .stages import ranges


class Layouts:
    """Where each stage's slices lie in the whole flat buffers: (counts,
    displacements) (a tensor-parallel spec's: the whole model's)."""

    def __init__(self, spec, cuts):
        spec = spec.full
        self.params, self.state = spans(spec, cuts), spans(spec, cuts, of="state")


def spans(spec, cuts, of="params"):
    """(counts, displacements) of every stage's slice, in stage order."""
    lohi = [ranges(spec, a, b, of) for a, b in zip(cuts, cuts[1:])]
    return [hi - lo for lo, hi in lohi], [lo for lo, _ in lohi]


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
        sums = self.engine.evaluate(x, y, count, self.forward)
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
