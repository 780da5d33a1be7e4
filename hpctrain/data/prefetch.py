"""Training batches to the GPU one step ahead, through pinned host memory.

`device_batches(reader, xp)` wraps a data.ShardReader. For NumPy it returns the
reader itself: no copies, nothing changes on CPU. For CuPy it returns a
Prefetcher: each next_batch() hands out a batch that is already on the device
(or on its way, on a copy stream the compute stream waits for without
blocking the host), then reads the next batch from the shards into a pinned
host buffer and starts its asynchronous copy, so the copy runs while the GPU
computes this step and the host read overlaps the GPU's tail of the last one.

Two slots (pinned host x/y and device x/y each) alternate: one is handed out,
the other is being filled. As with the reader, a batch is valid until the next
call. CUDA events keep the reuse safe: a slot's device arrays are overwritten
only after the compute stream has finished with them (work queued before the
next call), its pinned arrays only after their copy to the device is done.

The wrapper is a drop-in for the reader: `position` is the position after the
last batch handed out (not after the one read ahead), so a checkpoint records
where the training really is; `seek()` drops the batch read ahead.

    python -m hpctrain.data.prefetch      # checks prefetched batches equal the reader's (GPU if present)
"""
from ..base import device


def device_batches(reader, xp):
    """The batch source for arrays of module xp: the reader (NumPy) or a Prefetcher (CuPy)."""
    return Prefetcher(reader, device.copier(xp)) if device.is_gpu(xp) else reader


class _Slot:
    __slots__ = ("hx", "hy", "dx", "dy", "copied", "released", "position", "draw")

    def __init__(self, copier, x, y):
        # None where the reader does not read that array (a pipeline's stages: data/reader.py)
        self.hx, self.hy = (None if a is None else copier.host_empty(a.shape, a.dtype) for a in (x, y))
        self.dx, self.dy = (None if a is None else copier.device_empty(a.shape, a.dtype) for a in (x, y))
        self.copied = None     # token: the copy to the device is done (pinned buffers free again)
        self.released = None   # token: compute is done with dx, dy
        self.position = None   # the reader's position after this batch
        self.draw = None       # the batch's (epoch, sample ids): the reader's last_draw


class Prefetcher:
    """next_batch() -> (x, y) on the device, read one batch ahead (see module doc).
    `copier`: device.copier(xp); device.HostCopier() runs the same logic on NumPy."""

    def __init__(self, reader, copier):
        self.reader = reader
        self.copier = copier
        self._slots = None
        self._ahead = None        # the slot read ahead, not yet handed out
        self._current = None      # the slot handed out last
        self._position = tuple(reader.position) if hasattr(reader, "position") else None
        self.last_draw = None     # (epoch, sample ids) of the batch handed out last

    def __getattr__(self, name):  # batch_size, num_samples, ...: the reader's
        if name == "reader":
            raise AttributeError(name)
        return getattr(self.reader, name)

    @property
    def position(self):
        """(epoch, offset) of the next batch next_batch() will return."""
        return self._position

    def seek(self, epoch, offset):
        self.reader.seek(epoch, offset)
        self._ahead = None        # read from the new position on the next call
        self._position = (int(epoch), int(offset))

    def _read_ahead(self):
        """Read the next batch into the slot not handed out last, and start its copy."""
        x, y = self.reader.next_batch()
        if self._slots is None:
            self._slots = [_Slot(self.copier, x, y), _Slot(self.copier, x, y)]
        slot = self._slots[1 if self._current is self._slots[0] else 0]
        c = self.copier
        c.wait(slot.copied)       # its last copy has finished reading the pinned buffers
        slot.position = tuple(self.reader.position) if hasattr(self.reader, "position") else None
        if hasattr(self.reader, "last_draw"):
            epoch, ids = self.reader.last_draw
            slot.draw = (epoch, ids.copy())
        # The device arrays may still be read by compute queued earlier; the
        # copies share a stream, so the last one's token covers both.
        after, slot.copied = slot.released, None
        for host, dev, batch in ((slot.hx, slot.dx, x), (slot.hy, slot.dy, y)):
            if batch is not None:
                host[...] = batch
                slot.copied, after = c.to_device(host, dev, after=after), None
        slot.released = None
        return slot

    def next_batch(self):
        if self._ahead is None:
            self._ahead = self._read_ahead()
        slot = self._ahead
        c = self.copier
        if self._current is not None and self._current is not slot:
            # Everything queued so far that reads the previous batch precedes this mark.
            self._current.released = c.mark()
        c.use(slot.copied)        # compute waits for the copy, the host does not
        self._current = slot
        self._position = slot.position
        self.last_draw = slot.draw
        self._ahead = self._read_ahead()
        return slot.dx, slot.dy


if __name__ == "__main__":
    import numpy as np

    from .. import data
    xp, name, note = device.select("auto")
    path = data.default_data_dir()
    if not data.is_prepared(path):
        data.prepare(data.bundled_sample_dir(), path, log=lambda *a, **k: None)
    plain = data.ShardReader(path, 0, 1, 64, 0)
    fetched = Prefetcher(data.ShardReader(path, 0, 1, 64, 0), device.copier(xp))   # on the CPU too
    for _ in range(200):
        x, y = plain.next_batch()
        dx, dy = fetched.next_batch()
        assert np.array_equal(x, device.to_host(dx)) and np.array_equal(y, device.to_host(dy))
        assert fetched.position == plain.position
    print(f"prefetched batches equal the reader's on {name} ({note})")
