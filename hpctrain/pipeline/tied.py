"""Tied tensors across a pipeline's cut (nn/tied.py): where the cut puts a
tied tensor's owner (the embedding, say) and a user (the output head) on
different stages, the user's stage holds a copy of the tensor, and every
step, after the micro-batches and before the replicas' average:

1. each user stage's rank hands its copy's gradient (its uses' sums over
   the micro-batches, nn/tied.py) to the owner's stage rank of the same
   replica, which adds them, the last stage's first, into the tensor's
   gradient: the sum one rank takes over the same uses (so a pipeline
   still ends with --accumulate-steps M's bits, for a tensor used by two
   layers; with more uses over more stages the sums' order differs);
2. the owner's stage averages and updates it with the rest of its slice,
   as ring mode does (the one copy in the checkpoint, the optimizer state,
   the clip norm's count);
3. the owner's stage rank hands the updated tensor to the users' stages:
   the copies are the owner's bits, whatever the optimizer or sharding.

One communicator per tied tensor that spans stages: the stages that use it,
of one replica (a Split of the grid's pipe communicator, made once; the
owner's stage, the first, is rank 0 there). With --virtual-stages V > 1
the same between chunks: each stage holds one chunk that uses the tensor
at most (stages.tied_in_chunks refuses a layout with two), e.g. the GPT's
embedding on chunk 0 (stage 0) and its head on the last chunk (stage P-1).

    mpirun -n 2 python -m hpctrain.mnist --model examples/tied_model.py:build --pipeline-stages 2
"""
import numpy as np
from mpi4py import MPI

from ..base import device


class _Spanning:
    """One tied tensor spanning stages, as this rank sees it."""

    def __init__(self, tie, stages, comm, owner_stage, chunk, tied_sums):
        self.key, self.lo, self.hi = (tie.owner, tie.tensor), tie.lo, tie.hi   # the owner's tensor in the model
        self.stages, self.comm = stages, comm
        self.owner_here = comm.Get_rank() == 0
        self.owner_stage = owner_stage
        self.chunk = chunk   # this stage's chunk (stage.Stage) that holds the owner or the use
        self.tied_sums = tied_sums   # that chunk's tied uses' sums over the step (comm/step_gradient.py)


class TiedStages:
    """The tied tensors of the model that span stages, and their per-step
    exchanges for this rank's stage (`chunks`: its stage.Stage chunks, local
    chunk k the model's chunk kP + stage; gradient: the step's,
    comm/step_gradient.StepGradient, a part per chunk)."""

    def __init__(self, world, grid, spec, cuts, chunks, gradient):
        self.world, self.grid = world, grid
        chunk_of = {i: c for c, (a, b) in enumerate(zip(cuts, cuts[1:])) for i in range(a, b)}
        stages = grid.stages
        by_tensor = {}
        for t in spec.ties:
            by_tensor.setdefault((t.owner, t.tensor), []).append(t)
        self.spanning = []
        for ties in by_tensor.values():   # every rank in the same order: a Split each
            owner = ties[0].owner
            used = {chunk_of[t.user] for t in ties} | {chunk_of[owner]}   # one a stage at most (tied_in_chunks)
            span = sorted({c % stages for c in used})
            if len(used) == 1:
                continue   # inside one chunk: its runner sums the uses
            here = grid.stage in span
            with world.waiting("start-up (a tied tensor's communicator)", peer=None):
                comm = grid.pipe_comm.Split(0 if here else MPI.UNDEFINED, grid.stage)
            if here:
                mine = next(c for c in used if c % stages == grid.stage)
                self.spanning.append(_Spanning(ties[0], span, comm, chunk_of[owner] % stages,
                                               chunks[mine // stages], gradient.tied_sums(mine // stages)))

    def _tensor(self, span, of):
        """The tensor of `span` in this stage's buffers: `of` "params" or
        "grads" (the step's sums); the owner's slice, or the copy."""
        chunk = span.chunk
        if span.owner_here:
            buffer = chunk.params if of == "params" else chunk.grads
            return buffer[span.lo - chunk.lo:span.hi - chunk.lo]
        group = next(g for g in chunk.model.run.ties.groups if (g.owner, g.tensor) == span.key)
        if of == "params":
            return chunk.model.run.copies[group.copy[0]:group.copy[1]]
        return span.tied_sums[group.copy_extra[0]:group.copy_extra[1]]

    def sum_gradients(self):
        """Step 1: the users' stages' gradients into the owner's."""
        xp = self.world.xp
        device.synchronize(xp)
        for span in self.spanning:
            mine = self._tensor(span, "grads")
            send = np.ascontiguousarray(device.to_host(mine))
            got = np.empty((len(span.stages), mine.size), send.dtype) if span.owner_here else None
            peer = None if span.owner_here else self.grid.world_rank(span.owner_stage)
            with self.world.waiting("tied tensor's gradient to the owner's stage", peer=peer):
                self.world.waits.one(span.comm.Igather(send, got, root=0))
            if span.owner_here:
                total = got[-1].copy()   # the last stage's uses first: backprop's order
                for row in got[-2:0:-1]:
                    total += row
                mine += xp.asarray(total)

    def share_parameters(self):
        """Step 3 (and at the start, after initialisation or a resume): the
        owner's tensor onto the copies."""
        xp = self.world.xp
        device.synchronize(xp)
        for span in self.spanning:
            tensor = self._tensor(span, "params")
            host = np.ascontiguousarray(device.to_host(tensor)) if span.owner_here else \
                np.empty(tensor.size, tensor.dtype)
            peer = None if span.owner_here else self.grid.world_rank(span.owner_stage)
            with self.world.waiting("tied tensor from the owner's stage", peer=peer):
                self.world.waits.one(span.comm.Ibcast(host, root=0))
            if not span.owner_here:
                tensor[...] = xp.asarray(host)

    def free(self):
        for span in self.spanning:
            span.comm.Free()
        self.spanning = []
