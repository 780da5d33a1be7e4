"""A folder of images, one subfolder per class, into prepare's uint8 arrays
(torchvision's ImageFolder, Keras' image_dataset_from_directory), and the
one way an image file becomes a model's input (prepare and predict share it).

    python -m hpctrain.data prepare --source photos --out data/photos --image-size 32,32
    photos/train/cat/001.png ...  photos/train/dog/...   [photos/test/cat/... : kept as the test set]
    photos/cat/001.png ...        (no train/: --test-fraction of each class is split off)

Classes are the subfolders' names in sorted order (label 0 the first); files
are taken in sorted order of their paths, in subfolders too; hidden files and
files that are not PNG or JPEG are skipped. Each image goes through Pillow:
EXIF orientation applied, converted to grayscale ("L", 2-D images; with
--grayscale, or when every image is grayscale) or RGB (alpha dropped), then
resized to --image-size H,W (bilinear) if given; without it every image
must already have one size. The manifest records how (`preprocess`), the
--save file and checkpoints carry that record, and predict applies it to new
images (`to_input`).

Refused with one line, before anything is written: an image Pillow cannot
read or that is truncated, mixed sizes without --image-size, an empty class
folder, one class only, more than 256 classes, a test class that training
does not have, a symbolic link that leads out of the source folder, and a
set larger than the memory it needs (said after reading the headers, before
decoding). Pillow is an optional dependency: pip install 'hpctrain[images]'.

No MPI here (house rule).
"""

import hashlib
import os
from pathlib import Path

import numpy as np

from hpctrain.errors import HpctrainError

from .arrays import MAX_CLASSES, Loaded, check_memory

EXTENSIONS = (".png", ".jpg", ".jpeg")
RESAMPLE = "bilinear"
_GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"}
_EXIF_ORIENTATION = 0x0112


def pillow():
    """PIL's Image and ImageOps modules, or one line saying how to get them."""
    try:
        from PIL import Image, ImageOps
    except ImportError:
        raise HpctrainError("images need Pillow, an optional dependency: pip install 'hpctrain[images]' "
                            "(or pip install pillow)") from None
    return Image, ImageOps


def has_class_folders(source):
    """Whether source looks like an image folder: it has subfolders (not hidden)."""
    try:
        return any(e.is_dir() and not e.name.startswith(".") for e in os.scandir(source))
    except OSError:
        return False


# ---------------------------------------------------------------------------
# One image

def _unreadable(path, e):
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return HpctrainError(f"{path}: unreadable image ({text}); replace or remove it")


def _header(path):
    """((width, height) as it will be seen, Pillow's mode) from the file's header."""
    Image, _ = pillow()
    try:
        with Image.open(path) as im:
            w, h = im.size
            if im.getexif().get(_EXIF_ORIENTATION, 1) in (5, 6, 7, 8):   # rotated by 90 degrees
                w, h = h, w
            return (w, h), im.mode
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _unreadable(path, e) from None


def decode(path, mode, size=None):
    """The image at path as uint8 (H, W) ("L") or (H, W, 3) ("RGB"): EXIF
    orientation applied, converted to mode, resized to size=(H, W) (bilinear)
    when given and different."""
    Image, ImageOps = pillow()
    try:
        with Image.open(path) as im:
            im = ImageOps.exif_transpose(im)
            im = im.convert(mode)   # decodes the whole file: a truncated one raises here
            if size is not None and im.size != (size[1], size[0]):
                im = im.resize((size[1], size[0]), Image.Resampling.BILINEAR)
            return np.asarray(im, np.uint8)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _unreadable(path, e) from None


def to_input(path, image_shape, preprocess=None):
    """A new image for a model trained on images of image_shape ((H, W) or
    (H, W, 3)), made the way prepare made the training images: grayscale or
    RGB after the shape's channels, resized (bilinear) to H x W."""
    image_shape = tuple(image_shape)
    if len(image_shape) == 3 and image_shape[2] != 3:
        raise HpctrainError(f"{path}: the model takes {'x'.join(map(str, image_shape))} inputs; images have 1 or 3 "
                            f"channels")
    mode = "L" if len(image_shape) == 2 else "RGB"
    return decode(path, mode, image_shape[:2])


# ---------------------------------------------------------------------------
# The folder

def _inside(root, path):
    """HpctrainError unless path, a link's target included, stays inside root."""
    target = path.resolve()
    if target != root and root not in target.parents:
        raise HpctrainError(f"{path}: a symbolic link to {target}, outside the source folder {root}; copy the file "
                            f"in instead")
    return target


def _images_under(root, top, seen=None):
    """Image files under top, in sorted order of their paths; links checked."""
    seen = set() if seen is None else seen
    try:
        entries = sorted(os.scandir(top), key=lambda e: e.name)
    except OSError as e:
        raise HpctrainError(f"{top}: cannot list ({e.strerror or e})") from None
    for e in entries:
        if e.name.startswith("."):
            continue
        path = Path(e.path)
        if e.is_symlink():
            real = _inside(root, path)
        else:
            real = path
        if e.is_dir():
            if real in seen:   # a link back up the tree: no loop
                continue
            seen.add(real)
            yield from _images_under(root, path, seen)
        elif e.is_file() and e.name.lower().endswith(EXTENSIONS):
            yield path


