"""The parameters file (--save, --keep-best): HDF5, one float32 dataset per
tensor (`layer0/W`, ...) and the non-trainable state beside them, with the
attributes `step`, `mode`, `world_size`, `model` (the identity checkpoints
compare) and, for the MLP, `hidden`; written to an exclusive temporary name
and renamed, so it is never half-written.

    python -c "import h5py; f = h5py.File('p.h5'); print(dict(f.attrs), list(f))"
"""
import os

import numpy as np

from ..checkpoints.model_record import record as model_record
from ..nn.sequential import INIT_VERSION
from ..base.files import create_new, one_line, remove_temp, rescue_path, temp_name_next_to
from ..state.parts import box_slices


def save_params(path, model, step, checkpoint_path=None, agree=None, chief=True):
    """--save of `model` (report/evaluated.py: model.write; the chief's, or
    with a collective model every rank's call). Returns None, or (when the
    file cannot be written, e.g. the disk filled up during training) the
    one-line error that says where the parameters are kept instead: the
    checkpoint of this step if there is one, else a file in the temporary
    directory. agree(text or None): the chief's outcome on every rank (a
    collective model's ranks go on together; chief: this rank names the rescue file)."""
    if not path:
        return None
    agree = agree or (lambda text: text)

    def attempt(where):
        try:
            model.write(where, step)
            return None
        except OSError as e:
            return one_line(e)
    error = agree(attempt(path))
    if not error:
        return None
    failed = f"--save {path}: cannot write ({error})"
    if checkpoint_path:
        return f"{failed}; the parameters of step {step} are in checkpoint {checkpoint_path}"
    rescue = agree(rescue_path(step) if chief else None)   # the chief's name, on every rank
    error = agree(attempt(rescue))
    if error:
        return f"{failed}, nor in the temporary directory ({error}): the parameters are lost"
    return f"{failed}; the parameters of step {step} are kept in {rescue}"


def write_params(path, spec, pieces, plan, step, attrs=None):
    """One dataset per whole tensor of the model's parameters and state (the
    run's parameter dtype), written from `pieces`, (name, box, host values)
    that tile each tensor once, in any order (a layout's parts, the chief's
    own or as they arrive: state/consumers.ToChief), so no whole tensor is
    held beyond the file; attributes step/mode/world_size/model (/hidden:
    the MLP's; and attrs: --keep-best's val_accuracy); written to a
    temporary name and renamed, so it is never half-written. spec: the
    model's (a tensor-split one's whole model is what the file holds)."""
    import h5py
    spec = spec.full
    shapes = {name: shape for name, shape, _, _ in spec.tensors + spec.state}
    # Exclusive and unpredictable: a planted symlink is never followed.
    tmp = temp_name_next_to(path)
    try:
        os.close(create_new(tmp))
        with h5py.File(tmp, "w") as f:
            # a box written where it lies: the tensor never whole in memory (it may be 1/N of a ZeRO shard)
            for name, box, values in pieces:
                if name not in f:
                    f.create_dataset(name, shapes[name], dtype=values.dtype)
                f[name][box_slices(box)] = values
            write_attrs(f, spec, plan, step, attrs)
        os.replace(tmp, path)
    finally:
        remove_temp(tmp)


def write_attrs(f, spec, plan, step, attrs=None):
    """The parameters file's attributes (the open h5py file f): step, mode,
    world_size, the model's identity and record, --keep-best's attrs."""
    f.attrs["step"] = step
    f.attrs["mode"] = plan.mode
    f.attrs["world_size"] = plan.world_size
    if plan.model == "mlp":   # what sizes it; another model's identity says it all
        f.attrs["hidden"] = ",".join(map(str, plan.hidden))
    f.attrs["model"] = spec.identity
    f.attrs["init_version"] = INIT_VERSION   # how the run's initial parameters were drawn
    # how to rebuild the model and prepare its inputs (predict, evaluate)
    for key, value in {**model_record(spec, plan), **(attrs or {})}.items():
        f.attrs[key] = value


NOTE_BYTES = 1024    # the chief's outcome of a collective write, as UTF-8


def chief_text(world, text):
    """Collective over the world: the chief's text (None: nothing to say) on
    every rank, as fixed-size bytes (no pickle): a collective model's
    `agree`, the outcome of its write."""
    buf = np.zeros(NOTE_BYTES, np.uint8)
    if world.chief and text is not None:
        raw = ("1" + text).encode()[:NOTE_BYTES]
        buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    with world.waiting("the chief's outcome broadcast", peer=0):
        world.comm.Bcast(buf, root=0)
    said = bytes(buf).rstrip(b"\0").decode(errors="replace")
    return said[1:] if said else None


def written_by_chief(chief, stream, write):
    """A collective model's --save: the chief runs write(), taking the
    others' pieces from `stream` (state/consumers.ToChief; whatever a failed
    write left is drained, so no sender waits); the others send theirs."""
    if not chief:
        stream.send()
        return
    try:
        write()
    except BaseException:
        stream.drain()
        raise
