"""What a run evaluates and saves, as the report and the frame ask for it:
`WholeModel`, a model every worker holds whole (ring and ps mode: the chief
evaluates it and writes its files alone; a shared evaluation splits the
test set over the workers). A pipeline's stages hold parts of the model and
do each of these together (pipeline/whole.Pipelined, `collective`: every
rank takes part in each call).

The interface: `collective`; `finite()` (every parameter finite);
`share_state()` (the chief's non-trainable state to every worker before a
shared evaluation); `evaluate(split)` (loss sum, correct, count over the
whole test set or "val" part); `evaluate_parts(inputs)` (the same, each
worker its part, summed over all); `write(path, step, attrs)` (--save,
--keep-best; OSError where it cannot).

    mpirun -n 2 python -m hpctrain.mnist --steps 100 --eval-every 50 --save p.h5
"""
import numpy as np
from mpi4py import MPI

from .. import device
from ..data.splits import held_out
from ..comm.device_buffers import bcast
from .params import write_params


class WholeModel:
    collective = False

    def __init__(self, world, plan, model):
        self.world, self.plan, self.model = world, plan, model
        self.spec, self.params, self.state = model.spec, model.params, model.state
        self._full = {}   # split -> the whole split (uint8), read once (the chief's)

    def finite(self):
        return device.all_finite(self.model.params)

    def share_state(self):
        """The chief's non-trainable state (batch-norm running statistics) to
        every worker before the evaluation they share. Each worker's own
        statistics follow its own batches; the chief's are the model's (what
        it evaluates alone, checkpoints and saves): DDP's broadcast_buffers,
        once at the end instead of at every step."""
        if not self.model.state.size:
            return
        world = self.world
        device.synchronize(world.xp)
        with world.waiting("model state broadcast", peer=world.cluster.chief_rank):
            bcast(world.cluster.worker_comm, self.model.state, root=0)

    def evaluate(self, split="test"):
        """(loss sum, correct, count) over the whole split, this rank alone."""
        if split not in self._full:
            data_dir = self.plan.data.dir
            with self.world.waiting(f"reading the {split} part of {data_dir}", peer="the file system"):
                self._full[split] = held_out(data_dir, 0, 1, self.plan.data.block_size, split=split,
                                             eval_tokens=self.plan.data.eval_tokens)
        x, y = self._full[split]
        xp = self.world.xp
        sums = self.model.evaluate(xp.asarray(x), xp.asarray(y))
        return sums["loss"], sums.get("correct", 0), sums["count"]

    def evaluate_parts(self, inputs):
        """Every worker its part of the test set (run/inputs.Inputs.test_part), one Allreduce of the sums."""
        world, xp = self.world, self.world.xp
        x, y = inputs.test_part()
        sums = self.model.evaluate(xp.asarray(x), xp.asarray(y))
        totals = np.array([sums["loss"], sums.get("correct", 0), sums["count"]], np.float64)
        with world.waiting("evaluation allreduce", peer=None):
            world.cluster.worker_comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        return totals[0], totals[1], int(totals[2])

    def write(self, path, step, attrs=None):
        write_params(path, self.model, step, self.plan, attrs=attrs)
