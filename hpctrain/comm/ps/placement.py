"""Where the parameters live: which contiguous ranges of the ONE flat
parameter vector each server holds, and a Slice that moves one server's
ranges as one contiguous buffer.

    python -c "from hpctrain.comm.ps.placement import place; print(place([('a', 0, 10)], 3))"

`even`: equal slices; `round-robin` / `greedy`: whole tensors, as
TensorFlow's replica_device_setter and GreedyLoadBalancingStrategy place
variables. A server stores its ranges packed in one buffer with the optimizer
state of exactly those elements; every optimizer is elementwise, so a packed
slice updates bit for bit as the whole buffer would.
"""
import numpy as np

from ...base.chunks import chunk_parts
from ...base.device import array_module

PLACEMENTS = ("even", "round-robin", "greedy")


def place(tensor_ranges, num_ps, strategy="even"):
    """Ranges of the flat vector held by each of num_ps servers: a list (one per
    server) of sorted, merged (lo, hi) pairs. tensor_ranges: (name, lo, hi) in
    buffer order, covering [0, n) without gaps."""
    if num_ps < 1:
        raise ValueError(f"need at least one server, got {num_ps}")
    owned = [[] for _ in range(num_ps)]
    n = tensor_ranges[-1][2] if tensor_ranges else 0
    if strategy == "even":
        for server, part in enumerate(chunk_parts(n, num_ps)):
            owned[server].append(part)
    elif strategy == "round-robin":
        # replica_device_setter: variables to ps tasks in creation order
        for i, (_, lo, hi) in enumerate(tensor_ranges):
            owned[i % num_ps].append((lo, hi))
    elif strategy == "greedy":
        # GreedyLoadBalancingStrategy: biggest first, to the least-loaded server
        load = [0] * num_ps
        order = sorted(range(len(tensor_ranges)), key=lambda i: (tensor_ranges[i][1] - tensor_ranges[i][2], i))
        for i in order:
            _, lo, hi = tensor_ranges[i]
            server = min(range(num_ps), key=lambda k: (load[k], k))
            owned[server].append((lo, hi))
            load[server] += hi - lo
    else:
        raise ValueError(f"unknown placement {strategy!r} (choose from {', '.join(PLACEMENTS)})")
    return [_merge(r) for r in owned]


def _merge(ranges):
    out = []
    for lo, hi in sorted(ranges):
        if hi <= lo:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def describe(placement, tensor_ranges):
    """Per server: (element count, ["layer0/W[0:1000]", "layer0/b", ...])."""
    out = []
    for ranges in placement:
        parts = []
        for lo, hi in ranges:
            for name, tlo, thi in tensor_ranges:
                start, end = max(lo, tlo), min(hi, thi)
                if start < end:
                    parts.append(name if (start, end) == (tlo, thi) else f"{name}[{start - tlo}:{end - tlo}]")
        out.append((sum(hi - lo for lo, hi in ranges), parts))
    return out


def slice_size(ranges):
    return sum(hi - lo for lo, hi in ranges)


class Slice:
    """One server's ranges of a flat buffer, as one contiguous array: the view
    itself for a single range, else a packed copy (pack/unpack move the data)
    of the buffer's kind (a CuPy buffer packs on the device)."""

    def __init__(self, flat, ranges):
        self.flat, self.ranges = flat, list(ranges)
        self.size = slice_size(self.ranges)
        if len(self.ranges) == 1:
            lo, hi = self.ranges[0]
            self.buf, self.packed = flat[lo:hi], False
        else:
            xp = np if isinstance(flat, np.ndarray) else array_module(flat)
            self.buf, self.packed = xp.zeros(self.size, flat.dtype), True

    def pack(self):
        if self.packed:
            off = 0
            for lo, hi in self.ranges:
                self.buf[off: off + hi - lo] = self.flat[lo:hi]
                off += hi - lo

    def unpack(self):
        if self.packed:
            off = 0
            for lo, hi in self.ranges:
                self.flat[lo:hi] = self.buf[off: off + hi - lo]
                off += hi - lo
