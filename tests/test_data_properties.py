"""Property-based tests for untrusted data: IDX files and shard manifests.

Whatever the bytes, read_idx returns the array an independent parser sees in
them or raises HpctrainError with a one-line message; load_manifest,
ShardReader and load_test work or raise HpctrainError with one line. Never
another exception, a huge allocation or a hang. Hypothesis draws the inputs
(bounded: about 100 examples each, a few seconds in all):

    .venv/bin/python -m pytest tests/test_data_properties.py

The same properties also run on a fixed, seeded set of random mutations,
so they are checked where Hypothesis is not installed.
"""

import copy
import gzip
import json
import shutil
import struct
import zlib

import numpy as np
import pytest

from hpctrain import data
from hpctrain.base.errors import HpctrainError

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # the seeded tests below still run
    given = None

needs_hypothesis = pytest.mark.skipif(given is None, reason="hypothesis is not installed")
SETTINGS = dict(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow] if given else [])


# ---------------------------------------------------------------------------
# The properties

def expected_idx(payload):
    """The array an IDX payload (uncompressed bytes) holds, by LeCun's page,
    or None where read_idx must refuse it. Independent of hpctrain's reader,
    except for the limits hpctrain adds (type 0x08 only, 1 to 4 dimensions,
    no dimension 0)."""
    if len(payload) < 4 or payload[:2] != b"\0\0" or payload[2] != 0x08:
        return None
    ndim = payload[3]
    if not 1 <= ndim <= 4 or len(payload) < 4 + 4 * ndim:
        return None
    shape = struct.unpack(f">{ndim}I", payload[4:4 + 4 * ndim])
    body = payload[4 + 4 * ndim:]
    if 0 in shape or len(body) != int(np.prod(shape, dtype=object)):
        return None
    return np.frombuffer(body, np.uint8).reshape(shape)


def check_idx_bytes(tmp_path, blob):
    """read_idx on blob: the independently expected array, or one line."""
    path = tmp_path / "f"
    path.write_bytes(blob)
    if blob[:2] == b"\x1f\x8b":
        try:
            payload = gzip.decompress(blob)
        except (OSError, EOFError, zlib.error):
            payload = None
    else:
        payload = blob
    expected = None if payload is None else expected_idx(payload)
    try:
        got = data.read_idx(path)
    except HpctrainError as e:
        assert "\n" not in str(e) and str(e).startswith(f"{path}: "), str(e)
        assert expected is None, f"refused a valid file: {e}"
        return None
    assert expected is not None, "accepted an invalid file"
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, expected)
    return got


def idx_bytes(array):
    array = np.asarray(array, np.uint8)
    return (struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
            + array.tobytes())


def check_manifest(data_dir, text):
    """With manifest.json = text: load_manifest, ShardReader and load_test
    work, or raise one line."""
    (data_dir / data.MANIFEST).write_text(text) if isinstance(text, str) else \
        (data_dir / data.MANIFEST).write_bytes(text)
    try:
        data.load_manifest(data_dir)
    except HpctrainError as e:
        # The readers call load_manifest first: they would raise this too.
        assert "\n" not in str(e), str(e)
        return
    for read in (lambda: data.ShardReader(data_dir, 0, 1, 8, seed=0).next_batch(),
                 lambda: data.ShardReader(data_dir, 1, 3, 8, seed=0).next_batch(),
                 lambda: data.load_test(data_dir, 0, 2)):
        try:
            read()
        except HpctrainError as e:
            assert "\n" not in str(e), str(e)


# A small prepared directory: 60 samples of 6x5 images, 3 classes, 2 shards.
@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("props")
    src = base / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    (src / "images-idx3-ubyte").write_bytes(idx_bytes(rng.integers(0, 256, (60, 6, 5))))
    (src / "labels-idx1-ubyte").write_bytes(idx_bytes(np.arange(60) % 3))
    data.prepare(src, base / "shards", shards=2, test_fraction=0.2, log=None)
    return base / "shards"


@pytest.fixture(scope="module")
def valid_manifest(shards):
    return json.loads((shards / data.MANIFEST).read_text())


@pytest.fixture(scope="module")
def scratch(shards, tmp_path_factory):
    """A copy of the shards whose manifest every example rewrites."""
    d = tmp_path_factory.mktemp("scratch") / "shards"
    shutil.copytree(shards, d)
    return d


def paths_of(value, at=()):
    """Every path (tuple of keys/indices) into a JSON value, the root included."""
    yield at
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield from paths_of(v, at + (k,))


def mutated(manifest, at, new=None, delete=False):
    m = copy.deepcopy(manifest)
    if not at:
        return new
    parent = m
    for k in at[:-1]:
        parent = parent[k]
    if delete:
        del parent[at[-1]]
    else:
        parent[at[-1]] = new
    return m


# Values a mutation puts in: the types and edge cases a manifest may hold.
ODD_VALUES = [None, True, False, 0, 1, -1, 7, 2 ** 31, 10 ** 30, 0.5, float("nan"), "", "x",
              "..", "../manifest.json", "/etc/passwd", "train-00000-of-00002.h5", [], [0], [6, 5],
              [1, 30], [30], [10 ** 6, 10 ** 6], [6, 5, 1], {}, {"file": "a"}]


# ---------------------------------------------------------------------------
# Seeded mutations: always run

