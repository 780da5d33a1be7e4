"""Ring mode's --tensor-parallel T outside the step: every rank holds a
slice of the model (nn/tensor_parallel.py), and every evaluation runs on a
tensor group's ranks together (their layers exchange activations).

- `attach`: the clip norm's tensor pieces (the split layers' collectives
  came with their group: run/startup.tensor_slice).
- `TensorModel`: the model for the report and the frame, collective: each
  replica's tensor group evaluates its part of a split, the sums added
  over the replicas (--zero 3: every rank the whole split, in step with
  its replicas' gathers); finiteness, --save and --keep-best are
  report/evaluated.Evaluated's, over the layout's parts.

Checkpoints hold the whole tensors, each rank writing the boxes of them
its slice holds (state/layouts.ring; loops/ring.py), so a run resumes at
any T, N or stage, or in another mode.

    mpirun -n 4 python -m hpctrain.train --model gpt:layers=2,heads=4,width=64 \\
        --data data/shakespeare --tensor-parallel 2 --checkpoint-dir ckpt --steps 20
"""
import numpy as np
from mpi4py import MPI

from ..comm.grad_norm import TensorNorm
from ..data.splits import held_out
from ..nn.tensor_parallel import counted_ranges
from ..report.evaluated import Evaluated


def attach(world, spec):
    """The clip norm's comm/grad_norm.TensorNorm over the mesh's tensor axis."""
    comm = world.mesh.comm("tensor")
    return TensorNorm(comm.Get_size(), comm.Get_rank(), counted_ranges(spec.full, spec.cuts, spec.tensor.rank), comm)


class TensorModel(Evaluated):
    """--tensor-parallel's model for the report and the frame (report/evaluated.py's
    interface), collective over every rank. model: the ring's, this rank's slice;
    parts: the layout's (state/layouts.ring)."""

    def __init__(self, world, plan, model, ring, parts):
        super().__init__(world, plan, model.spec, parts, world.cluster.worker_comm)
        self.model = model
        # --zero 3: every replica's gathers are collectives over the replicas, so every rank evaluates the
        # whole split in step (the replicas' parts could differ in batches)
        self.whole_split = ring.param_shard is not None
        self._parts = {}   # split -> this replica's part of it (or the whole split), read once

    def share_state(self):
        """Nothing to share: the state (batch-norm statistics) of a split
        model's replicas follows their own batches, as ring mode's do, and
        the chief's is what checkpoints hold."""

    def evaluate(self, split="test"):
        """(loss sum, correct, count) over the whole split: each replica's
        tensor group its contiguous part, in step, the sums added over the replicas."""
        world, mesh, xp = self.world, self.world.mesh, self.world.xp
        if split not in self._parts:
            data_dir = self.plan.data.dir
            with world.waiting(f"reading the {split} part of {data_dir}", peer="the file system"):
                part, parts = (0, 1) if self.whole_split else (mesh.coords.data, mesh.size("data"))
                self._parts[split] = held_out(data_dir, part, parts, self.plan.data.block_size, split=split,
                                               eval_tokens=self.plan.data.eval_tokens)
        x, y = self._parts[split]
        sums = self.model.evaluate(xp.asarray(x), xp.asarray(y), forward=self.forward) if len(y) else \
            self.spec.loss.zero_sums()
        totals = np.array([sums["loss"], sums.get("correct", 0), sums["count"]], np.float64)
        if not self.whole_split:
            with world.waiting("evaluation allreduce", peer=None):
                mesh.comm("data").Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        return totals[0], totals[1], int(totals[2])

    def evaluate_parts(self, inputs):
        return self.evaluate("test")
