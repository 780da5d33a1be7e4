"""Tied tensors: one tensor of the model used by several layers (a language
model's output head reading its embedding's matrix, transposed: nanoGPT's
`lm_head.weight = wte.weight`, DeepSpeed's TiedLayerSpec).

A user declares it on the layer that reads the tensor:

    emb = Embedding(vocab, dim)
    head = Dense(vocab).tie("W", emb, "E", transposed=True)   # head's W is emb's E, transposed

The layer that lists the tensor in its `param_shapes` (the owner) keeps it
in the flat buffer, once; the other layers (its users) take no room for it
and are bound to views of the owner's tensor. Checked once when the spec is
made (`declared`, `resolve`), each problem one line: the owner is a layer
of the model's list, before every user (its backward is then the tensor's
last, and makes its gradient final), it has the tensor, the shapes agree,
no tensor is tied twice, no tie inside a container.

The gradient is the sum over the uses. In a range of layers (the whole
model, a pipeline stage: `RangeTies`) the tensor's writers in backprop
order are its users from the last layer down, then the owner: the first
writes into the tensor's gradient (its home), each other into a part of
its own (the range's `extra` buffer), added into the home in that order
once the last writer is done (`combine`), before the owner's range is
reported final (on_layer_done), so buckets never send half a gradient.
Where a step sums several micro-batches (--accumulate-steps, a pipeline),
the home and the parts are each summed over them first and combined at the
end: the tensor's gradient is, per use, the sum over the micro-batches,
then the sum over the uses in backprop order; whatever the cut, so a
pipeline gives --accumulate-steps' bits. A range that holds users of a
tensor but not its owner (a pipeline stage after the cut) keeps a copy of
it (params and gradient, initialised from the owner's own (seed, index)
stream); pipeline/tied.py sums the copy's gradient into the owner's stage
each step and hands the updated tensor back, so the copies stay
bit-identical.

    python -m pytest -q tests/test_tied.py
"""
from typing import NamedTuple

import numpy as np

from .layers import Layer, describe
from .layer_errors import LayerCodeError


class Tie(NamedTuple):
    """Layer `user`'s tensor `name` is layer `owner`'s tensor `tensor`
    (`transposed`: read as its transpose), of the owner's `shape`, at
    [lo, hi) of the model's flat buffer."""
    user: int
    name: str
    owner: int
    tensor: str
    transposed: bool
    shape: tuple
    lo: int
    hi: int


def declared(layers):
    """{user index: [(name, owner index, tensor, transposed)]} from the
    layers' tie() declarations, the owners found in the list; LayerCodeError
    (one line) for an owner that is not an earlier layer of the list, or a
    tie inside a container."""
    index = {id(layer): i for i, layer in enumerate(layers)}
    out = {}
    for i, layer in enumerate(layers):
        for prefix, inner in getattr(layer, "inner", ()):
            if getattr(inner, "ties", ()):
                raise LayerCodeError(f"layer {i}.{prefix} ({describe(inner)}) ties a tensor inside a container: "
                                     f"tie a layer of the model's list instead")
        for entry in getattr(layer, "ties", ()):
            where = f"layer {i} ({describe(layer)})"
            if not (isinstance(entry, tuple) and len(entry) == 4):
                raise LayerCodeError(f"{where}: its ties hold {entry!r}, not what tie(name, owner, tensor) makes")
            name, owner, tensor, transposed = entry
            what = f"{where}: tie({name!r}, ..., {tensor!r})"
            j = index.get(id(owner))
            if not isinstance(owner, Layer) or j is None:
                named = describe(owner) if isinstance(owner, Layer) else type(owner).__name__
                raise LayerCodeError(f"{what}: the owner ({named}) is not a layer of the model's list")
            if j == i:
                raise LayerCodeError(f"{what}: a layer cannot tie a tensor to itself")
            if j > i:
                raise LayerCodeError(f"{what}: the owner, layer {j} ({describe(owner)}), comes after it; the layer "
                                     f"that holds the tensor must come before every layer that reads it")
            if any(name == other[0] for other in out.get(i, ())):
                raise LayerCodeError(f"{what}: {name!r} is tied twice")
            out.setdefault(i, []).append((name, j, tensor, bool(transposed)))
    return out


def resolve(i, layer, params, ties, owner_tensors):
    """Layer i's (name, shape) tensors without its tied ones, and its Ties.
    params: the layer's param_shapes, checked; ties: declared(...)[i];
    owner_tensors(j): layer j's laid-out [(full name, shape, lo, hi)]."""
    where = f"layer {i} ({describe(layer)})"
    shapes = dict(params)
    out = []
    for name, j, tensor, transposed in ties:
        what = f"{where}: tie({name!r}, layer {j}, {tensor!r})"
        if name not in shapes:
            raise LayerCodeError(f"{what}: it has no tensor {name!r} (its tensors: "
                                 f"{', '.join(shapes) or 'none'})")
        found = [entry for entry in owner_tensors(j) if entry[0].split("/", 1)[1] == tensor]
        if not found:
            names = [entry[0].split("/", 1)[1] for entry in owner_tensors(j)]
            raise LayerCodeError(f"{what}: layer {j} has no tensor {tensor!r} of its own (its tensors: "
                                 f"{', '.join(names) or 'none'})")
        _, shape, lo, hi = found[0]
        want = shapes[name]
        if transposed and len(shape) != 2:
            raise LayerCodeError(f"{what}: transposed needs a 2-D tensor, {tensor!r} is {_text(shape)}")
        seen = tuple(reversed(shape)) if transposed else tuple(shape)
        if tuple(want) != seen:
            raise LayerCodeError(f"{what}: its {name!r} is {_text(want)}, layer {j}'s {tensor!r} is {_text(shape)}"
                                 + (f" (transposed: {_text(seen)})" if transposed else ""))
        out.append(Tie(i, name, j, tensor, transposed, tuple(shape), lo, hi))
    tied = {t.name for t in out}
    return [(name, shape) for name, shape in params if name not in tied], out


