"""Training-time augmentation (--augment crop,flip), a pure function of
(seed, epoch, sample id), as dropout's masks are (nn/layers.py Dropout).

    mpirun -n 4 python -m hpctrain.train --model small_cnn --data data/fashion --augment crop,flip

crop: the image padded with zeros by P pixels on every side (P = 1/8 of its
smaller side, at least 1: 3 for 28x28, 4 for 32x32, as the CIFAR recipe;
`crop=P` sets it: below the smaller side, `check`), then an H x W window
of it at a random offset in 0..2P on each axis. flip: a horizontal (left-right) flip with probability
1/2. Each sample's draws are one 64-bit hash of (seed, epoch, its global id
in the training set), never of the rank, the worker or the batch: N workers
see the samples one process sees, transformed alike, and a resumed run
draws what an uninterrupted one does. The reader (reader.py) applies it to
the uint8 batch in place, before the pixels are scaled; the test and
validation sets are never augmented.

Data whose manifest says `"no_flip": true` (prepare --no-flip: digits,
letters, where a mirrored image is another class or none) refuses flip
with one line (`check`).

    python -c "from hpctrain.data.augment import Augment; print(Augment('crop,flip', (28, 28), 0).pad)"

No MPI here (house rule).
"""

import numpy as np

from hpctrain.base.errors import HpctrainError

from .manifest import load_manifest

KINDS = ("crop", "flip")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SALT = 0x61756731   # "aug1": a stream of its own, apart from dropout's


def parse(text):
    """{"crop": P or None, "flip": True}: what `--augment` asks for ("" or None: nothing)."""
    found = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        name, _, value = item.partition("=")
        if name not in KINDS or (value and name != "crop"):
            raise HpctrainError(f"--augment: unknown augmentation {item!r}; expected crop, crop=P, flip")
        if value:
            try:
                pad = int(value)
            except ValueError:
                pad = 0
            if pad < 1:
                raise HpctrainError(f"--augment {item}: P must be a positive number of pixels")
            found[name] = pad
        else:
            found[name] = None if name == "crop" else True
    return found


def _splitmix(z):
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def check(text, manifest, data_dir):
    """Raise the one line refusing --augment for this data; return a warning
    line about it (a crop padding past a quarter of the image), or None."""
    kinds = parse(text)
    if "flip" in kinds and manifest.get("no_flip"):
        raise HpctrainError(f"--augment flip: {data_dir} was prepared with --no-flip (a mirrored image is "
                            f"another class there, or none); use --augment crop")
    if kinds and manifest.get("kind") == "tokens":
        raise HpctrainError(f"--augment: {data_dir} holds text as tokens, not images")
    if kinds and len(manifest["image_shape"]) not in (2, 3):
        raise HpctrainError(f"--augment: {data_dir} holds {manifest['image_shape']} samples, not images")
    return _check_pad(kinds.get("crop"), manifest["image_shape"], data_dir)


def _check_pad(pad, image_shape, data_dir):
    """crop=P: P at least the image's smaller side lets a window hold no pixel
    of the image (a black sample with a label), and a batch padded by it
    can need terabytes; past a quarter of the side, most windows lose much
    of the image (a warning)."""
    if pad is None:
        return None
    h, w = (int(d) for d in image_shape[:2])
    side = min(h, w)
    if pad >= side:
        raise HpctrainError(f"--augment crop={pad}: the padding must be smaller than the images' smaller side "
                            f"({h}x{w} in {data_dir}: at most {side - 1}); a window could hold none of the image")
    if pad > side / 4:
        return (f"--augment crop={pad}: more than a quarter of the images' smaller side ({h}x{w}); windows may "
                f"lose much of the image (the default is {max(1, side // 8)})")
    return None


def check_dir(text, data_dir):
    """check() against data_dir's manifest (start-up, before any reader
    opens): its warning line, or None."""
    if text:
        return check(text, load_manifest(data_dir), data_dir)
    return None


class Augment:
    """The augmentation of one run: apply(batch, epoch, ids) transforms a
    uint8 (B, features) batch in place, row i being sample ids[i]."""

    def __init__(self, text, image_shape, seed):
        kinds = parse(text)
        self.text = text
        self.shape = tuple(int(d) for d in image_shape)
        h, w = self.shape[:2]
        self.flip = "flip" in kinds
        self.crop = "crop" in kinds
        self.pad = (kinds["crop"] or max(1, min(h, w) // 8)) if self.crop else 0
        self.seed = int(seed)
        self._hw = (h, w, self.shape[2] if len(self.shape) == 3 else 1)

    def draws(self, epoch, ids):
        """(row offsets, column offsets, flip flags) of these samples."""
        base = _splitmix(np.array([(self.seed * 0x10001 + _SALT) % 2**64], np.uint64)
                         ^ _splitmix(np.array([int(epoch) % 2**64], np.uint64)))
        key = _splitmix(np.asarray(ids, np.uint64) * _GOLDEN + base)
        span = np.uint64(2 * self.pad + 1)
        dy = ((key & np.uint64(0xFFFF)) % span).astype(np.intp)
        dx = (((key >> np.uint64(16)) & np.uint64(0xFFFF)) % span).astype(np.intp)
        flip = ((key >> np.uint64(32)) & np.uint64(1)).astype(bool)
        return dy, dx, flip

    def apply(self, batch, epoch, ids):
        h, w, c = self._hw
        x = batch.reshape(len(batch), h, w, c)
        dy, dx, flip = self.draws(epoch, ids)
        if self.crop:
            p = self.pad
            padded = np.zeros((len(x), h + 2 * p, w + 2 * p, c), np.uint8)
            padded[:, p:p + h, p:p + w] = x
            rows = dy[:, None] + np.arange(h)
            cols = dx[:, None] + np.arange(w)
            x[...] = padded[np.arange(len(x))[:, None, None], rows[:, :, None], cols[:, None, :]]
        if self.flip and flip.any():
            x[flip] = x[flip, :, ::-1]
        return batch
