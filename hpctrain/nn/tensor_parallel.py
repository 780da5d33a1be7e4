"""Tensor parallelism (Megatron-LM's, `--tensor-parallel T`): layers split
inside, each of a tensor group's T ranks holding a slice of their matrices
and computing on it, with the conjugate collectives that keep the rest of
the model whole on every rank of the group.

- A column-parallel Linear or Dense (rank t holds W[:, cols_t], b[cols_t])
  takes the whole input and gives its slice of the output: forward nothing
  to send; backward its input gradient is a partial sum, added over the
  group (an allreduce).
- A row-parallel one (W[rows_t, :]) takes a slice and gives the whole
  output: forward the partial products are added over the group (an
  allreduce), then the bias, which every rank holds whole; backward nothing
  to send. A column layer, then elementwise layers (ReLU, GELU), then a row
  layer: two allreduces forward and backward for the pair.
- Attention splits by heads: q, k and v column-parallel (the fused Wqkv's
  q, k and v blocks each cut alike), the output projection row-parallel.
- The vocabulary: the embedding holds rows [v_t, v_t+1) of E (a token
  outside gives zeros; the vectors are added over the group), the tied
  head is then column-parallel over the vocabulary and the loss
  (nn/losses.TokenCrossEntropy) takes its slice of the logits, from a
  max and two sums over the group: the whole logits are never gathered.
  The vocabulary is cut into T nearly equal parts (np.array_split's: the
  first V mod T ranks one row more) rather than padded, since a tensor
  rank's buffers need not match the others' (each has a data-parallel ring
  of its own): no padded rows to mask, nothing in the file to strip.

- --sequence-parallel (`TensorGroup.sequence`): between a GPT's split
  layers the activations are cut along the positions (rank t its 1/T of
  them): a column layer allgathers them first, a row layer reduce-scatters
  its sum (the same bytes as the allreduce), and what every rank holds
  whole but now sees only its positions of (the norms, the row biases,
  the position table) has its gradient summed over the group. A dropout
  on a slice (heads or positions) draws that slice of the whole layer's
  mask (nn/layers.Dropout.unit_offset), so T changes no random draw.

A layer's role is declared where it is built (`Linear(n, role="column")`,
`"row"`, `"vocab"`; `Embedding(..., role="vocab")`; attention splits by
heads; a transformer Block by its inner layers' roles), and
`split_model(layers, loss, group)` (nn/tensor_split.py) has the spec's
copy of each such layer join the group (`layer.join(group)`) before the
spec configures it; in a model built without roles, Linear (Dense) layers
pair up (column, then row) where only elementwise layers lie between
them. Every other layer, and a last unpaired Dense, stays whole on every
rank (replicated: its gradient is the same on every rank of the group,
nothing to add). A layer that splits says
how each of its tensors is cut (`tensor_cuts()` -> {name: Cut}); that is
all checkpoints, --save and the initial draw need to go between a rank's
flat buffer and the whole model's tensors (`local_layout`): the file holds
the whole tensors, so a run resumes at any T.

The collectives go through the group's handle (`TensorGroup(..., comm=)`,
made at start-up on the mesh's tensor axis: comm/tensor_group.py); nn/
never imports MPI. A group of one (T = 1) sends nothing.

    mpirun -n 2 python -m mpi4py -m pytest -q --only-mpi tests/test_tensor_parallel.py
"""
import math
from typing import NamedTuple

import numpy as np

from .layer_errors import LayerError

class Cut(NamedTuple):
    """How a tensor of the whole model is cut over a tensor group: along
    `axis`, whose length is `groups` blocks (attention's fused q|k|v: 3),
    each block cut at `bounds` (T + 1 offsets within a block): rank t holds
    [bounds[t], bounds[t + 1]) of every block."""
    axis: int
    groups: int
    bounds: tuple

    @property
    def block(self):
        return self.bounds[-1]

    def local_shape(self, full_shape, t):
        shape = list(full_shape)
        shape[self.axis] = self.groups * (self.bounds[t + 1] - self.bounds[t])
        return tuple(shape)

    def _blocks(self, full):
        """full as (..., groups, block, ...) along axis: a view."""
        shape = full.shape
        return full.reshape(*shape[:self.axis], self.groups, self.block, *shape[self.axis + 1:])

    def take(self, full, t):
        """Rank t's slice of the whole tensor `full`, contiguous."""
        lo, hi = self.bounds[t], self.bounds[t + 1]
        index = (slice(None),) * (self.axis + 1) + (slice(lo, hi),)
        part = self._blocks(full)[index]
        return np.ascontiguousarray(part).reshape(self.local_shape(full.shape, t))

    def put(self, local, full, t):
        """Rank t's slice `local` into the whole tensor `full`."""
        lo, hi = self.bounds[t], self.bounds[t + 1]
        index = (slice(None),) * (self.axis + 1) + (slice(lo, hi),)
        target = self._blocks(full)[index]
        target[...] = local.reshape(target.shape)


