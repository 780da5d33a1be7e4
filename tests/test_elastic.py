"""A checkpoint resumes on another number of ranks (issue 13, §1): real jobs
stopped by SIGTERM and resumed with more, then fewer ranks, in ring and ps
mode. Every worker records the samples it takes (tests/record_samples.py),
so the test sees that no sample is used twice within an epoch and that an
epoch drops fewer than workers x batch. The jobs run in the plain pytest pass:

    .venv/bin/python -m pytest tests/test_elastic.py
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from conftest import MPIRUN, OPEN_MPI, REPO, checkpoint_path, under_mpirun, without_launcher_banners
from hpctrain.checkpoints import file as checkpoint
from hpctrain import data
from hpctrain.run.cluster import child_env
from hpctrain.base.errors import EXIT_PREEMPTED

pytestmark = pytest.mark.skipif(under_mpirun(), reason="launches its own mpirun jobs: runs in the plain pytest pass")

STEPS, BATCH = 900, 32
COMMON = ["--steps", STEPS, "--batch-size", BATCH, "--hidden", "128", "--lr", "1e-3", "--log-every", 100000,
          "--timeout", 120]
# Open MPI's mpirun turns SIGTERM into killing the ranks; it relays USR1.
STOP = signal.SIGUSR1 if OPEN_MPI else signal.SIGTERM


def start(n, args, env=None):
    cmd = [MPIRUN, "-n", str(n), sys.executable, os.path.join(REPO, "tests", "record_samples.py"),
           *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(child_env(), **(env or {})))


def finish(p, timeout=240):
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return p.returncode, out, without_launcher_banners(err)


def stop_after_checkpoint(n, args, ckpt_dir, after_step, env):
    """Run, send STOP to mpirun once a checkpoint past after_step exists; the step it stopped at."""
    p = start(n, args, env)
    deadline = time.monotonic() + 240
    while p.poll() is None and time.monotonic() < deadline:
        steps = [s for s, _ in checkpoint.list_checkpoints(ckpt_dir)]
        if steps and steps[0] > after_step:
            p.send_signal(STOP)
            break
        time.sleep(0.005)
    rc, out, err = finish(p)
    assert rc == EXIT_PREEMPTED, (rc, out, err)
    m = re.search(rf"stopped by {STOP.name} after step (\d+); checkpoint", err)
    assert m, err
    return int(m.group(1)), out


def final(metrics):
    return [json.loads(line) for line in metrics.read_text().splitlines()
            if json.loads(line).get("event") == "final"][-1]


def samples_by_epoch(record_dir):
    """{epoch: [sample ids]} over every worker of every run."""
    used = defaultdict(list)
    for name in os.listdir(record_dir):
        for line in (record_dir / name).read_text().splitlines():
            epoch, *ids = map(int, line.split())
            used[epoch].extend(ids)
    return used


@pytest.mark.parametrize("mode, sizes, extra", [
    ("ring", (2, 4, 3), []),
    ("ps", (3, 5, 4), ["--mode", "ps"]),
])
def test_stop_and_go_on_with_more_then_fewer_ranks(tmp_path, mode, sizes, extra):
    """Ring: 2 ranks -> SIGTERM -> 4 -> SIGTERM -> 3. ps (sync): 1 server + 2
    workers -> 1 + 4 -> 2 + 2. Each ends at the requested step, no sample is
    used twice in an epoch, an epoch drops fewer than W x B, and the accuracy
    is >= 0.92 and within 0.02 of the same job run through on the first size."""
    records, ckpt = tmp_path / "samples", tmp_path / "ckpt"
    records.mkdir()
    env = {"RECORD_SAMPLES": str(records)}
    servers = {3: 1, 5: 1, 4: 2} if mode == "ps" else {}

    def flags(n, metrics, resumable=True):
        more = [*extra, "--num-ps", servers[n]] if mode == "ps" else []
        keep = ["--checkpoint-dir", ckpt, "--checkpoint-every", 50] if resumable else []
        return [*COMMON, *more, *keep, "--metrics", metrics]

    first, second, third = sizes
    s1, _ = stop_after_checkpoint(first, flags(first, tmp_path / "m1.jsonl"), ckpt, 0, env)
    written = checkpoint_path(ckpt, s1)
    s2, out = stop_after_checkpoint(second, flags(second, tmp_path / "m2.jsonl"), ckpt, s1, env)
    workers = {n: n - servers.get(n, 0) for n in sizes}
    assert (f"resumed from {written} at step {s1}; written with {workers[first]} workers, "
            f"this run has {workers[second]}: the rest of epoch") in out, out
    rc, out, err = finish(start(third, flags(third, tmp_path / "m3.jsonl"), env))
    assert rc == 0, err
    assert 0 < s1 < s2 < STEPS
    assert f"at step {s2}; written with {workers[second]} workers, this run has {workers[third]}" in out, out
    resized = final(tmp_path / "m3.jsonl")
    assert resized["steps"] == STEPS

    used = samples_by_epoch(records)
    last = max(used)
    N = data.ShardReader(data.default_data_dir(), 0, 1, 1, 0).num_samples
    for epoch, ids in sorted(used.items()):
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample used twice"
        if epoch < last:
            assert N - len(ids) < max(workers.values()) * BATCH, (epoch, N - len(ids))
    taken = sum(len(ids) for ids in used.values())
    if mode == "ring":   # every step took W x B samples at the W of its run
        assert taken == BATCH * (s1 * workers[first] + (s2 - s1) * workers[second]
                                 + (STEPS - s2) * workers[third])

    rc, out, err = finish(start(first, flags(first, tmp_path / "m0.jsonl", resumable=False),
                                {"RECORD_SAMPLES": str(tmp_path)}))
    assert rc == 0, err
    through = final(tmp_path / "m0.jsonl")
    assert resized["test_accuracy"] >= 0.92, resized
    assert abs(resized["test_accuracy"] - through["test_accuracy"]) <= 0.02, (resized, through)


def test_epochs_resumed_on_more_ranks_are_the_same_epochs(tmp_path):
    """--epochs 8 started on 2 ranks, stopped after a checkpoint, resumed on 4:
    the run ends when 8 epochs of samples are taken (within one global batch
    at the end), not after the steps 8 epochs are at 4 ranks from step 0."""
    records, ckpt = tmp_path / "samples", tmp_path / "ckpt"
    records.mkdir()
    env = {"RECORD_SAMPLES": str(records)}
    epochs = 8
    flags = [*COMMON[2:], "--epochs", epochs, "--checkpoint-dir", ckpt, "--checkpoint-every", 20,
             "--metrics", tmp_path / "m.jsonl"]
    s1, _ = stop_after_checkpoint(2, flags, ckpt, 0, env)
    rc, out, err = finish(start(4, flags, env))
    assert rc == 0, err
    N = data.ShardReader(data.default_data_dir(), 0, 1, 1, 0).num_samples
    rest = -(-(epochs * N - s1 * 2 * BATCH) // (4 * BATCH))
    assert f"--epochs {epochs}: {s1 * 2 * BATCH} samples taken so far, the rest at 4 workers x {BATCH}: " \
           f"the run ends at step {s1 + rest}" in out, out
    assert final(tmp_path / "m.jsonl")["steps"] == s1 + rest
    taken = sum(len(ids) for ids in samples_by_epoch(records).values())
    assert epochs * N <= taken < epochs * N + 4 * BATCH, (taken, epochs * N)