def _class_folders(root, top):
    """[(name, path)] of the class folders in top, sorted by name."""
    try:
        entries = sorted((e for e in os.scandir(top) if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as e:
        raise HpctrainError(f"{top}: cannot list ({e.strerror or e})") from None
    folders = []
    for e in entries:
        path = Path(e.path)
        if e.is_symlink():
            _inside(root, path)
        if e.is_dir():
            folders.append((e.name, path))
    return folders


def _scan(root, top, names=None):
    """[(path, label)] of every image under top's class folders; the class
    names (sorted folder names, or, for a test folder, training's)."""
    folders = _class_folders(root, top)
    if names is None:
        names = [name for name, _ in folders]
        if len(names) < 2:
            found = f"one class folder ({names[0]})" if names else "no class folders"
            raise HpctrainError(f"{top}: {found}; a classifier needs a subfolder of images for each of at least "
                                f"two classes")
        if len(names) > MAX_CLASSES:
            raise HpctrainError(f"{top}: {len(names)} class folders; hpctrain stores labels as bytes, at most "
                                f"{MAX_CLASSES} classes")
    index = {name: i for i, name in enumerate(names)}
    found = []
    for name, path in folders:
        if name not in index:
            raise HpctrainError(f"{path}: a test class that the training folder does not have (its classes: "
                                f"{', '.join(names)})")
        files = list(_images_under(root, path, {path.resolve()}))
        if not files:
            raise HpctrainError(f"{path}: an empty class (no {', '.join(e[1:].upper() for e in EXTENSIONS)} "
                                f"images in it)")
        found += [(p, index[name]) for p in files]
    return found, names


def _digest(root, files):
    """One sha256 over every file's path (relative to root) and content hash."""
    h = hashlib.sha256()
    total = 0
    for path, _ in files:
        file_hash = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                file_hash.update(block)
                total += len(block)
        h.update(f"{path.relative_to(root).as_posix()}\0{file_hash.hexdigest()}\n".encode())
    return h.hexdigest(), total


def load_folder(source, size=None, grayscale=False):
    """Loaded: the folder's images and labels (train, and test if a test/
    folder is there), the class names and the preprocess record."""
    pillow()
    source = Path(source)
    root = source.resolve()
    parts = {"train": source / "train", "test": source / "test"}
    if parts["train"].is_dir():
        others = [name for name, _ in _class_folders(root, source) if name not in parts]
        if others:
            raise HpctrainError(f"{source}: holds train/ and also {', '.join(o + '/' for o in others)}; put the "
                                f"training classes in train/, the test classes in test/ (a validation part: "
                                f"prepare --val-fraction F)")
        _inside(root, parts["train"])
        train, names = _scan(root, parts["train"])
        test = _scan(root, parts["test"], names)[0] if parts["test"].is_dir() else None
        if test == []:
            raise HpctrainError(f"{parts['test']}: no class folders; give it a subfolder of images per class, or "
                                f"remove it to split --test-fraction off the training images")
    else:
        train, names = _scan(root, source)
        test = None
    everything = train + (test or [])

    # Headers first: sizes and modes, then the memory, before any image is decoded.
    heads = [_header(p) for p, _ in everything]
    if grayscale or all(mode in _GRAY_MODES for _, mode in heads):
        mode = "L"
    else:
        mode = "RGB"
    if size is None:
        first = heads[0][0]
        for (path, _), (wh, _) in zip(everything, heads):
            if wh != first:
                raise HpctrainError(
                    f"{source}: images of different sizes: {everything[0][0].relative_to(source)} is "
                    f"{first[1]}x{first[0]}, {path.relative_to(source)} is {wh[1]}x{wh[0]} (height x width); "
                    f"give --image-size H,W to resize them all")
        shape = (first[1], first[0])
    else:
        shape = tuple(size)
    image_shape = shape + ((3,) if mode == "RGB" else ())
    check_memory(source, len(everything) * int(np.prod(image_shape)))

    def arrays(files):
        x = np.empty((len(files), *image_shape), np.uint8)
        for i, (path, _) in enumerate(files):
            x[i] = decode(path, mode, size)
        return x, np.array([label for _, label in files], np.uint8)

    entries = []
    for role, files in (("train", train), ("test", test)):
        if files:
            digest, total = _digest(root, files)
            folder = parts[role] if parts["train"].is_dir() else source
            entries.append({"role": role, "name": folder.name, "count": len(files), "bytes": total,
                            "sha256": digest})
    preprocess = {"kind": "image-folder", "mode": mode, "image_shape": list(image_shape),
                  "resize": list(size) if size is not None else None, "resample": RESAMPLE,
                  "exif_transpose": True}
    return Loaded("image-folder", entries, arrays(train), arrays(test) if test else None,
                  class_names=names, preprocess=preprocess)