def even(n, size, what):
    """Bounds cutting n into `size` equal parts; LayerError where it cannot."""
    if n % size:
        raise LayerError(f"{what} {n} is not a multiple of --tensor-parallel {size}")
    return tuple(range(0, n + 1, n // size))


def nearly_even(n, size):
    """Bounds cutting n into `size` parts, the first n mod size one longer (np.array_split's)."""
    q, r = divmod(n, size)
    return tuple(int(v) for v in np.cumsum([0] + [q + (t < r) for t in range(size)]))


class TensorGroup:
    """The tensor group a rank's split layers belong to: `size` ranks, this
    one `rank` among them, and `comm`, the handle their collectives go
    through (comm/tensor_group.TensorComm on the mesh's tensor axis, made
    at start-up; None: a spec that is only looked at, never run): in place
    on an array, `sum(a)`, `max(a)`, `min(a)` over the group."""

    def __init__(self, size, rank, sequence=False, comm=None):
        self.size, self.rank, self.comm = int(size), int(rank), comm
        # --sequence-parallel: between the split layers the activations are cut along the positions
        self.sequence = bool(sequence)
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor rank {rank} of {size}")

    def positions(self, t):
        """--sequence-parallel: this rank's (first, count) of t positions; LayerError where T does not divide t."""
        if t % self.size:
            raise LayerError(f"{t} positions are not a multiple of --tensor-parallel {self.size} "
                             f"(--sequence-parallel cuts them evenly)")
        return self.rank * (t // self.size), t // self.size

    def reduce_scatter(self, full, out):
        """full (n, t, ...) partial sums -> out (n, t / T, ...): this rank's positions of their sum."""
        if self.size > 1:
            self._comm().reduce_scatter(full, out)
        else:
            out[...] = full

    def allgather(self, part, out):
        """part (n, t / T, ...), each rank's positions -> out (n, t, ...)."""
        if self.size > 1:
            self._comm().allgather(part, out)
        else:
            out[...] = part

    def sum(self, a):
        if self.size > 1:
            self._comm().sum(a)
        return a

    def max(self, a):
        if self.size > 1:
            self._comm().max(a)
        return a

    def min(self, a):
        if self.size > 1:
            self._comm().min(a)
        return a

    def _comm(self):
        if self.comm is None:
            raise RuntimeError("a tensor-parallel layer ran in a group made without a communicator")
        return self.comm

    def __deepcopy__(self, memo):
        return self   # one group however often the layers are copied


def local_layout(full_spec, cuts, t):
    """Tensor rank t's flat buffer as the whole model's tensors cut:
    [(full name, full shape, full (lo, hi), local shape, local (lo, hi), Cut or None)],
    in the buffer's order (the whole model's: a split layer's tensors keep
    their places, smaller). cuts: {full tensor name: Cut} (ModelSpec.cuts)."""
    out, at = [], 0
    for name, shape, lo, hi in full_spec.tensors:
        cut = cuts.get(name)
        local = cut.local_shape(shape, t) if cut else tuple(shape)
        size = math.prod(local)
        out.append((name, tuple(shape), (lo, hi), local, (at, at + size), cut))
        at += size
    return out


def counted_ranges(full_spec, cuts, t):
    """The local flat ranges tensor rank t counts in a sum over the whole
    model (the clip norm): its slices of the split tensors, and on rank 0
    alone the replicated ones, which every rank holds alike."""
    return [(a, b) for _, _, _, _, (a, b), cut in local_layout(full_spec, cuts, t) if cut or t == 0]


def split_linear(layer, fan_in, units, bias):
    """(fan_in here, units here, {tensor: Cut}) of a Linear by its `role`
    over its `group`: whole (no group), "column" (its units cut evenly),
    "vocab" (nearly evenly: a head's vocabulary) or "row" (its input is the
    column layer's slice: fan_in here is the slice's)."""
    role, group = layer.role, layer.group
    if group is None:
        return fan_in, units, {}
    if role != "row":
        bounds = nearly_even(units, group.size) if role == "vocab" else \
            even(units, group.size, f"{layer.describe()}: the units")
        here = bounds[group.rank + 1] - bounds[group.rank]
        return fan_in, here, {"W": Cut(1, 1, bounds), **({"b": Cut(0, 1, bounds)} if bias else {})}
    bounds = tuple(range(0, fan_in * group.size + 1, fan_in))
    return fan_in, units, {"W": Cut(0, 1, bounds)}