def _text(shape):
    return "x".join(map(str, shape)) or "a scalar"


class Group:
    """One tied tensor as a range of layers sees it: its writers in
    backprop order (users from the last down, then the owner if in the
    range), where its home is (the range's buffers at the owner's offsets,
    or a copy: `copy` (lo, hi) in the range's copy and extra buffers), and
    each later writer's part (lo, hi) in extra."""

    def __init__(self, ties, a, b):
        first = ties[0]
        self.owner, self.tensor, self.shape, self.lo, self.hi = first.owner, first.tensor, first.shape, first.lo, \
            first.hi
        self.size = first.hi - first.lo
        self.users = {t.user: t for t in ties if a <= t.user < b}
        self.writers = sorted(self.users, reverse=True) + ([self.owner] if a <= self.owner < b else [])
        self.home_here = a <= self.owner < b
        self.copy = self.copy_extra = None   # set by RangeTies where the owner is outside the range
        self.parts = {}    # writer -> (lo, hi) in extra


class RangeTies:
    """The tied tensors that layers [a, b) of a spec use (nn/sequential.LayerRange
    holds one): `extra`'s layout (copies' gradients, then the writers'
    parts), the views each layer is bound to, and `combine`."""

    def __init__(self, spec, a, b):
        by_tensor = {}
        for t in spec.ties:
            by_tensor.setdefault((t.owner, t.tensor), []).append(t)
        self.groups = []
        copies = extra = 0
        for ties in by_tensor.values():
            group = Group(ties, a, b)
            if not group.users:
                continue   # only the owner here: an ordinary tensor of its layer
            if not group.home_here:
                group.copy = (copies, copies + group.size)
                copies += group.size
                group.copy_extra = (extra, extra + group.size)
                extra += group.size
            for writer in group.writers[1:]:
                group.parts[writer] = (extra, extra + group.size)
                extra += group.size
            self.groups.append(group)
        self.copy_size, self.extra_size = copies, extra

    def home(self, group, buffer, extra, base):
        """The group's tensor (owner's shape) in `buffer` (params or grads at
        model offset `base`) or, for a copy, in `extra` (its copy's range there)."""
        if group.home_here:
            return buffer[group.lo - base:group.hi - base].reshape(group.shape)
        lo, hi = group.copy if extra is None else group.copy_extra
        return (buffer if extra is None else extra)[lo:hi].reshape(group.shape)

    def bind_views(self, i, params, grads, pv, gv, copy_params, extra, base):
        """Layer i's views dicts pv, gv (from spec.views) with its tied
        tensors added (a user's) or redirected (an owner's gradient, when
        a user writes it first)."""
        for group in self.groups:
            if i not in group.writers:
                continue
            p = self.home(group, params, None, base) if group.home_here else \
                copy_params[group.copy[0]:group.copy[1]].reshape(group.shape)
            g = self.home(group, grads, extra, base) if i == group.writers[0] else \
                extra[group.parts[i][0]:group.parts[i][1]].reshape(group.shape)
            tie = group.users.get(i)
            if tie is None:   # the owner
                gv[group.tensor] = g
                continue
            pv[tie.name], gv[tie.name] = (p.T, g.T) if tie.transposed else (p, g)

    def init_views(self, i, views, dtype):
        """Layer i's init views with scratch for its tied tensors: a user's
        init draws them as it likes, into nothing; the owner's draw decides."""
        for group in self.groups:
            tie = group.users.get(i)
            if tie is not None:
                views[tie.name] = np.zeros(tuple(reversed(group.shape)) if tie.transposed else group.shape, dtype)
        return views

    def init_copies(self, spec, seed, copy_params, xp):
        """Each copy's initial bits: its owner's init from (seed, owner index)
        (nn/sequential.LayerRange.init), the tensor taken from it."""
        for group in self.groups:
            if group.copy is None:
                continue
            entries = spec.layer_tensors[group.owner]
            at = entries[0][2]
            host = np.zeros(entries[-1][3] - at, copy_params.dtype)
            views = {name.split("/", 1)[1]: host[lo - at:hi - at].reshape(shape) for name, shape, lo, hi in entries}
            for t in spec.ties:   # the owner's own tied tensors, if it reads another's: scratch, as init_views
                if t.user == group.owner:
                    views[t.name] = np.zeros(tuple(reversed(t.shape)) if t.transposed else t.shape, host.dtype)
            rng = np.random.default_rng([seed, group.owner])
            if group.owner in spec.split_layers:   # --tensor-parallel: the whole layer's draw, cut
                spec.init_split(group.owner, rng, views, host.dtype)
            else:
                spec.layers[group.owner].init(rng, views, host.dtype)
            tensor = views[group.tensor].reshape(-1)
            lo, hi = group.copy
            copy_params[lo:hi] = xp.asarray(tensor)

    def done_by(self, i):
        """The groups whose last writer in backprop order is layer i."""
        return [g for g in self.groups if g.writers[-1] == i]

    def combine(self, group, grads, extra, base):
        """The group's gradient: its home += each later writer's part, in
        backprop order (grads at model offset base, extra the range's)."""
        home = self.home(group, grads, extra, base)
        for writer in group.writers[1:]:
            lo, hi = group.parts[writer]
            home += extra[lo:hi].reshape(group.shape)

    def extra_range(self, group):
        """(lo, hi) of the group's span in extra (its copy's gradient and its parts)."""
        spans = list(group.parts.values()) + ([group.copy_extra] if group.copy is not None else [])
        return (min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else (0, 0)
