"""Property-based tests for the checkpoint reader (issue 10, section 5).

A valid old flat checkpoint (conftest.write_flat_checkpoint), then a copy of it truncated at
any length and/or with 1-8 bytes xor'ed at any offsets: reader.read
returns a Checkpoint bit-identical to the original (only when the mutation
changed nothing) or raises reader._Corrupt or HpctrainError with a
one-line message, never another exception and never a hang. load_latest over
a directory holding the mutated file (newest) and an older valid one returns
the older one with one warning naming the mutated file, or the mutated one
only when it is bit-identical; it raises nothing but HpctrainError.

Hypothesis draws the mutations; bounded and derandomized (the same examples
on every run, a few seconds in all):

    .venv/bin/python -m pytest tests/test_checkpoint_properties.py
"""
import os
import shutil
import tempfile

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import write_flat_checkpoint  # noqa: E402
from hpctrain.checkpoints import read_back as reader
from hpctrain.base.errors import HpctrainError  # noqa: E402

SETTINGS = {"mode": "ring", "hidden": "8", "num_params": 16, "optimizer": "adam",
            "batch_size": 4, "seed": 0}
PROPERTY = dict(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def write(directory, step, n=16):
    """As tests/test_checkpoint.py's write(): a valid checkpoint of `step`."""
    rng = np.random.default_rng(step)
    params = rng.standard_normal(n).astype(np.float32)
    state = {"m": rng.standard_normal(n).astype(np.float32), "v": rng.random(n).astype(np.float32)}
    positions = np.array([[step // 10, 4 * step % 40], [step // 10, 8]], np.int64)
    return write_flat_checkpoint(directory, step, params, state, positions, {"world_size": 2, "lr": 1e-4, **SETTINGS})


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """(path, bytes, Checkpoint) of a valid step-20 checkpoint, and a valid step-10 one."""
    d = tmp_path_factory.mktemp("original")
    older = write(d / "older", 10)
    path = write(d / "newest", 20)
    with open(path, "rb") as f:
        raw = f.read()
    return path, raw, reader.read(path), older


def same(a, b):
    """Two Checkpoints hold the same bits (arrays compared byte for byte)."""
    return (a.step == b.step and a.optimizer_t == b.optimizer_t and a.attrs == b.attrs
            and a.params.dtype == b.params.dtype and a.params.tobytes() == b.params.tobytes()
            and a.data_positions.dtype == b.data_positions.dtype
            and a.data_positions.tobytes() == b.data_positions.tobytes()
            and set(a.optimizer_state) == set(b.optimizer_state)
            and all(a.optimizer_state[k].dtype == b.optimizer_state[k].dtype
                    and a.optimizer_state[k].tobytes() == b.optimizer_state[k].tobytes()
                    for k in a.optimizer_state))


# A mutation: an optional cut (keep the first `cut` bytes, any length from 0 to
# the whole file) and 0-8 byte flips (offset as a fraction of the file, so
# one strategy fits any size; xor 0 leaves the byte as it is).
flips = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=8)
mutations = st.one_of(
    st.tuples(st.floats(0, 1), st.just([])),                     # truncation only
    st.tuples(st.none(), flips),                                  # flips only
    st.tuples(st.floats(0, 1), flips),                            # both: flips, then the cut
)


def mutate(raw, mutation):
    cut, flipped = mutation
    data = bytearray(raw)
    for where, xor in flipped:
        data[int(where * len(data))] ^= xor
    if cut is not None:
        del data[int(cut * len(raw)):]
    return bytes(data)


def one_line(e):
    message = str(e)
    assert message and "\n" not in message, repr(message)
    return message


@settings(**PROPERTY)
@given(mutation=mutations)
def test_read_of_a_mutated_checkpoint_is_the_original_or_one_line(original, mutation):
    path, raw, want, _ = original
    damaged = mutate(raw, mutation)
    with tempfile.TemporaryDirectory() as d:
        copy = os.path.join(d, os.path.basename(path))
        with open(copy, "wb") as f:
            f.write(damaged)
        try:
            got = reader.read(copy)
        except (reader._Corrupt, HpctrainError) as e:
            one_line(e)
            assert damaged != raw, f"an unchanged file refused: {e}"
            return
        assert same(got, want), "read returned a checkpoint that differs from the one written"
        assert damaged == raw, "a changed file read back as valid"


@settings(**PROPERTY)
@given(mutation=mutations)
def test_load_latest_falls_back_to_the_older_valid_checkpoint(original, mutation):
    path, raw, want, older = original
    damaged = mutate(raw, mutation)
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(older, d)
        with open(os.path.join(d, os.path.basename(path)), "wb") as f:
            f.write(damaged)
        warnings = []
        try:
            got = reader.load_latest(d, SETTINGS, warn=warnings.append)
        except HpctrainError as e:
            one_line(e)
            return
        assert got is not None
        for line in warnings:
            one_line(line)
        if got.step == 20:
            assert damaged == raw and warnings == [] and same(got, want)
        else:
            assert got.step == 10 and got.name == "ckpt-00000010.h5", got.path
            assert len(warnings) == 1 and warnings[0].startswith("ckpt-00000020.h5: corrupt ("), warnings
            assert damaged != raw
