"""The class names of the datasets `fetch` knows, for prepare's manifest, so
that `predict` and `evaluate` print "Sneaker", not 7.

MNIST, Fashion-MNIST and KMNIST share their file names, so they are told
apart by their label files' published MD5 (fetch.MD5: the .gz files fetch
verified; the labels are what the names describe). EMNIST's split is in its
file names (emnist-balanced-train-...), CIFAR-10 is its own layout. A source
none of these recognise gets no names (the numbers stand in, as before).

    python -c "from hpctrain.data.known import CLASS_NAMES; print(CLASS_NAMES['fashion-mnist'])"

No MPI here (house rule).
"""
import hashlib
import string

from .fetch import MD5

_DIGITS = list(string.digits)
_MERGED = _DIGITS + list(string.ascii_uppercase) + list("abdefghnqrt")   # EMNIST's 47 merged classes

CLASS_NAMES = {
    "mnist": _DIGITS,
    "fashion-mnist": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                      "Ankle boot"],
    # Kuzushiji-MNIST: one hiragana each, romanised as in its README
    "kmnist": ["o", "ki", "su", "tsu", "na", "ha", "ma", "ya", "re", "wo"],
    "cifar-10": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"],
}
# EMNIST's splits (torchvision's names; letters' labels run 1..26, 0 unused)
EMNIST_CLASS_NAMES = {
    "byclass": _DIGITS + list(string.ascii_uppercase) + list(string.ascii_lowercase),
    "bymerge": _MERGED,
    "balanced": _MERGED,
    "letters": ["N/A"] + list(string.ascii_lowercase),
    "digits": _DIGITS,
    "mnist": _DIGITS,
}
_LABEL_FILES = ("train-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def class_names(layout, paths, num_classes):
    """The names of a recognised dataset's num_classes classes, or None.
    layout, paths: what sources._find_source_files found."""
    names = None
    if layout == "cifar-10":
        names = CLASS_NAMES["cifar-10"]
    elif layout == "standard":
        prefix = paths["train_labels"].name.split("-")
        if prefix[0] == "emnist":
            names = EMNIST_CLASS_NAMES.get(prefix[1])
        else:
            names = CLASS_NAMES.get(_dataset_of_labels(paths))
    # A source cut down or altered to other labels is not the dataset any more.
    return list(names) if names is not None and len(names) == num_classes else None


def _dataset_of_labels(paths):
    """The dataset whose published label files these are (by MD5), or None."""
    files = (paths["train_labels"], paths["test_labels"])
    if tuple(p.name for p in files) != _LABEL_FILES:
        return None
    digests = [hashlib.md5(p.read_bytes()).hexdigest() for p in files]
    for dataset in CLASS_NAMES:
        published = MD5.get(dataset, {})
        if all(published.get(p.name) == d for p, d in zip(files, digests)):
            return dataset
    return None