def test_idx_seeded_truncations_and_flips(tmp_path):
    rng = np.random.default_rng(1)
    for gz in (False, True):
        for shape in ((7,), (3, 4, 5), (2, 2, 2, 2)):
            good = idx_bytes(rng.integers(0, 256, shape))
            blob = gzip.compress(good) if gz else good
            np.testing.assert_array_equal(check_idx_bytes(tmp_path, blob), expected_idx(good))
            for cut in range(len(blob)):
                check_idx_bytes(tmp_path, blob[:cut])
            for _ in range(60):
                flipped = bytearray(blob)
                for i in rng.integers(0, len(blob), rng.integers(1, 4)):
                    flipped[i] ^= int(rng.integers(1, 256))
                check_idx_bytes(tmp_path, bytes(flipped))


def test_idx_seeded_headers(tmp_path):
    rng = np.random.default_rng(2)
    for _ in range(300):
        ndim = int(rng.choice([0, 1, 2, 3, 4, 5, 255]))
        dims = [int(rng.choice([0, 1, 3, 2 ** 31, 2 ** 32 - 1, rng.integers(0, 50)]))
                for _ in range(min(ndim, 8))]
        head = struct.pack(">BBBB", 0, 0, int(rng.choice([8, 8, 8, 9, 13])), ndim)
        blob = head + struct.pack(f">{len(dims)}I", *dims) + bytes(int(rng.integers(0, 200)))
        check_idx_bytes(tmp_path, gzip.compress(blob) if rng.random() < 0.5 else blob)


def test_manifest_seeded_mutations(valid_manifest, scratch):
    rng = np.random.default_rng(3)
    where = list(paths_of(valid_manifest))
    for _ in range(100):
        at = where[int(rng.integers(len(where)))]
        delete = bool(at) and rng.random() < 0.3
        new = ODD_VALUES[int(rng.integers(len(ODD_VALUES)))]
        check_manifest(scratch, json.dumps(mutated(valid_manifest, at, new, delete)))
    text = json.dumps(valid_manifest).encode()
    for _ in range(40):
        flipped = bytearray(text)
        flipped[int(rng.integers(len(text)))] = int(rng.integers(0, 256))
        check_manifest(scratch, bytes(flipped))
    check_manifest(scratch, json.dumps(valid_manifest))
    data.ShardReader(scratch, 0, 1, 8, seed=0)   # the unmutated manifest still works


# ---------------------------------------------------------------------------
# Hypothesis

if given is not None:
    arrays = st.integers(1, 4).flatmap(
        lambda nd: st.lists(st.integers(1, 6), min_size=nd, max_size=nd)).flatmap(
        lambda shape: st.binary(min_size=int(np.prod(shape)), max_size=int(np.prod(shape))).map(
            lambda b: np.frombuffer(b, np.uint8).reshape(shape)))

    @needs_hypothesis
    @settings(**SETTINGS)
    @given(array=arrays, gz=st.booleans(), data_=st.data())
    def test_idx_truncations_and_flips(tmp_path_factory, array, gz, data_):
        tmp = tmp_path_factory.mktemp("idx")
        good = idx_bytes(array)
        blob = bytearray(gzip.compress(good) if gz else good)
        np.testing.assert_array_equal(check_idx_bytes(tmp, bytes(blob)), array)
        cut = data_.draw(st.integers(0, len(blob)))
        flips = data_.draw(st.lists(st.tuples(st.integers(0, len(blob) - 1),
                                              st.integers(1, 255)), max_size=3))
        for i, x in flips:
            blob[i] ^= x
        check_idx_bytes(tmp, bytes(blob[:cut]))
        check_idx_bytes(tmp, bytes(blob))

    @needs_hypothesis
    @settings(**SETTINGS)
    @given(magic=st.one_of(st.binary(min_size=0, max_size=4),
                           st.tuples(st.sampled_from([8, 8, 9, 13]), st.integers(0, 255)).map(
                               lambda t: bytes([0, 0, *t]))),
           dims=st.lists(st.one_of(st.integers(0, 40), st.integers(0, 2 ** 32 - 1)), max_size=6),
           body=st.binary(max_size=400), gz=st.booleans())
    def test_idx_random_headers(tmp_path_factory, magic, dims, body, gz):
        blob = magic + struct.pack(f">{len(dims)}I", *dims) + body
        check_idx_bytes(tmp_path_factory.mktemp("idx"), gzip.compress(blob) if gz else blob)

    json_values = st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(-2, 2 ** 40), st.floats(allow_nan=False),
                  st.text(max_size=12), st.sampled_from(ODD_VALUES)),
        lambda inner: st.one_of(st.lists(inner, max_size=3),
                                st.dictionaries(st.text(max_size=8), inner, max_size=3)),
        max_leaves=6)

    @needs_hypothesis
    @settings(**SETTINGS)
    @given(data_=st.data(), new=json_values, delete=st.booleans())
    def test_manifest_mutations(valid_manifest, scratch, data_, new, delete):
        where = list(paths_of(valid_manifest))
        at = data_.draw(st.sampled_from(where))
        check_manifest(scratch, json.dumps(mutated(valid_manifest, at, new, delete and bool(at))))

    @needs_hypothesis
    @settings(**SETTINGS)
    @given(data_=st.data())
    def test_manifest_byte_damage(valid_manifest, scratch, data_):
        text = bytearray(json.dumps(valid_manifest, indent=1).encode())
        cut = data_.draw(st.integers(0, len(text)))
        for i, x in data_.draw(st.lists(st.tuples(st.integers(0, len(text) - 1),
                                                  st.integers(0, 255)), max_size=3)):
            text[i] = x
        check_manifest(scratch, bytes(text[:cut]))
else:
    @needs_hypothesis
    def test_hypothesis_properties():
        pass
