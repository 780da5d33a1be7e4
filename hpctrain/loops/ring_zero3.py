"""Ring mode's --zero 3 outside the step: no rank holds the whole model,
so whatever needs it goes a bucket at a time, every rank taking part.

- `save_checkpoint`: ring mode's one file, the chief writing each of its
  big datasets (the parameters, each optimizer state array) a bucket at a
  time as the owners' parts arrive (comm/zero3.ShardsToChief, the file's
  checkpoints/file.Pieces); the same file stages 0-2 write, so a run
  resumes on another stage, N or mode.
- `ShardedModel`: the model for the report and the frame
  (report/evaluated.py's interface), collective: each evaluation runs
  forward on every rank in step, the store gathering each bucket as its
  layers run (so every rank evaluates the same batches: the chief's
  share alone would leave the gathers unmatched); finiteness, --save and
  --keep-best are report/evaluated.Evaluated's, over the layout's parts
  (a resume too: loops/ring.py, state/consumers.py).

    mpirun -n 4 python -m hpctrain.train --zero 3 --checkpoint-dir ckpt --steps 20 --save p.h5
"""
import numpy as np
from mpi4py import MPI

from .. import device
from ..checkpoints import powersgd_state as compression_state
from ..checkpoints.file import Pieces
from ..comm.device_buffers import bcast
from ..comm.zero3 import ShardsToChief
from ..data.splits import held_out
from ..errors import EXIT_DIVERGED, HpctrainError
from ..report.evaluated import Evaluated


def all_finite(world, comm, shard):
    """Every rank's parameter shard finite, known on every rank (one Allreduce)."""
    device.synchronize(world.xp)
    ok = np.array([1 if device.all_finite(shard.buf) else 0], np.int64)
    with world.waiting("parameter finiteness allreduce", peer=None):
        comm.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
    return bool(ok[0])


def _stream(world, comm, shard, arrays):
    """Compact arrays in `shard`'s layout to the chief a bucket at a time (comm/zero3.ShardsToChief)."""
    return ShardsToChief(comm, shard, world.watchdog, arrays, world.chief_in(comm), world.cluster.chief_rank,
                         shard.buf.dtype)


def _lazy(stream, name):
    """stream.pieces(name), started only when the file asks for it."""
    yield from stream.pieces(name)


def save_checkpoint(checkpoints, comm, ring, reader, step):
    """Collective over comm: the checkpoint of `step`, written by the chief a bucket at a time."""
    world, shard, optimizer = checkpoints.world, ring.param_shard, ring.optimizer
    if not all_finite(world, comm, shard):   # before any piece moves: every rank stops alike
        raise HpctrainError(f"the parameters of step {step} are not finite: training diverged (try a lower --lr); "
                            f"no checkpoint written", exit_code=EXIT_DIVERGED, collective=True, report=world.chief)
    positions = checkpoints.gather_positions(reader)
    device.synchronize(world.xp)
    arrays = {"params": shard.buf, **{f"optimizer/{name}": a for name, a in optimizer.state().items()}}
    stream = _stream(world, comm, shard, arrays)
    n = optimizer.full_size
    state = {name: Pieces(n, _lazy(stream, f"optimizer/{name}")) for name in optimizer.state()}
    compression = compression_state.gather(world, comm, ring.exchange, ring.error, ring.layout_key)
    checkpoints.save(comm, step, Pieces(n, _lazy(stream, "params")), state, optimizer.t, positions,
                     ring.model.state, senders=stream.send, on_failure=stream.drain, compression=compression)


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
        sums = self.model.evaluate(xp.asarray(x), xp.asarray(y))
        if own is not None:
            state[...] = own
        return sums["loss"], sums.get("correct", 0), sums["count"]

    def evaluate_parts(self, inputs):
        return self.evaluate("test")
