"""Download a dataset's published files and verify their published MD5.

    python -m hpctrain.data fetch --dataset mnist --out data/raw/mnist
    python -m hpctrain.data prepare --source data/raw/mnist --out data/mnist --force

MNIST, Fashion-MNIST and KMNIST are four IDX .gz files each. EMNIST comes as
one zip of .gz files (all six splits); the chosen split's four files
(--split, default balanced) are taken out of it. CIFAR-10 comes as one
tar.gz; its six binary batches are taken out of it. Only the named members
are extracted, only regular files, each to a name chosen here (never the
archive's path), so an archive cannot write outside --out.

A file is renamed into place only after its checksum matches, so --out never
holds a partial or wrong file under a real name. A download is bounded in
size (the announced length, never more than MAX_BYTES) and in time (--timeout
without a byte, and a deadline for the whole file), and its temporary file is
removed on every way out, SIGTERM and Ctrl-C included. Network trouble is one
HpctrainError line naming the URL. No MPI here (house rule).
"""

import contextlib
import hashlib
import http.client
import os
import signal
import socket
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
import zlib
from pathlib import Path

from hpctrain.base.errors import HpctrainError, signals_raise


STANDARD_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}

MIRRORS = {
    "mnist": "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "fashion-mnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "kmnist": "http://codh.rois.ac.jp/kmnist/dataset/kmnist/",
    "emnist": "https://biometrics.nist.gov/cs_links/EMNIST/",
    "cifar-10": "https://www.cs.toronto.edu/~kriz/",
}

# Published MD5s (torchvision's tables; Fashion-MNIST's also in Zalando's
# README, KMNIST's in torchvision's KMNIST, EMNIST's zip in torchvision's
# EMNIST, CIFAR-10's binary archive on its page, cs.toronto.edu/~kriz/cifar.html).
# The one place checksums live, so a test can swap in its own.
MD5 = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion-mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
    "kmnist": {
        "train-images-idx3-ubyte.gz": "bdb82020997e1d708af4cf47b453dcf7",
        "train-labels-idx1-ubyte.gz": "e144d726b3acfaa3e44228e80efcd344",
        "t10k-images-idx3-ubyte.gz": "5c965bf0a639b31b8f53240b1b52f4d7",
        "t10k-labels-idx1-ubyte.gz": "7320c461ea6c1c855c0b718fb2a4b134",
    },
    "emnist": {
        "gzip.zip": "58c8d27c78d21e728a6bc7b3cc06412e",
    },
    "cifar-10": {
        "cifar-10-binary.tar.gz": "c32a1d4ab5d03f1284b67883e8d87530",
    },
}

# The most one file of each dataset may be: its largest published file with
# margin (Fashion-MNIST's training images are 26 MB, EMNIST's zip 536 MB,
# CIFAR-10's archive 163 MB). A server sending more is not the dataset's: the
# download stops there, not when the disk is full. A test can swap in its own.
MAX_BYTES = {"mnist": 64 << 20, "fashion-mnist": 64 << 20, "kmnist": 64 << 20,
             "emnist": 768 << 20, "cifar-10": 256 << 20}
# A whole file must arrive at this average rate (bytes/s), on top of --timeout:
# a server that trickles a byte now and then is never silent for --timeout.
MIN_RATE = 32 << 10

EMNIST_SPLITS = ("balanced", "byclass", "bymerge", "digits", "letters", "mnist")
CIFAR10_BATCHES = tuple(f"data_batch_{i}.bin" for i in range(1, 6)) + ("test_batch.bin",)
# Larger members than these are not what the archives hold: a damaged or
# hostile archive must not fill the disk. (EMNIST byclass's training images,
# the largest member, are ~170 MB gzipped; a CIFAR-10 batch is 30,730,000 bytes.)
_MAX_MEMBER_BYTES = 1 << 30


