"""Ring mode's --tensor-parallel T outside the step: every rank holds a
slice of the model (nn/tensor_parallel.py), so whatever needs the whole
model gathers the slices, and every evaluation runs on a tensor group's
ranks together (their layers exchange activations).

- `attach`: the clip norm's tensor pieces (the split layers' collectives
  came with their group: run/startup.tensor_slice).
- `save_checkpoint`: ring mode's one file with the whole model's tensors
  (the layout is not part of the file): each tensor rank's replica 0
  first gathers its sharded optimizer state over its replicas (--zero 1,
  2), then the chief gathers the T slices over the tensor axis and cuts
  them into the whole tensors; so a run resumes at any T, N or stage, or
  in another mode.
- `restore`: the chief's whole tensors to every rank, each keeping its
  slice (and its shard of the optimizer state).
- `TensorModel`: the model for the report and the frame, collective: each
  replica's tensor group evaluates its part of a split, the sums added
  over the replicas (--zero 3: every rank the whole split, in step with
  its replicas' gathers); --save and --keep-best the whole tensors,
  written by the chief.

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
from ..data.splits import held_out
from ..nn.tensor_parallel import counted_ranges, take_local
from ..report.params import chief_text, write_params


def attach(world, spec):
    """The clip norm's comm/grad_norm.TensorNorm over the mesh's tensor axis."""
    comm = world.mesh.comm("tensor")
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


def _owned(array, ranges):
    """The parts of a full-length array at `ranges`, back to back (a shard's compact layout)."""
    return np.concatenate([array[lo:hi] for lo, hi in ranges] or [array[:0]])


def restore(world, checkpoints, resume, ring):
    """Collective over every rank: the resumed whole tensors from the chief,
    each rank keeping its slice (and its shard of the optimizer state, and
    with --zero 3 of the parameters)."""
    spec, comm, ckpt = ring.model.spec, world.cluster.worker_comm, resume.checkpoint
    optimizer, t, shard = ring.optimizer, spec.tensor.rank, ring.param_shard
    sources = {"params": ckpt.params if ckpt else None,
               **{name: ckpt.optimizer_state[name] if ckpt else None for name in optimizer.state()}}
    n = spec.full.num_params
    for name, source in sources.items():
        whole = np.zeros(n, ring.model.params.dtype)
        if source is not None:   # a lazily read file's dataset (--zero 3) or an array
            whole[...] = source.read(0, n) if hasattr(source, "read") else source
        with world.waiting(f"checkpoint broadcast ({name})", peer=world.cluster.chief_rank):
            comm.Bcast(whole, root=world.chief_in(comm))
        mine = take_local(spec.full, spec.cuts, whole, t)
        if name == "params":
            if shard is not None:   # --zero 3: the parameters this rank owns
                shard.buf[...] = world.xp.asarray(_owned(mine, shard.ranges).astype(shard.buf.dtype, copy=False))
            else:
                ring.model.params[...] = world.xp.asarray(mine)
            continue
        target = optimizer.state()[name]
        if ring.sharded:   # this rank's shard of its slice's state: the ranges it owns, back to back
            mine = _owned(mine, optimizer.ranges)
        target[...] = world.xp.asarray(mine.astype(target.dtype, copy=False))
    optimizer.t = resume.optimizer_t
    if shard is not None:
        ring.store.forget()
    checkpoints.broadcast_model_state(comm, resume, ring.model.state)
    device.synchronize(world.xp)


class _Whole:
    """The whole model's tensors over one flat host buffer, as write_params reads a model."""

    def __init__(self, spec, params, state_tensors):
        self.spec, self.params, self._state = spec, params, state_tensors

    def tensors(self):
        return [(name, self.params[lo:hi].reshape(shape)) for name, shape, lo, hi in self.spec.tensors]

    def state_tensors(self):
        return self._state


class TensorModel:
    """--tensor-parallel's model for the report and the frame (report/evaluated.py's
    interface), collective over every rank. model: the ring's, this rank's slice."""
    collective = True

    def __init__(self, world, plan, model, ring):
        self.world, self.plan, self.model, self.spec, self.ring = world, plan, model, model.spec, ring
        # --zero 3: every replica's gathers are collectives over the replicas, so every rank evaluates the
        # whole split in step (the replicas' parts could differ in batches)
        self.whole_split = ring.param_shard is not None
        self._parts = {}   # split -> this replica's part of it (or the whole split), read once

    def finite(self):
        device.synchronize(self.world.xp)
        shard = self.ring.param_shard
        ok = np.array([1 if device.all_finite(self.model.params if shard is None else shard.buf) else 0], np.int64)
        with self.world.waiting("parameter finiteness allreduce", peer=None):
            self.world.cluster.worker_comm.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
        return bool(ok[0])

    def share_state(self):
        """Nothing to share: the state (batch-norm statistics) of a split
        model's replicas follows their own batches, as ring mode's do, and
        the chief's is what checkpoints hold."""

    def agree(self, text):
        return chief_text(self.world, text)

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

    def write(self, path, step, attrs=None):
        """--save, --keep-best: the whole tensors, gathered to the chief and
        written there (report/params.py's file). OSError on the chief when it
        cannot (the others learn it from `agree`)."""
        device.synchronize(self.world.xp)
        whole = gather_whole(self.world, self.spec, local_arrays(self.world, self.ring, state=False))
        if self.world.chief:
            state = [(name, device.to_host(view)) for name, view in self.model.state_tensors()]
            write_params(path, _Whole(self.spec.full, whole["params"], state), step, self.plan, attrs)
