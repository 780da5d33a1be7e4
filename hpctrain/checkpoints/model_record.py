"""What the --save file and every checkpoint record beside the parameters so
that the trained model can be rebuilt and fed new images outside training
(trained.load, for predict and evaluate): written by the chief at --save,
--keep-best and every checkpoint (report/params.py, pipeline/whole.py,
checkpoints/resume.py). Apart from the loader, so that the writers need not
import what reads a model back (trained.py imports checkpoints/).

The record is one attribute, `inference`, a JSON object: the model as the
flags named it (`model`: a zoo name, or a user's FILE.py:FUNCTION made
absolute; `hidden`), the input shape and class count it was built for, and
from the data's manifest the class names (image folders), the record of how
the images were prepared (`preprocess`), `no_flip`, where the data was and
its manifest digest; for text, the vocabulary (`text`: data/vocab.py's
record_entry, the characters or the BPE compressed), so that `hpctrain
generate` needs no data directory.

    python -c "import h5py; print(h5py.File('p.h5').attrs['inference'])"
"""
import functools
import hashlib
import json
import os

from .. import data as data_mod
from ..base.errors import HpctrainError
from ..flags.model_names import is_model_file

ATTR = "inference"
# The record is a variable-length string attribute: HDF5 keeps its bytes in
# the file's global heap, not in the object header, so the header's 64 KiB
# does not bound it (a 4 MB record written and read back by h5py 3.x, HDF5
# 2.0). What bounds it is this cap, against a record without end: one
# larger leaves its class names out (predict then prints numbers), then its
# vocabulary (generate then needs --data). A 32768-token BPE of the plays
# packs to about 0.5 MB.
MAX_RECORD = 16 << 20


@functools.lru_cache(maxsize=8)
def _from_manifest(data_dir):
    """What the record takes from a data directory's manifest (read once)."""
    manifest = data_mod.load_manifest(data_dir)
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    out = {"class_names": manifest.get("class_names"), "preprocess": manifest.get("preprocess"),
           "no_flip": bool(manifest.get("no_flip", False)), "data": str(data_dir), "data_digest": digest}
    if manifest.get("kind") == "tokens":
        out["text"] = data_mod.load_vocabulary(data_dir, manifest).record_entry()
    return json.dumps(out)


def record(spec, plan):
    """{"inference": JSON} for the file that holds spec's parameters (plan:
    run/plan.Plan: the model as named, --hidden, the data). Never raises for
    the data: a manifest gone since start-up leaves its part out."""
    model = plan.model
    if is_model_file(model):
        path, _, function = model.rpartition(":")
        model = f"{os.path.abspath(path)}:{function}"
    out = {"model": model, "hidden": [int(w) for w in plan.hidden], "identity": spec.identity,
           "input_shape": list(spec.input_shape), "classes": int(spec.classes)}
    data_dir = str(plan.data.dir)
    try:
        out.update(json.loads(_from_manifest(data_dir)))
    except HpctrainError:
        pass
    text = json.dumps(out)
    for dropped in ("class_names", "text"):
        if len(text) > MAX_RECORD:
            out[dropped] = None
            text = json.dumps(out)
    return {ATTR: text}


def recorded_text(attrs, source):
    """The vocabulary entry (data/vocab.py record_entry) of a file's
    attributes' record, or None where it carries none (a file from before
    the record, an image model's, one too large for it); one line for a
    record that does not parse."""
    text = attrs.get(ATTR)
    if text is None:
        return None
    try:
        rec = json.loads(text.decode() if isinstance(text, bytes) else str(text))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise HpctrainError(f"{source}: damaged '{ATTR}' attribute; save the model again") from None
    entry = rec.get("text") if isinstance(rec, dict) else None
    return entry if isinstance(entry, dict) else None
