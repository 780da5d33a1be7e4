"""`hpctrain data verify DIR`: every file a prepared directory's manifest
lists (its shards, a BPE's tokenizer.json), hashed again and compared with
the sha256 prepare recorded. A training start checks sizes and headers only
(tokens.py), so that its time does not grow with the corpus; this is the
check that reads every byte, run when the data is copied or suspected.

    hpctrain data verify data/shakespeare-chars
    mpirun -n 4 hpctrain data verify data/corpus     # the files dealt over the ranks

`listed_files` names what to hash and `check_file` hashes one; dealing them
over ranks and reporting is the command's (data/__main__.py). No MPI here
(house rule).
"""
from pathlib import Path

from .manifest import _sha256, load_manifest

SPLITS = ("train", "test", "val")


def listed_files(data_dir):
    """[(name, bytes or None, sha256)] of every file the manifest of
    data_dir lists with a hash, each once (text's "val" is its "test"
    shard), in the manifest's order."""
    manifest = load_manifest(data_dir)
    entries = [e for split in SPLITS if split in manifest for e in manifest[split]["shards"]]
    if isinstance(manifest.get("tokenizer"), dict):
        entries.append(manifest["tokenizer"])
    files, seen = [], set()
    for e in entries:
        if e["file"] not in seen:
            seen.add(e["file"])
            files.append((e["file"], e.get("bytes"), e["sha256"]))
    return files


def check_file(data_dir, name, size, sha256):
    """What is wrong with one listed file (None if nothing): missing, its
    size or its sha256 not the manifest's."""
    path = Path(data_dir) / name
    if not path.is_file():
        return "missing"
    if size is not None and path.stat().st_size != size:
        return f"{path.stat().st_size} bytes, the manifest says {size}"
    try:
        got = _sha256(path)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if got != sha256:
        return f"sha256 {got[:12]}..., the manifest says {sha256[:12]}..."
    return None
