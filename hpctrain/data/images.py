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
must already have one size. 16-bit grayscale (PNG's deepest) is scaled to
0..255 (to_8bit), not clipped. Paths are taken as given, relative ones from
the working directory. An image over Pillow's decompression-bomb size is one
warning line (large_images), past twice that an error. The manifest records
how (`preprocess`), the --save file and checkpoints carry that record, and
predict applies it to new images (`to_input`).

Refused with one line, before anything is written: an image Pillow cannot
read or that is truncated, mixed sizes without --image-size, an empty class
folder, one class only, more than 256 classes, a test class that training
does not have, test/ or val/ beside class folders without train/ (it
would be a class), a class folder name that is not UTF-8, a symbolic link
that leads out of the source folder, to nothing, round in a loop, or (a
folder link) back up to its class folder or above it, or into or above
another class folder (images taken again, or in two classes), and a set
larger than the memory it needs (said after reading the headers, before
decoding). Pillow is an optional dependency: pip install 'hpctrain[images]'.

No MPI here (house rule).
"""

import errno
import hashlib
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from hpctrain.base.errors import HpctrainError

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


def stderr_warning(line):
    print(f"hpctrain: warning: {line}", file=sys.stderr, flush=True)


def shown(path):
    """path as a message shows it: a name that is not UTF-8 (an old archive's
    latin-1) with its odd bytes as \\xNN, not as a traceback."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


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
    return HpctrainError(f"{shown(path)}: unreadable image ({text}); replace or remove it")


def _too_large(path, e):
    return HpctrainError(f"{shown(path)}: too large to decode safely ({str(e).rstrip('.')}); shrink the image")


def _bomb_pixels():
    """Pillow's size past which it warns of a decompression bomb (twice that: an error)."""
    Image, _ = pillow()
    return Image.MAX_IMAGE_PIXELS or float("inf")


@contextmanager
def _opened(path):
    """The image at path opened by Pillow, its errors as one line each.
    Pillow's two-line decompression-bomb warning is silenced: prepare and
    predict say it in a line of their own (large_images)."""
    Image, _ = pillow()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(path)
        with im:
            yield im
    except Image.DecompressionBombError as e:
        raise _too_large(path, e) from None
    except (OSError, SyntaxError, ValueError) as e:
        raise _unreadable(path, e) from None


def _header(path):
    """((width, height) as it will be seen, Pillow's mode) from the file's header."""
    with _opened(path) as im:
        w, h = im.size
        if im.getexif().get(_EXIF_ORIENTATION, 1) in (5, 6, 7, 8):   # rotated by 90 degrees
            w, h = h, w
        return (w, h), im.mode


def large_images(paths, sizes):
    """One line about the images over Pillow's decompression-bomb size
    (instead of its two-line warning for each), or None."""
    big = [(w * h, path, (w, h)) for path, (w, h) in zip(paths, sizes) if w * h > _bomb_pixels()]
    if not big:
        return None
    pixels, path, (w, h) = max(big, key=lambda b: b[0])
    return (f"{len(big)} image{'s' if len(big) > 1 else ''} over {_bomb_pixels() / 1e6:.0f} megapixels, where "
            f"Pillow warns of decompression bombs (the largest: {shown(path)}, {h}x{w}, {pixels / 1e6:.0f} "
            f"megapixels): decoding each takes about {pixels * 4 / 2**30:.1f} GiB of memory")


def to_8bit(im, path, file_format):
    """A 16-bit grayscale image (Pillow's "I;16" modes, and "I" from a PNG,
    whose deepest grayscale is 16 bits) scaled from 0..65535 to 0..255 as
    8-bit "L"; Pillow's own convert clips it instead (every value above 255
    becomes white). Other images as they are; a 32-bit integer or a float
    image, whose range the file does not say, is refused. file_format:
    the file's (Pillow's im.format), which a transposed copy has lost."""
    Image, _ = pillow()
    if im.mode.startswith("I;16") or (im.mode == "I" and file_format == "PNG"):
        wide = np.asarray(im).astype(np.uint32)
        return Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8), "L")
    if im.mode in ("I", "F"):
        kind = "32-bit integer" if im.mode == "I" else "floating-point"
        raise HpctrainError(f"{shown(path)}: a {kind} image, whose range of values the file does not say; "
                            f"save it as an 8- or 16-bit PNG")
    return im


