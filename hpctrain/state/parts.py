"""A layout's state, as parts of whole named tensors (the contract in
state/__init__.py): `Part(name, box, view, writer)`, and the arithmetic that
turns the ways a layout holds state into parts:

- a flat buffer laid out by a spec (`[(name, shape, lo, hi)]`), of which
  this rank holds some ranges (the whole buffer; ZeRO's owned ranges; a
  pipeline stage's slice): `flat_parts`;
- a range of a tensor's flat (C-order) values is a union of boxes:
  `range_boxes` (at most 2·ndim - 1 of them).

A box is a tuple of (start, stop) per dimension of the whole tensor; a
part's view has the box's shape.

    mpirun -n 4 python -m mpi4py -m pytest -q --only-mpi tests/test_state_layouts.py
"""
from typing import NamedTuple

import numpy as np


class Part(NamedTuple):
    """Values of the box `box` of whole tensor `name`, held in `view` (an
    array of the box's shape: numpy, or cupy on a GPU). writer: this rank
    writes the box out (one writer per box over every rank)."""
    name: str
    box: tuple
    view: object
    writer: bool


def box_shape(box):
    return tuple(stop - start for start, stop in box)


def box_slices(box):
    return tuple(slice(start, stop) for start, stop in box)


def range_boxes(shape, lo, hi):
    """[(box, a, b)]: the flat C-order range [lo, hi) of a tensor of `shape`
    as boxes, each holding the flat values [a, b) of the range (in order,
    back to back from lo to hi)."""
    shape = tuple(int(n) for n in shape)
    if lo >= hi:
        return []
    if not shape:
        return [((), lo, hi)]
    inner = int(np.prod(shape[1:], dtype=np.int64))
    out = []
    first, last = lo // inner, (hi - 1) // inner
    if first == last or lo % inner:   # a partial leading row: recurse inside it
        stop = min(hi, (first + 1) * inner)
        for box, a, b in range_boxes(shape[1:], lo - first * inner, stop - first * inner):
            out.append((((first, first + 1),) + box, a + first * inner, b + first * inner))
        lo = stop
        first += 1
    if lo >= hi:
        return out
    whole_rows = (hi - lo) // inner
    if whole_rows:
        out.append((((first, first + whole_rows),) + tuple((0, n) for n in shape[1:]),
                    lo, lo + whole_rows * inner))
        lo += whole_rows * inner
    if lo < hi:   # a partial trailing row
        row = lo // inner
        for box, a, b in range_boxes(shape[1:], 0, hi - row * inner):
            out.append((((row, row + 1),) + box, a + row * inner, b + row * inner))
    return out


def flat_parts(tensors, ranges, buffer, writer=True, prefix=""):
    """The parts of a flat `buffer` that holds, back to back, the ranges
    `ranges` [(lo, hi)] of a flat layout `tensors` [(name, shape, lo, hi)]
    (the whole buffer: ranges [(0, n)]; ZeRO: the owned ranges, compact).
    prefix: put before each name (an optimizer state's `adam.m/`)."""
    parts, at = [], 0
    for rlo, rhi in ranges:
        for name, shape, tlo, thi in tensors:
            lo, hi = max(rlo, tlo), min(rhi, thi)
            if lo >= hi:
                continue
            for box, a, b in range_boxes(shape, lo - tlo, hi - tlo):
                start = at + (a + tlo - rlo)
                parts.append(Part(prefix + name, box, buffer[start:start + (b - a)].reshape(box_shape(box)), writer))
        at += rhi - rlo
    return parts
