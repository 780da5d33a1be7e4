"""Ring mode's --tensor-parallel T outside the step: every rank holds a
slice of the model (nn/tensor_parallel.py), so whatever needs the whole
model gathers the slices, and every evaluation runs on a tensor group's
ranks together (their layers exchange activations).

- `attach`: the tensor group's communicator handed to the split layers
  (comm/tensor_group.TensorComm), and the clip norm's tensor pieces.
- `save_checkpoint`: ring mode's one file with the whole model's tensors
  (the layout is not part of the file): each tensor rank's replica 0
  first gathers its sharded optimizer state over its replicas (--zero 1,
  2), then the chief gathers the T slices over the tensor axis and cuts
  them into the whole tensors; so a run resumes at any T, N or stage, or
  in another mode.
- `TensorModel`: the model for the report and the frame, collective: each
  replica's tensor group evaluates its part of a split, the sums added
  over the replicas (--zero 3: every rank the whole split, in step with
  its replicas' gathers); finiteness, --save and --keep-best are
  report/evaluated.Evaluated's, over the layout's parts (a resume too:
  loops/ring.py, state/consumers.py).

With --zero 3 the replicas hold shards of each slice: a checkpoint first
gathers a tensor rank's slice on its replica 0 a bucket at a time, so
that rank holds its whole slice (1/T of the model) while the file is
written; the chief the whole model, as without --zero 3.

    mpirun -n 4 python -m hpctrain.train --model gpt:layers=2,heads=4,width=64 \\
        --data data/shakespeare --tensor-parallel 2 --checkpoint-dir ckpt --steps 20
"""
import numpy as np
from mpi4py import MPI

from .. import device
from ..checkpoints.sharded import ShardedState
from ..comm.zero3 import ShardsToChief
from ..comm.grad_norm import TensorNorm
from ..comm import tensor_group
from ..comm.tensor_group import TensorComm
from ..data.splits import held_out
from ..nn.tensor_parallel import counted_ranges
from ..report.evaluated import Evaluated


def attach(world, spec):
    """The split layers' collectives on the mesh's tensor axis; returns the
    clip norm's comm/grad_norm.TensorNorm."""
    comm = world.mesh.comm("tensor")
    spec.tensor.comm = TensorComm(comm, world.watchdog, world.xp)
    return TensorNorm(comm.Get_size(), comm.Get_rank(), counted_ranges(spec.full, spec.cuts, spec.tensor.rank), comm)


def gather_whole(world, spec, arrays):
    """Collective over the ranks of replica 0 (data coordinate 0; the others
    return None at once): each tensor rank's full-length host arrays (its
    slice's flat layout) to the chief, which returns them as the whole
    model's flat arrays ({name: array}); None elsewhere."""
    mesh = world.mesh
    if mesh.coords.data:
        return None
    comm = mesh.comm("tensor")
    out = {name: tensor_group.gather_whole(comm, spec.full, spec.cuts, array,
                                           world.waiting(f"tensor slices gather ({name})", peer=None))
           for name, array in arrays.items()}
    return out if spec.tensor.rank == 0 else None


def local_arrays(world, ring, state=True):
    """This rank's parameters (and with `state` its optimizer state) as
    full-length host arrays of its slice's flat layout, {"params": ...,
    "optimizer/NAME": ...}, on its replica 0 (data coordinate 0; {}
    elsewhere where the replicas hold shards): a sharded optimizer's state
    gathered over the replicas (--zero 1, 2), and with --zero 3 the
    parameters too, a bucket at a time (comm/zero3.ShardsToChief). Collective
    over the replicas."""
    optimizer, mesh, shard = ring.optimizer, world.mesh, ring.param_shard
    if shard is not None:
        arrays = {"params": shard.buf, **({f"optimizer/{k}": v for k, v in optimizer.state().items()} if state else {})}
        stream = ShardsToChief(mesh.comm("data"), shard, world.watchdog, arrays, 0, mesh.rank_of(data=0),
                               shard.buf.dtype)
        if mesh.coords.data:
            stream.send()
            return {}
        out = {}
        for name in sorted(arrays):
            full = np.empty(ring.model.spec.num_params, shard.buf.dtype)
            for j, piece in zip(stream.order, stream.pieces(name)):
                lo, hi = shard.buckets[j]
                full[lo:hi] = piece
            out[name] = full
        return out
    out = {"params": device.to_host(ring.model.params)}
    if not state:
        return out
    if not ring.sharded:
        return {**out, **{f"optimizer/{k}": device.to_host(a) for k, a in optimizer.state().items()}}
    owners = ShardedState(mesh.comm("data"), optimizer, 0, mesh.rank_of(data=0), world.watchdog, world.xp)
    return {**out, **{f"optimizer/{k}": v for k, v in owners.gather().items()}}


def save_checkpoint(checkpoints, world, ring, reader, step):
    """Collective over every rank: the checkpoint of `step`, the whole tensors, written by the chief."""
    mesh = world.mesh
    positions = checkpoints.gather_positions(reader, mesh.comm("data")) if mesh.coords.tensor == 0 else None
    device.synchronize(world.xp)
    whole = gather_whole(world, ring.model.spec, local_arrays(world, ring)) or {}
    checkpoints.save(world.cluster.worker_comm, step, whole.get("params"),
                     {k.split("/", 1)[1]: v for k, v in whole.items() if k != "params"}, ring.optimizer.t,
                     positions, ring.model.state)


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
        sums = self.model.evaluate(xp.asarray(x), xp.asarray(y)) if len(y) else self.spec.loss.zero_sums()
        totals = np.array([sums["loss"], sums.get("correct", 0), sums["count"]], np.float64)
        if not self.whole_split:
            with world.waiting("evaluation allreduce", peer=None):
                mesh.comm("data").Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        return totals[0], totals[1], int(totals[2])

    def evaluate_parts(self, inputs):
        return self.evaluate("test")