def decode(path, mode, size=None):
    """The image at path as uint8 (H, W) ("L") or (H, W, 3) ("RGB"): EXIF
    orientation applied, 16-bit grayscale scaled to 8 bits (to_8bit),
    converted to mode, resized to size=(H, W) (bilinear) when given and
    different. prepare and predict both make their pixels here."""
    Image, ImageOps = pillow()
    with _opened(path) as im:
        file_format = im.format
        im = ImageOps.exif_transpose(im)
        im = to_8bit(im, path, file_format).convert(mode)   # decodes the whole file: a truncated one raises here
        if size is not None and im.size != (size[1], size[0]):
            im = im.resize((size[1], size[0]), Image.Resampling.BILINEAR)
        return np.asarray(im, np.uint8)


def to_input(path, image_shape, preprocess=None, warn=stderr_warning):
    """A new image for a model trained on images of image_shape ((H, W) or
    (H, W, 3)), made the way prepare made the training images: grayscale or
    RGB after the shape's channels, resized (bilinear) to H x W. warn: where
    the line about an image over Pillow's decompression-bomb size goes."""
    image_shape = tuple(image_shape)
    if len(image_shape) == 3 and image_shape[2] != 3:
        raise HpctrainError(f"{path}: the model takes {'x'.join(map(str, image_shape))} inputs; images have 1 or 3 "
                            f"channels")
    line = large_images([path], [_header(path)[0]])
    if line:
        warn(line)
    mode = "L" if len(image_shape) == 2 else "RGB"
    return decode(path, mode, image_shape[:2])


# ---------------------------------------------------------------------------
# The folder

def _link_target(path):
    """Where the link at path leads, every link on the way followed; a loop
    or a link to nothing is one line."""
    try:
        return path.resolve(strict=True)
    except FileNotFoundError:
        raise HpctrainError(f"{shown(path)}: a symbolic link to {shown(os.readlink(path))}, which does not exist; "
                            f"remove the link or restore its target") from None
    except (RuntimeError, OSError) as e:   # a loop: RuntimeError before Python 3.13, OSError (ELOOP) since
        if isinstance(e, OSError) and e.errno != errno.ELOOP:
            raise HpctrainError(f"{shown(path)}: cannot follow the symbolic link ({e.strerror or e})") from None
        raise HpctrainError(f"{shown(path)}: a symbolic link loop (it leads back to itself); remove it") from None


def _inside(root, path, target):
    """HpctrainError unless a link's target stays inside root."""
    if target != root and root not in target.parents:
        raise HpctrainError(f"{shown(path)}: a symbolic link to {shown(target)}, outside the source folder "
                            f"{shown(root)}; copy the file in instead")


def _nested(a, b):
    """Whether resolved folders a and b are one, or one holds the other."""
    return a == b or a in b.parents or b in a.parents


def _check_folder_link(path, target, own, classes, entered):
    """A folder link in class folder own = (name, resolved path) may lead
    neither back up (to own or above it: a loop that takes own's images
    again and every other class's as own's), nor into or above another class
    folder (its images in two classes), nor where this class has been."""
    name, real = own
    if target == real or target in real.parents:
        where = "this class folder" if target == real else "above this class folder"
        others = "" if target == real else f", and every other class's as {name}"
        raise HpctrainError(f"{shown(path)}: a symbolic link back up to {shown(target)} ({where}): a loop that "
                            f"would take its images again{others}; remove the link")
    for other in classes:
        if _nested(target, other):
            twice = "taken twice" if other == real else f"in two classes, one of them {name}"
            raise HpctrainError(f"{shown(path)}: a symbolic link to {shown(target)}, which is in or holds the class "
                                f"folder {shown(other)}: its images would be {twice}; remove the link")
    if target in entered:
        raise HpctrainError(f"{shown(path)}: a symbolic link to {shown(target)}, which class {name} has already "
                            f"been through (a loop); remove the link")


