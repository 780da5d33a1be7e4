"""Ring mode's --zero 3 outside the step: no rank holds the whole model.
`ShardedModel`: the model for the report and the frame
(report/evaluated.py's interface), collective: each evaluation runs
forward on every rank in step, the store gathering each bucket as its
layers run (so every rank evaluates the same batches: the chief's share
alone would leave the gathers unmatched); finiteness, --save and
--keep-best are report/evaluated.Evaluated's, over the layout's parts, and
checkpoints are each rank's own parts (loops/ring.py, state/layouts.py).

    mpirun -n 4 python -m hpctrain.train --zero 3 --checkpoint-dir ckpt --steps 20 --save p.h5
"""
from ..base import device
from ..comm.device_buffers import bcast
from ..data.splits import held_out
from ..report.evaluated import Evaluated


class ShardedModel(Evaluated):
    """--zero 3's model for the report and the frame, collective over comm
    (the workers: every rank). model: the ring's (nn/sequential.Sequential
    over nn/sharded_store.ShardedStore); parts: the layout's (state/layouts.ring)."""

    def __init__(self, world, plan, model, parts, comm):
        super().__init__(world, plan, model.spec, parts, comm)
        self.model = model
        self._full = {}   # split -> the whole split (uint8), read once

    def share_state(self):
        """The chief's non-trainable state to every rank (report/evaluated.WholeModel's)."""
        if self.model.state.size:
            device.synchronize(self.world.xp)
            with self.world.waiting("model state broadcast", peer=self.world.cluster.chief_rank):
                bcast(self.comm, self.model.state, root=self.world.chief_in(self.comm))

    def evaluate(self, split="test"):
        """(loss sum, correct, count) over the whole split, every rank the
        same batches in step, with the chief's non-trainable state (each
        rank's own is put back after)."""
        world, xp, state = self.world, self.world.xp, self.model.state
        if split not in self._full:
            data_dir = self.plan.data.dir
            with world.waiting(f"reading the {split} part of {data_dir}", peer="the file system"):
                self._full[split] = held_out(data_dir, 0, 1, self.plan.data.block_size, split=split,
                                             eval_tokens=self.plan.data.eval_tokens)
        own = state.copy() if state.size else None
        self.share_state()
        x, y = self._full[split]
        sums = self.model.evaluate(xp.asarray(x), xp.asarray(y), forward=self.forward)
        if own is not None:
            state[...] = own
        return sums["loss"], sums.get("correct", 0), sums["count"]

    def evaluate_parts(self, inputs):
        return self.evaluate("test")