def archive_members(dataset, split="balanced"):
    """{member's file name in the archive: name written into --out} for an
    archive dataset, or None for one whose files are downloaded directly."""
    if dataset == "emnist":
        if split not in EMNIST_SPLITS:
            raise HpctrainError(f"unknown EMNIST split {split!r} (choose from "
                                f"{', '.join(EMNIST_SPLITS)})")
        return {f"emnist-{split}-{part}-ubyte.gz": f"emnist-{split}-{part}-ubyte.gz"
                for part in ("train-images-idx3", "train-labels-idx1",
                             "test-images-idx3", "test-labels-idx1")}
    if dataset == "cifar-10":
        return {name: name for name in CIFAR10_BATCHES}
    return None


def fetch(dataset, out, mirror=None, log=print, timeout=60, split="balanced"):
    """Download dataset's files into out, verified against MD5; return the
    paths that prepare reads (for EMNIST and CIFAR-10: the members taken out
    of the verified archive; split: EMNIST's split).

    A file already present with the right checksum is kept. Each download goes
    to a temporary name and is renamed only after its checksum matches, so out
    never holds a partial or wrong file under a real name.
    """
    log = log or (lambda *a: None)
    if dataset not in MD5:
        raise HpctrainError(f"unknown dataset {dataset!r} (choose from {', '.join(MD5)})")
    members = archive_members(dataset, split)
    base = (mirror or MIRRORS[dataset]).rstrip("/") + "/"
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HpctrainError(f"{out}: cannot create directory ({e.strerror})") from None

    with signals_raise(_stopped):
        paths = _fetch_files(dataset, base, out, log, timeout)
        if members is None:
            return paths
        return extract(paths[0], members, out, log)


def _fetch_files(dataset, base, out, log, timeout):
    paths = []
    for name, expected in MD5[dataset].items():
        dest = out / name
        paths.append(dest)
        if dest.is_file():
            if _md5(dest) == expected:
                log(f"{dest}: present, checksum ok")
                continue
            log(f"{dest}: checksum mismatch, downloading again")
        url = base + name
        log(f"downloading {url}")
        with _written(dest) as f:
            got = _download(url, f, timeout, MAX_BYTES[dataset])
            if got != expected:
                raise HpctrainError(f"{url}: checksum mismatch (md5 {got}, expected "
                                    f"{expected}); download discarded")
    return paths


def _stopped(num):
    # exit 128 + the signal, as shells report it
    return HpctrainError(f"fetch stopped by {signal.Signals(num).name}; the partial download was removed",
                         exit_code=128 + num)


# ---------------------------------------------------------------------------
# Archives: only the named regular files, each to a name chosen here

def extract(archive, members, out, log=print):
    """Write each wanted member of archive (zip or tar.gz, verified already)
    to out/members[name]; return their paths in members' order. A member is
    matched by its file name alone and must be a regular file; its path in
    the archive is never used, so nothing is written outside out."""
    log = log or (lambda *a: None)
    archive, out = Path(archive), Path(out)
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                found = {_base(i.filename): i for i in z.infolist()
                         if not i.is_dir() and _base(i.filename) in members}
                _check_found(archive, members, found)
                for name, info in found.items():
                    if info.file_size > _MAX_MEMBER_BYTES:
                        raise HpctrainError(f"{archive}: member {info.filename} claims "
                                            f"{info.file_size} bytes; not a genuine archive")
                    with z.open(info) as src:
                        _write_member(src, out / members[name], archive, info.filename)
        else:
            with tarfile.open(archive, "r:*") as t:
                found = {}
                for m in t:
                    if _base(m.name) in members:
                        if not m.isreg():   # a link or device: never followed or made
                            raise HpctrainError(f"{archive}: member {m.name} is not a "
                                                f"regular file; not a genuine archive")
                        if m.size > _MAX_MEMBER_BYTES:
                            raise HpctrainError(f"{archive}: member {m.name} claims {m.size} "
                                                f"bytes; not a genuine archive")
                        found[_base(m.name)] = m
                _check_found(archive, members, found)
                for name, m in found.items():
                    with t.extractfile(m) as src:
                        _write_member(src, out / members[name], archive, m.name)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error) as e:
        raise HpctrainError(f"{archive}: corrupt archive ({_one_line(e)})") from None
    except OSError as e:
        raise HpctrainError(f"{archive}: cannot extract ({_one_line(e)})") from None
    paths = [out / members[name] for name in members]
    log(f"{archive}: extracted {', '.join(p.name for p in paths)}")
    return paths