def _images_under(root, classes, own, top, entered):
    """Image files under top (a class folder, or a folder in one), in sorted
    order of their paths; links followed where _inside and
    _check_folder_link allow. classes: every class folder, resolved."""
    try:
        entries = sorted(os.scandir(top), key=lambda e: e.name)
    except OSError as e:
        raise HpctrainError(f"{shown(top)}: cannot list ({e.strerror or e})") from None
    for e in entries:
        if e.name.startswith("."):
            continue
        path = Path(e.path)
        if e.is_symlink():
            target = _link_target(path)
            _inside(root, path, target)
            if target.is_dir():
                _check_folder_link(path, target, own, classes, entered)
                entered.add(target)
        if e.is_dir():
            yield from _images_under(root, classes, own, path, entered)
        elif e.is_file() and e.name.lower().endswith(EXTENSIONS):
            yield path


def _class_folders(root, top):
    """[(name, path, resolved path)] of the class folders in top, sorted by
    name; a name that is not UTF-8 is refused (it becomes the class's name in
    the manifest, the --save file and predictions)."""
    try:
        entries = sorted((e for e in os.scandir(top) if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as e:
        raise HpctrainError(f"{shown(top)}: cannot list ({e.strerror or e})") from None
    folders = []
    for e in entries:
        path = Path(e.path)
        if e.is_symlink():
            real = _link_target(path)
            _inside(root, path, real)
        else:
            real = path.resolve()
        if e.is_dir():
            try:
                e.name.encode("utf-8")
            except UnicodeEncodeError:
                raise HpctrainError(f"{shown(path)}: a class folder whose name is not UTF-8 (an old archive's "
                                    f"latin-1?); rename it: its name is the class's name") from None
            folders.append((e.name, path, real))
    return folders


def _layout(root, source):
    """(the folder of the training classes, that of the test classes or
    None): source/train and source/test, or source itself."""
    names = [name for name, _, _ in _class_folders(root, source)]
    if "train" in names:
        others = [name for name in names if name not in ("train", "test")]
        if others:
            raise HpctrainError(f"{shown(source)}: holds train/ and also {', '.join(shown(o) + '/' for o in others)}; "
                                f"put the training classes in train/, the test classes in test/ (a validation "
                                f"part: prepare --val-fraction F)")
        return source / "train", source / "test" if "test" in names else None
    splits = [name + "/" for name in names if name in ("test", "val")]
    if splits:
        raise HpctrainError(f"{shown(source)}: holds {' and '.join(splits)} beside class folders but no train/, so "
                            f"{splits[0]} would be taken as a class; put the training classes in train/, the test "
                            f"classes in test/ beside it (a validation part: prepare --val-fraction F)")
    return source, None


def _class_names(top, folders):
    """The training folder's class names, sorted; two to MAX_CLASSES of them."""
    names = [name for name, _, _ in folders]
    if len(names) < 2:
        found = f"one class folder ({names[0]})" if names else "no class folders"
        raise HpctrainError(f"{shown(top)}: {found}; a classifier needs a subfolder of images for each of at least "
                            f"two classes")
    if len(names) > MAX_CLASSES:
        raise HpctrainError(f"{shown(top)}: {len(names)} class folders; hpctrain stores labels as bytes, at most "
                            f"{MAX_CLASSES} classes")
    return names


def _check_apart(folders):
    """Class folders that are one folder, or one inside another, through a
    link would put the same images in two classes (or in both splits)."""
    for i, (_, a_path, a) in enumerate(folders):
        for _, b_path, b in folders[i + 1:]:
            if _nested(a, b):
                raise HpctrainError(f"{shown(a_path)} and {shown(b_path)}: one folder, or one inside the other, "
                                    f"through a symbolic link: their images would be in two classes; remove the "
                                    f"link")


def _scan(root, classes, folders, names):
    """[(path, label)] of every image under the class folders, labelled by
    names (training's, for the test folder's too)."""
    index = {name: i for i, name in enumerate(names)}
    found = []
    for name, path, real in folders:
        if name not in index:
            raise HpctrainError(f"{shown(path)}: a test class that the training folder does not have (its classes: "
                                f"{', '.join(names)})")
        files = list(_images_under(root, classes, (name, real), path, set()))
        if not files:
            raise HpctrainError(f"{shown(path)}: an empty class (no {', '.join(e[1:].upper() for e in EXTENSIONS)} "
                                f"images in it)")
        found += [(p, index[name]) for p in files]
    return found


def _digest(source, files):
    """One sha256 over every file's path (relative to source, as bytes: a
    name need not be UTF-8) and content hash."""
    h = hashlib.sha256()
    total = 0
    for path, _ in files:
        file_hash = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                file_hash.update(block)
                total += len(block)
        h.update(os.fsencode(path.relative_to(source).as_posix()) + f"\0{file_hash.hexdigest()}\n".encode())
    return h.hexdigest(), total


def _shape_and_mode(source, files, heads, size, grayscale):
    """(image shape, Pillow mode) of the prepared images, from the files'
    headers: grayscale when asked or when every image is, one size (given,
    or the images' own, which must then agree)."""
    mode = "L" if grayscale or all(m in _GRAY_MODES for _, m in heads) else "RGB"
    if size is None:
        first = heads[0][0]
        for (path, _), (wh, _) in zip(files, heads):
            if wh != first:
                raise HpctrainError(
                    f"{shown(source)}: images of different sizes: {shown(files[0][0].relative_to(source))} is "
                    f"{first[1]}x{first[0]}, {shown(path.relative_to(source))} is {wh[1]}x{wh[0]} (height x width); "
                    f"give --image-size H,W to resize them all")
        size = (first[1], first[0])
    return tuple(size) + ((3,) if mode == "RGB" else ()), mode


def load_folder(source, size=None, grayscale=False, warn=stderr_warning):
    """Loaded: the folder's images and labels (train, and test if a test/
    folder is there), the class names and the preprocess record. Every path
    is taken as given (relative ones from the working directory); links are
    compared resolved. warn: where the line about images over Pillow's
    decompression-bomb size goes."""
    pillow()
    source = Path(source)
    root = source.resolve()
    train_dir, test_dir = _layout(root, source)
    train_folders = _class_folders(root, train_dir)
    names = _class_names(train_dir, train_folders)
    test_folders = _class_folders(root, test_dir) if test_dir else []
    if test_dir and not test_folders:
        raise HpctrainError(f"{shown(test_dir)}: no class folders; give it a subfolder of images per class, or "
                            f"remove it to split --test-fraction off the training images")
    _check_apart(train_folders + test_folders)
    classes = [real for _, _, real in train_folders + test_folders]
    train = _scan(root, classes, train_folders, names)
    test = _scan(root, classes, test_folders, names) if test_dir else None
    everything = train + (test or [])

    # Headers first: sizes and modes, then the memory, before any image is decoded.
    heads = [_header(p) for p, _ in everything]
    line = large_images([p for p, _ in everything], [wh for wh, _ in heads])
    if line:
        warn(line)
    image_shape, mode = _shape_and_mode(source, everything, heads, size, grayscale)
    check_memory(source, len(everything) * int(np.prod(image_shape)))

    def arrays(files):
        x = np.empty((len(files), *image_shape), np.uint8)
        for i, (path, _) in enumerate(files):
            x[i] = decode(path, mode, size)
        return x, np.array([label for _, label in files], np.uint8)

    entries = []
    for role, files, folder in (("train", train, train_dir), ("test", test, test_dir)):
        if files:
            digest, total = _digest(source, files)
            name = (root if folder == source else folder).name   # "photos" however it was spelt
            entries.append({"role": role, "name": name, "count": len(files), "bytes": total, "sha256": digest})
    preprocess = {"kind": "image-folder", "mode": mode, "image_shape": list(image_shape),
                  "resize": list(size) if size is not None else None, "resample": RESAMPLE,
                  "exif_transpose": True}
    return Loaded("image-folder", entries, arrays(train), arrays(test) if test else None,
                  class_names=names, preprocess=preprocess)
