"""Download MNIST or Fashion-MNIST's four .gz files and verify their published MD5.

    python -m hpctrain.data fetch --dataset mnist --out data/raw/mnist
    python -m hpctrain.data prepare --source data/raw/mnist --out data/mnist --force

A file is renamed into place only after its checksum matches, so --out never
holds a partial or wrong file under a real name. Network trouble is one
HpctrainError line naming the URL. No MPI here (house rule).
"""

import hashlib
import http.client
import os
import socket
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from hpctrain.errors import HpctrainError

STANDARD_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}

MIRRORS = {
    "mnist": "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "fashion-mnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
}

# Published MD5s (torchvision's tables; Fashion-MNIST's also in Zalando's README).
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
}


def fetch(dataset, out, mirror=None, log=print, timeout=60):
    """Download dataset's four .gz files into out, verified against MD5; return their paths.

    A file already present with the right checksum is kept. Each download goes
    to a temporary name and is renamed only after its checksum matches, so out
    never holds a partial or wrong file under a real name.
    """
    log = log or (lambda *a: None)
    if dataset not in MD5:
        raise HpctrainError(f"unknown dataset {dataset!r} (choose from {', '.join(MD5)})")
    base = (mirror or MIRRORS[dataset]).rstrip("/") + "/"
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HpctrainError(f"{out}: cannot create directory ({e.strerror})") from None

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
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.part-", dir=out)
        try:
            with os.fdopen(fd, "wb") as f:
                got = _download(url, f, timeout)
            if got != expected:
                raise HpctrainError(f"{url}: checksum mismatch (md5 {got}, expected "
                                    f"{expected}); download discarded")
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return paths


def _download(url, f, timeout):
    h = hashlib.md5(usedforsecurity=False)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            for block in iter(lambda: r.read(1 << 20), b""):
                h.update(block)
                f.write(block)
    except urllib.error.HTTPError as e:
        raise HpctrainError(f"{url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            raise _timeout(url, timeout) from None
        raise HpctrainError(f"{url}: cannot download ({e.reason}); "
                            f"offline? use --mirror URL") from None
    except (socket.timeout, TimeoutError):
        raise _timeout(url, timeout) from None
    except (OSError, http.client.HTTPException) as e:
        raise HpctrainError(f"{url}: download failed ({e})") from None
    return h.hexdigest()


def _timeout(url, timeout):
    return HpctrainError(f"{url}: no response within {timeout:g} s "
                         f"(network down or blocked? try --mirror URL)")


def _md5(path):
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