def _base(name):
    return name.replace("\\", "/").rsplit("/", 1)[-1]


def _check_found(archive, members, found):
    missing = [name for name in members if name not in found]
    if missing:
        raise HpctrainError(f"{archive}: no member {missing[0]} (wanted: {', '.join(members)})")


@contextlib.contextmanager
def _written(dest):
    """A file to write dest's bytes into: an exclusive temporary name next to
    it, renamed to dest when the block ends normally, removed if it raises
    (a download or extraction cut short never leaves a half file as dest)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.part-", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_member(src, dest, archive, member):
    """src's bytes to dest, at most _MAX_MEMBER_BYTES (the header may lie about the size)."""
    with _written(dest) as f:
        for block in iter(lambda: src.read(1 << 20), b""):
            f.write(block)
            if f.tell() > _MAX_MEMBER_BYTES:
                raise HpctrainError(f"{archive}: member {member} is larger than "
                                    f"{_MAX_MEMBER_BYTES} bytes; not a genuine archive")


def _download(url, f, timeout, limit):
    """url's body into f; its MD5. At most the announced length (never more
    than limit) and by a deadline: --timeout for the first byte and between
    any two, and the whole at MIN_RATE on top (checked between reads, so it
    ends by the deadline plus --timeout)."""
    h = hashlib.md5(usedforsecurity=False)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            length = _announced(r, url, limit)
            seconds = timeout + length / MIN_RATE
            deadline, got = time.monotonic() + seconds, 0
            while block := r.read1(1 << 20):
                got += len(block)
                if got > length:
                    raise HpctrainError(f"{url}: more than {length} bytes, more than any file "
                                        f"of this dataset; download discarded")
                if time.monotonic() > deadline:
                    raise HpctrainError(f"{url}: {got} of at most {length} bytes in {seconds:.1f} "
                                        f"s, slower than {MIN_RATE >> 10} KB/s; download "
                                        f"discarded (try --mirror URL)")
                h.update(block)
                f.write(block)
    except urllib.error.HTTPError as e:
        raise HpctrainError(f"{url}: HTTP {e.code} {_one_line(e.reason)}") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            raise _timeout(url, timeout) from None
        raise HpctrainError(f"{url}: cannot download ({_one_line(e.reason)}); "
                            f"offline? use --mirror URL") from None
    except (socket.timeout, TimeoutError):
        raise _timeout(url, timeout) from None
    except (OSError, http.client.HTTPException) as e:
        raise HpctrainError(f"{url}: download failed ({_one_line(e)})") from None
    return h.hexdigest()


def _announced(response, url, limit):
    """The body's length as the server announces it (Content-Length), or
    limit when it does not; a length beyond limit is refused before a byte."""
    length = response.length
    if length is None:
        return limit
    if length > limit:
        raise HpctrainError(f"{url}: the server announces {length} bytes, more than any "
                            f"file of this dataset ({limit}); not downloaded")
    return length


def _one_line(text):
    """An exception's text on one line (urllib's redirect loop and tarfile's
    "could not be opened" messages span several)."""
    return " ".join(str(text).split())


def _timeout(url, timeout):
    return HpctrainError(f"{url}: no response within {timeout:g} s "
                         f"(network down or blocked? try --mirror URL)")


def _md5(path):
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
