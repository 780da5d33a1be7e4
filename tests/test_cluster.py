"""hpctrain on several hosts: a simulated cluster of 3 nodes on this machine.

Run: ``.venv/bin/python -m pytest -q tests/test_cluster.py`` (as root; about
3 minutes on 2 idle cores; the first run may install SLURM with apt-get).

The module fixture ``cluster`` brings up the cluster of tests/cluster/ (see
its README): three nodes, each a network namespace of this checkout's
(tests/cluster/names.sh), hpt-n0 (login node: slurmctld, mpirun), hpt-n1 and
hpt-n2 (compute nodes: one slurmd each), each with its own host name,
address and boot_id, joined by veth pairs on a bridge, so
every byte between "nodes" crosses a veth over TCP and is counted there. It
tears down exactly what it created at the end, whether tests pass or fail.
Skipped, with the reason, when not root, under an MPI launcher (``make test``
runs it in the plain pytest pass), with ``HPCTRAIN_SKIP_CLUSTER=1``, or when
this machine cannot create network namespaces.

What is checked: mpirun across nodes (Hydra with an ssh stand-in) with block
and round-robin placement, the rank map in the first log line, the bytes on
each node's link against what the algorithm must send; a pipeline with one
stage per node (only activations and their gradients cross, and it trains
as --accumulate-steps on one node, bit for bit); `sbatch -N 2` of the
real jobs/ring.slurm and jobs/ps.slurm against the same training on one
node; --compression fp16/bf16 (half the bytes cross) and PowerSGD (its
factors) on hier across the nodes; kill-and-requeue across nodes (bit-exact); and a node failure: the
second compute node dies mid-job (its slurmd and every process in it), the
run under MPICH's mpirun ends at once, the job script finds the node silent
and requeues the job before SLURM has marked it down, the node comes back,
and the job resumes from its checkpoint (bit-exact). Under Open
MPI (make test-openmpi): `--on-failure shrink` in the same job script (mpirun
--with-ft ulfm), both ranks of one node SIGKILLed mid-run, the job finishing on
the other node.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import OPEN_MPI, REPO, checkpoint_steps, checkpoints, into_the_next_second, under_mpirun
from hpctrain.run.cluster import child_env

pytestmark = pytest.mark.cluster

HERE = Path(REPO) / "tests" / "cluster"
PYTHON = Path(sys.executable)
MPIRUN = PYTHON.parent / "mpirun"
NODES = ("hpt-n1", "hpt-n2")
# The default model: 784-500-500-10, float32 gradients.
GRAD_BYTES = 4 * (784 * 500 + 500 + 500 * 500 + 500 + 500 * 10 + 10)


def _skip_reason():
    if os.environ.get("HPCTRAIN_SKIP_CLUSTER") == "1":
        return "HPCTRAIN_SKIP_CLUSTER=1"
    if under_mpirun():
        return "cluster tests run in the plain pytest pass, not under an MPI launcher"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "unshare", "nsenter"):
        if not shutil.which(tool) and not Path("/usr/sbin", tool).exists():
            return f"no `{tool}` on this machine"
    if not MPIRUN.exists():
        return f"no {MPIRUN}"
    return None


_reason = _skip_reason()
if _reason:
    pytest.skip(_reason, allow_module_level=True)


def _names(*argv):
    """What tests/cluster/names.sh says: this checkout's cluster has names of
    its own (namespaces, veths, state directory), its nodes the usual hpt-nI."""
    return subprocess.run([str(HERE / "names.sh"), *argv], capture_output=True, text=True,
                          check=True).stdout.strip()


STATE = Path(dict(line.split("=", 1) for line in _names().splitlines())["HPT_CLUSTER_DIR"])
VETHS = {node: _names("veth", node) for node in NODES}


def _run(*argv, timeout=60, check=True, env=None):
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} exited {proc.returncode}:\n"
                             f"{proc.stdout}{proc.stderr}")
    return proc


class Cluster:
    """Handle on the simulated cluster (see the module docstring)."""

    def __init__(self, workdir):
        self.workdir = Path(workdir)

    # ---- links -------------------------------------------------------------------
    @staticmethod
    def link_bytes():
        """{node: (bytes out of the node, bytes into it)} from the host ends of
        the veths (a host end transmits what the node receives)."""
        out = {}
        for node in NODES:
            stats = Path(f"/sys/class/net/{VETHS[node]}/statistics")
            out[node] = (int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text()))
        return out

    # ---- mpirun across nodes ---------------------------------------------------------
    def mpirun(self, hosts, n, *args, module="hpctrain.mnist", timeout=240):
        """`mpirun -hosts HOSTS -n n python -m module args` launched on the
        login node, ranks started through fake-ssh. Returns (CompletedProcess,
        {node: (bytes out, bytes in)} moved during the job)."""
        before = self.link_bytes()
        proc = _run(HERE / "on.sh", "hpt-n0", MPIRUN, "-launcher", "ssh",
                    "-launcher-exec", HERE / "fake-ssh", "-hosts", hosts, "-n", n,
                    PYTHON, "-m", module, *args, timeout=timeout, check=False, env=child_env())
        after = self.link_bytes()
        moved = {node: (after[node][0] - before[node][0], after[node][1] - before[node][1])
                 for node in NODES}
        return proc, moved

    # ---- SLURM ----------------------------------------------------------------------------
    def cli(self, *argv, timeout=30, env=None):
        return _run(HERE / "slurm.sh", "cli", *argv, timeout=timeout, check=False, env=env)

    def submit(self, script, *args, nodes=2, per_node=2, env=None, name=None):
        """sbatch (no --wait) from the login node; returns (job id, name, output file)."""
        name = name or f"hpt-{uuid.uuid4().hex[:8]}"
        out = self.workdir / f"{name}.out"
        full_env = child_env(also=("SLURM_",))
        full_env["HPCTRAIN_PYTHON"] = str(PYTHON)
        full_env.update(env or {})
        proc = self.cli("sbatch", "--parsable", f"--job-name={name}", f"--output={out}",
                        f"--chdir={REPO}", f"--nodes={nodes}", f"--ntasks-per-node={per_node}",
                        script, *map(str, args), env=full_env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout.strip().split(";")[0], name, out

    def job(self, job_id):
        """(state, restarts, exit code) of a job; Nones once SLURM forgot it."""
        show = self.cli("scontrol", "show", "job", "-o", job_id).stdout
        state = re.search(r"\bJobState=(\S+)", show)
        if not state:
            return None, None, None
        return (state.group(1), int(re.search(r"\bRestarts=(\d+)", show).group(1)),
                int(re.search(r"\bExitCode=(\d+):\d+", show).group(1)))

    def wait(self, what, predicate, timeout, job_id=None, out=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        if job_id:
            self.cli("scancel", job_id)
        pytest.fail(f"gave up waiting for {what} after {timeout} s"
                    + (f"; job output so far:\n{_text(out)}" if out else "")
                    + f"\nslurmctld.log:\n{_tail(STATE / 'slurm/ctld/slurmctld.log')}")

    def wait_ended(self, job_id, out, restarts=0, timeout=240):
        """Exit code of run number `restarts` of the job, once it has ended."""
        def ended():
            state, n, code = self.job(job_id)
            return (code,) if state in TERMINAL and n == restarts else None
        return self.wait(f"job {job_id} to end", ended, timeout, job_id, out)[0], _text(out)

    def node_state(self, node):
        return self.cli("sinfo", "-h", "-N", "-n", node, "-o", "%T").stdout.strip()


TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}


def _text(path):
    return Path(path).read_text(errors="replace") if path and Path(path).exists() else "(no output)"


def _tail(path, n=15):
    return "\n".join(_text(path).splitlines()[-n:])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        up = _run(HERE / "netns.sh", "up", "3", check=False)
        if up.returncode != 0:
            if "Operation not permitted" in up.stderr or "RTNETLINK" in up.stderr:
                pytest.skip(f"cannot create network namespaces here: {up.stderr.strip().splitlines()[-1]}")
            pytest.fail(f"netns.sh up failed:\n{up.stdout}{up.stderr}")
        slurm = _run(HERE / "slurm.sh", "up", timeout=900, check=False)
        if slurm.returncode == 3:
            pytest.skip(f"cannot install SLURM here: {slurm.stdout}{slurm.stderr}")
        assert slurm.returncode == 0, f"slurm.sh up failed:\n{slurm.stdout}{slurm.stderr}"
        yield Cluster(tmp_path_factory.mktemp("cluster"))
    finally:
        # Teardown whatever happened above: SLURM, processes left in the nodes, the network.
        down = _run(HERE / "slurm.sh", "down", timeout=120, check=False)
        net = _run(HERE / "netns.sh", "down", timeout=60, check=False)
        assert down.returncode == 0 and net.returncode == 0, \
            f"teardown failed:\n{down.stdout}{down.stderr}{net.stdout}{net.stderr}"


# ---- what the first log line and the links say ---------------------------------------------

LAYOUT = re.compile(r"^hpctrain: world size (\d+) \([^)]*\), (\d+) hosts?: ([^;]*); "
                    r"rank -> host/local rank/GPU/pid: (.*)$", re.M)
ACCURACY = re.compile(r"^test accuracy (\d+\.\d+)", re.M)


def rank_hosts(out):
    """[(host, local rank)] per rank from the first line of the job."""
    m = LAYOUT.search(out)
    assert m, out
    entries = m.group(4).split(", ")
    assert len(entries) == int(m.group(1)), out
    places = []
    for r, entry in enumerate(entries):
        e = re.fullmatch(rf"{r} -> (\S+)/(\d+)/(-|\d+)/\d+", entry)
        assert e, out
        places.append((e.group(1), int(e.group(2))))
    return places


def assert_bytes(moved, expected, what):
    """Every node's link carried `expected` bytes each way, within 10% (TCP/IP
    headers add about 1% with segmentation offload; start-up, evaluation and
    the final gather add well under 1% at these step counts)."""
    for node, (sent, received) in moved.items():
        for direction, value in (("out of", sent), ("into", received)):
            assert 0.98 * expected <= value <= 1.10 * expected, (
                f"{what}: {value / 1e6:.1f} MB went {direction} {node}, the algorithm sends "
                f"{expected / 1e6:.1f} MB (all bytes: {moved})")


def _params(path):
    import h5py
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if hasattr(obj, "shape") else None)
        return int(f.attrs["step"]), out


def assert_same_params(a, b, rtol=0.0):
    step_a, pa = _params(a)
    step_b, pb = _params(b)
    assert step_a == step_b and sorted(pa) == sorted(pb)
    for name in pa:
        if rtol == 0.0:
            assert pa[name].tobytes() == pb[name].tobytes(), \
                f"{name}: max |diff| {np.abs(pa[name].astype('f8') - pb[name].astype('f8')).max()}"
        else:
            np.testing.assert_allclose(pa[name], pb[name], rtol=rtol, atol=rtol, err_msg=name)


# ---- mpirun across nodes -----------------------------------------------------------------

STEPS_FOR_BYTES = 60
BLOCK, ROUND_ROBIN = "hpt-n1:2,hpt-n2:2", "hpt-n1:1,hpt-n2:1"
PLACED = {BLOCK: [("hpt-n1", 0), ("hpt-n1", 1), ("hpt-n2", 0), ("hpt-n2", 1)],
          ROUND_ROBIN: [("hpt-n1", 0), ("hpt-n2", 0), ("hpt-n1", 1), ("hpt-n2", 1)]}
# SGD: the optimizer changes no byte on the links, and under it the block runs
# of ring and hier also show that the two sums train alike (Adam would
# amplify their different rounding: test_hier_equals_the_flat_ring_across_nodes).
BYTES_FLAGS = ("--optimizer", "sgd", "--lr", "0.05", "--hidden", "500,500", "--steps", STEPS_FOR_BYTES,
               "--log-every", STEPS_FOR_BYTES)
_BYTES_RUNS = {}


def _bytes_run(cluster, hosts, flags):
    """4 ranks on `hosts` with `flags` and BYTES_FLAGS, launched once for every
    test that reads the run (the suite's time): (CompletedProcess, bytes moved
    per node as Cluster.mpirun gives them, the --save file)."""
    if (hosts, flags) not in _BYTES_RUNS:
        d = cluster.workdir / f"bytes-{len(_BYTES_RUNS)}"
        d.mkdir()
        proc, moved = cluster.mpirun(hosts, 4, *flags, *BYTES_FLAGS, "--save", d / "p.h5")
        _BYTES_RUNS[hosts, flags] = (proc, moved, d / "p.h5")
    return _BYTES_RUNS[hosts, flags]


@pytest.mark.parametrize("hosts, flags, per_step", [
    # Ranks 0,1 on hpt-n1 and 2,3 on hpt-n2: the ring 0-1-2-3 crosses each node
    # boundary once per direction, and the one rank of a node that sends
    # across sends 2(N-1)/N of the gradients per step.
    (BLOCK, ("--allreduce", "ring"), 2 * 3 / 4),
    # Round-robin (0,2 on hpt-n1): the ring in node order (the default) is
    # 0-2-1-3, the same 2(N-1)/N per node; in rank order every hop crosses,
    # and both ranks of a node send 2(N-1)/N across.
    (ROUND_ROBIN, ("--allreduce", "ring"), 2 * 3 / 4),
    (ROUND_ROBIN, ("--allreduce", "ring", "--ring-order", "rank"), 2 * 2 * 3 / 4),
    # Hierarchical: each node sends 2(M-1)/M of the gradients for M nodes,
    # split over its ranks (the lower bound), whatever the placement.
    (BLOCK, ("--allreduce", "hier"), 2 * 1 / 2),
    (ROUND_ROBIN, ("--allreduce", "hier"), 2 * 1 / 2),
], ids=["block-ring", "rr-ring-node-order", "rr-ring-rank-order", "block-hier", "rr-hier"])
def test_mpirun_across_nodes_sends_what_the_algorithm_must(cluster, hosts, flags, per_step):
    proc, moved, _ = _bytes_run(cluster, hosts, flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rank_hosts(proc.stdout) == PLACED[hosts]
    assert ACCURACY.search(proc.stdout), proc.stdout
    assert_bytes(moved, STEPS_FOR_BYTES * per_step * GRAD_BYTES, f"{' '.join(flags)} on {hosts}")


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_16_bit_compression_across_nodes_sends_half_the_bytes(cluster, tmp_path, kind):
    """--compression fp16/bf16 on hier: 16-bit words cross the nodes (the
    loss and stop slots float32, 8 bytes), float32 inside them; sharded by
    the node's ring, so the parameters' allgather crosses nothing."""
    metrics = tmp_path / "m.jsonl"
    proc, moved = cluster.mpirun(BLOCK, 4, "--allreduce", "hier", "--compression", kind, "--hidden", "500,500",
                                 "--steps", STEPS_FOR_BYTES, "--log-every", STEPS_FOR_BYTES, "--metrics", metrics)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ACCURACY.search(proc.stdout) and f"compression {kind}" in proc.stdout, proc.stdout
    assert "shards of each node" in proc.stdout, proc.stdout
    assert_bytes(moved, STEPS_FOR_BYTES * (GRAD_BYTES // 2 + 2 * 2 + 8), f"hier --compression {kind}")


def test_powersgd_across_nodes_sends_its_factors(cluster, tmp_path):
    """PowerSGD from step 0 on hier across nodes: per step the factors and
    the uncompressed tensors (the final record's sent_bytes_per_step), a few
    percent of the float32 gradient; start-up's parameter broadcast and the
    end's evaluation add about one gradient's bytes."""
    metrics = tmp_path / "m.jsonl"
    proc, moved = cluster.mpirun(BLOCK, 4, "--allreduce", "hier", "--compression", "powersgd", "--powersgd-start",
                                 0, "--hidden", "500,500", "--steps", STEPS_FOR_BYTES, "--log-every",
                                 STEPS_FOR_BYTES, "--metrics", metrics)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ACCURACY.search(proc.stdout), proc.stdout
    sent = json.loads(metrics.read_text().splitlines()[-1])["sent_bytes_per_step"]
    assert sent < 0.05 * GRAD_BYTES
    for node, (out, into) in moved.items():
        for value in (out, into):
            assert STEPS_FOR_BYTES * sent <= value <= STEPS_FOR_BYTES * sent + 3 * GRAD_BYTES, (node, moved, sent)


def test_hier_equals_the_flat_ring_across_nodes(cluster):
    # The block runs of ring and hier of the bytes test (SGD, 60 steps of 784-500-500-10).
    saved = {}
    for name in ("ring", "hier"):
        proc, _, saved[name] = _bytes_run(cluster, BLOCK, ("--allreduce", name))
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_same_params(saved["ring"], saved["hier"], rtol=1e-5)


# A pipeline across the nodes: stage 0 (ranks 0, 1) on hpt-n1, stage 1 (ranks
# 2, 3) on hpt-n2, each stage's 2 replicas inside its node. The cut [0,2) [2,6)
# (the balanced one) sends Dense0's output, PIPE_WIDTH floats per sample.
PIPE_STEPS, PIPE_MICRO, PIPE_BATCH, PIPE_WIDTH, PIPE_REPLICAS = 60, 4, 128, 128, 2
PIPE_FLAGS = ("--optimizer", "sgd", "--lr", "0.05", "--hidden", f"{PIPE_WIDTH},{PIPE_WIDTH}",
              "--batch-size", PIPE_BATCH, "--steps", PIPE_STEPS, "--log-every", PIPE_STEPS)


def test_pipeline_across_nodes_sends_only_activations(cluster, tmp_path):
    proc, moved = cluster.mpirun(BLOCK, 4, *PIPE_FLAGS, "--pipeline-stages", 2, "--pipeline-split", 2,
                                 "--micro-batches", PIPE_MICRO, "--save", tmp_path / "pipe.h5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rank_hosts(proc.stdout) == PLACED[BLOCK]
    assert "pipeline of 2 stages x 2 replicas" in proc.stdout, proc.stdout
    # Each replica's micro-batch crosses once each way: its activations out of
    # hpt-n1, their gradients back into it (B x width float32 each). The
    # stages' gradients are averaged inside the nodes: a gradient allreduce
    # across them would add at least the 0.47 MB of gradients per step (+45%).
    # Beside it: [loss, stop] per step, start-up, and the final gather of the
    # other stage's parameters (2 x 0.40 MB out of hpt-n1: about 1.3%).
    per_step = PIPE_REPLICAS * PIPE_MICRO * PIPE_BATCH * PIPE_WIDTH * 4
    assert_bytes(moved, PIPE_STEPS * per_step, "--pipeline-stages 2 on 2 nodes")
    # The same training as --accumulate-steps M on R = 2 ranks of one host, bit for bit.
    single = _run(MPIRUN, "-n", PIPE_REPLICAS, PYTHON, "-m", "hpctrain.mnist", *PIPE_FLAGS,
                  "--accumulate-steps", PIPE_MICRO, "--save", tmp_path / "acc.h5", timeout=240, env=child_env())
    assert ACCURACY.search(single.stdout), single.stdout
    assert_same_params(tmp_path / "pipe.h5", tmp_path / "acc.h5")


SERVERS = re.compile(r"^(?:hpctrain: )?ps servers \(--ps-ranks \w+, 2 nodes\): (.*)$", re.M)


def test_ps_servers_spread_over_nodes(cluster, tmp_path):
    # Block placement, 2 servers: `first` puts both on hpt-n1 (ranks 0, 1);
    # `spread` puts one on each node (ranks 0 and 2). Sync ps gives the same
    # parameters either way.
    common = ("--mode", "ps", "--num-ps", "2", "--steps", "30", "--log-every", "30", "--hidden", "128")
    where, exchange = {}, {}
    for rule in ("first", "spread"):
        proc, _ = cluster.mpirun(BLOCK, 4, *common, "--ps-ranks", rule, "--save", tmp_path / f"{rule}.h5",
                                 "--metrics", tmp_path / f"{rule}.jsonl")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        m = SERVERS.search(proc.stdout + proc.stderr)
        assert m, proc.stdout
        where[rule] = m.group(1)
        exchange[rule] = json.loads((tmp_path / f"{rule}.jsonl").read_text().splitlines()[-1])["ps_exchange"]
    assert "rank 0 on hpt-n1" in where["first"] and "rank 1 on hpt-n1" in where["first"], where
    assert "rank 0 on hpt-n1" in where["spread"] and "rank 2 on hpt-n2" in where["spread"], where
    # --ps-exchange auto: `first` leaves no node with both roles (messages
    # only); with `spread` the chief (rank 1, hpt-n1) shares memory with
    # server 0 and sends messages to server 1 on hpt-n2.
    assert exchange["first"] == "mpi" and exchange["spread"] == "shared+mpi", exchange
    assert_same_params(tmp_path / "first.h5", tmp_path / "spread.h5")


# ---- SLURM jobs across nodes -----------------------------------------------------------------

RING_JOB = Path(REPO) / "jobs" / "ring.slurm"
PS_JOB = Path(REPO) / "jobs" / "ps.slurm"
# Short runs (CI time): the claim is "the same training as on one node",
# checked against a one-node run of the same flags, not a fixed accuracy
# (0.90 at 160 steps on the bundled sample). A checkpoint every 20 steps: the
# interrupting tests act after a checkpoint and need the run to go on for a
# while after it (at least 120 steps here).
JOB_STEPS = 160
JOB_FLAGS = {
    "ring": ("--steps", str(JOB_STEPS), "--checkpoint-every", "20"),
    "ps": ("--steps", str(JOB_STEPS), "--checkpoint-every", "20"),
}
_JOB_RUNS = {}


def _uninterrupted(cluster, mode):
    """The job of `mode` on 2 nodes x 2 ranks, run to the end once: (output, --save file)."""
    if mode not in _JOB_RUNS:
        d = cluster.workdir / f"whole-{mode}"
        d.mkdir()
        script = RING_JOB if mode == "ring" else PS_JOB
        job_id, _, out = cluster.submit(script, *JOB_FLAGS[mode], "--save", d / "p.h5",
                                        "--metrics", d / "m.jsonl",
                                        env={"HPCTRAIN_CHECKPOINT_DIR": str(d / "ckpt")})
        rc, text = cluster.wait_ended(job_id, out)
        assert rc == 0, text
        _JOB_RUNS[mode] = (text, d / "p.h5", d / "m.jsonl")
    return _JOB_RUNS[mode]


@pytest.mark.parametrize("mode", ["ring", "ps"])
def test_sbatch_two_nodes_trains_as_on_one_node(cluster, tmp_path, mode):
    text, saved, metrics = _uninterrupted(cluster, mode)
    assert "2 node(s) hpt-n[1-2], 4 tasks" in text, text
    assert rank_hosts(text) == [("hpt-n1", 0), ("hpt-n1", 1), ("hpt-n2", 0), ("hpt-n2", 1)], text
    final = [json.loads(line) for line in Path(metrics).read_text().splitlines()][-1]
    assert (final["event"], final["world_size"], final["steps"]) == ("final", 4, JOB_STEPS), final
    # The same training on one node (4 ranks of one host, no network).
    single = tmp_path / "single.h5"
    flags = JOB_FLAGS[mode][:2]
    proc = _run(MPIRUN, "-n", 4, PYTHON, "-m", "hpctrain.mnist", "--mode", mode, *flags,
                "--save", single, timeout=300, env=child_env())
    accuracy = float(ACCURACY.search(text).group(1))
    single_accuracy = float(ACCURACY.search(proc.stdout).group(1))
    assert accuracy >= 0.85 and abs(accuracy - single_accuracy) <= 0.01, (accuracy, single_accuracy)
    if mode == "ps":
        # sync ps sums the workers' gradients in rank order wherever they run
        assert_same_params(saved, single)


STOPPED = re.compile(r"stopped by (SIG\w+) after step (\d+); checkpoint (\S+ckpt-\d+);")
RESUMED = re.compile(r"^resumed from (\S+) at step (\d+)$", re.M)


def _first_checkpoint(cluster, ckpt, job_id, out):
    cluster.wait("the first checkpoint", lambda: checkpoints(ckpt), 180, job_id, out)


def _start_requeued_now(cluster, job_id, out, restarts=1, settle_s=0):
    # SLURM holds a requeued job (BeginTime, about 2 min) before it may start
    # again; start it now, but not within the second the first run ended in
    # ("Job credential revoked": conftest.into_the_next_second), nor within
    # `settle_s` of its being requeued.
    cluster.wait("the requeued job", lambda: cluster.job(job_id)[:2] == ("PENDING", restarts),
                 120, job_id, out)
    time.sleep(settle_s)
    into_the_next_second()
    up = cluster.cli("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    # A job requeued while a node of its was failing is not held: SLURM may
    # have started it itself, as the node came back.
    started = "no longer pending" in up.stderr and cluster.job(job_id)[:2] == ("RUNNING", restarts)
    assert up.returncode == 0 or started, up.stdout + up.stderr


def test_a_job_killed_then_its_node_failing_requeues_and_resumes_bit_exact(cluster, tmp_path):
    # One job interrupted twice (one job, not one per interruption: CI time),
    # each time requeued and resumed from its checkpoint:
    # 1. kill-and-requeue: `scancel --signal=TERM` (as on pre-emption), the
    #    ranks on both nodes stop after the same step and checkpoint, and the
    #    job script requeues the job (restart 1).
    # 2. node failure, in the requeued run: the run ends before slurmctld
    #    marks hpt-n2 down (after SlurmdTimeout, 5 s here) and could requeue
    #    the job itself (MPICH's mpirun ends at once when a node's proxy is
    #    gone; under srun, MPICH's ranks crash when their peer's sockets
    #    close, and srun's exit then came first once in CI): the job script
    #    finds hpt-n2 silent and requeues the job (restart 2).
    # The end: the parameters of the uninterrupted run, bit for bit.
    _, whole, _ = _uninterrupted(cluster, "ring")
    ckpt = tmp_path / "ckpt"
    job_id, _, out = cluster.submit(RING_JOB, *JOB_FLAGS["ring"], "--save", tmp_path / "p.h5",
                                    env={"HPCTRAIN_CHECKPOINT_DIR": str(ckpt), "HPCTRAIN_LAUNCHER": "mpirun"})
    _first_checkpoint(cluster, ckpt, job_id, out)
    sent = cluster.cli("scancel", "--signal=TERM", job_id)
    assert sent.returncode == 0, sent.stderr
    _start_requeued_now(cluster, job_id, out)
    # The first run has ended (the job was pending): its last checkpoint is the
    # one the requeued run resumes from (seconds of start-up away from writing
    # another). The job's output comes when the launcher flushes it, so the
    # folder, not the output, tells that the requeued run wrote one of its own.
    stopped_at = checkpoint_steps(ckpt)[-1]
    cluster.wait("a checkpoint of the requeued run", lambda: checkpoint_steps(ckpt)[-1] > stopped_at,
                 180, job_id, out)
    _run(HERE / "slurm.sh", "stop-node", "hpt-n2")       # slurmd, slurmstepd and ranks: gone
    cluster.wait("hpt-n2 to be marked down", lambda: cluster.node_state("hpt-n2").startswith("down"),
                 120, job_id, out)
    _run(HERE / "slurm.sh", "start-node", "hpt-n2")      # the node comes back
    cluster.wait("hpt-n2 back in service", lambda: cluster.node_state("hpt-n2") in ("idle", "mixed", "allocated"),
                 60, job_id, out)
    # Started within a second of hpt-n2's return, the requeued run once got an
    # allocation of one node ("SLURM_JOB_NUM_NODES ... conflicts with allocated
    # node count (2 != 1)", its step never created): 2 s more, as the tests
    # always waited before.
    _start_requeued_now(cluster, job_id, out, restarts=2, settle_s=2)
    rc, text = cluster.wait_ended(job_id, out, restarts=2)
    assert rc == 0, text
    # 1: stopped by the signal mid-run, resumed from that very checkpoint
    stopped = STOPPED.search(text)
    assert stopped and 0 < int(stopped.group(2)) == stopped_at < JOB_STEPS, text
    resumed = RESUMED.findall(text)
    assert len(resumed) == 2 and resumed[0] == (stopped.group(3), stopped.group(2)), text
    # 2: requeued by the job script for the silent node (not by SLURM), resumed
    # from a checkpoint the requeued run wrote
    assert "mpirun exited 255 and node(s) hpt-n2 of the job no longer answer" in text, text
    assert "JobId=%s due to failure of node" % job_id not in _text(STATE / "slurm/ctld/slurmctld.log")
    assert Path(resumed[1][0]).parent == ckpt and int(resumed[1][1]) > int(stopped.group(2)), text
    assert "hpctrain-job: job %s '" % job_id in text and "run 2 (restart 1)" in text, text
    assert "run 3 (restart 2)" in text, text
    assert_same_params(tmp_path / "p.h5", whole)


def test_a_job_resubmitted_on_more_nodes_goes_on(cluster, tmp_path):
    # The checkpoint directory is named by the job name (jobs/launch.sh):
    # stop a 1-node job (not requeued), submit the same name on 2 nodes, and
    # it goes on from the checkpoint with twice the workers.
    env = {"HPCTRAIN_CHECKPOINT_ROOT": str(tmp_path), "HPCTRAIN_MAX_REQUEUES": "0"}
    job_id, name, out = cluster.submit(RING_JOB, *JOB_FLAGS["ring"], nodes=1, env=env)
    ckpt = tmp_path / name
    _first_checkpoint(cluster, ckpt, job_id, out)
    sent = cluster.cli("scancel", "--signal=TERM", job_id)
    assert sent.returncode == 0, sent.stderr
    rc, text = cluster.wait_ended(job_id, out)
    stopped = STOPPED.search(text)
    assert rc != 0 and stopped and "not requeued" in text, text
    job_id, _, out = cluster.submit(RING_JOB, *JOB_FLAGS["ring"], "--metrics", tmp_path / "m.jsonl",
                                    nodes=2, env=env, name=name)
    rc, text = cluster.wait_ended(job_id, out)
    assert rc == 0, text
    assert (f"resumed from {stopped.group(3)} at step {stopped.group(2)}; written with 2 workers, "
            f"this run has 4: the rest of epoch") in text, text
    final = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()][-1]
    assert (final["event"], final["world_size"], final["steps"]) == ("final", 4, JOB_STEPS), final


def _node_pids(node, what=b"hpctrain.mnist"):
    """The pids on node (its network namespace) whose command line has `what`
    (hpctrain's ranks); what=None: every process there but its slurmd."""
    pids = subprocess.run(["ip", "netns", "pids", _names("netns", node)], capture_output=True,
                          text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (what in argv) if what else not any(a.endswith(b"slurmd") for a in argv[:1]):
            found.append(int(pid))
    return found


SHRINK_FLAGS = ("--zero", "0", "--hidden", "32", "--log-every", "10", "--on-failure", "shrink",
                "--commit-every", "10", "--timeout", "30")
OMPI_JOB_ENV = {"OMPI_MCA_osc": "^ucx", "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


@pytest.mark.skipif(not OPEN_MPI, reason="needs Open MPI's ULFM (make test-openmpi runs it)")
def test_shrink_job_outlives_a_node_s_ranks(cluster, tmp_path):
    # jobs/launch.sh with --on-failure shrink launches mpirun --with-ft ulfm
    # (srun does not carry ULFM); Open MPI's SLURM launcher puts its daemon
    # on hpt-n2. Both of hpt-n2's ranks are killed after step 20: the two on
    # hpt-n1 shrink, go on from the commit and finish, rc 0. (Under hier, the
    # default on 2 nodes without the flag, this hung: see check_shrink_layout.)
    metrics = tmp_path / "m.jsonl"
    job_id, _, out = cluster.submit(RING_JOB, *SHRINK_FLAGS, "--steps", "200", "--metrics", metrics,
                                    env={"HPCTRAIN_CHECKPOINT_DIR": str(tmp_path / "ckpt"), **OMPI_JOB_ENV})
    cluster.wait("step 20", lambda: metrics.exists() and '"step": 20,' in metrics.read_text(), 120, job_id, out)
    ranks = _node_pids("hpt-n2")
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, 9)
    rc, text = cluster.wait_ended(job_id, out)
    assert rc == 0 and "--with-ft ulfm" in text and "hpctrain-job: finished" in text, text
    # the flat ring (hier's node communicators would hold a survivor: run/startup.check_shrink_layout)
    assert "hpctrain: allreduce ring (4 ranks on 2 nodes, 2 per node, node order)" in text, text
    said = [s for s in text.splitlines() if " failed at step " in s]
    assert len(said) == 1 and said[0].startswith("hpctrain: rank 2 (node hpt-n2, ") \
        and ", rank 3 (node hpt-n2, " in said[0] and "going on with 2 ranks" in said[0], text
    final = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    assert (final["event"], final["world_size"], final["steps"]) == ("final", 2, 200), final
    (recovery,) = final["recoveries"]
    assert (recovery["lost"], recovery["ranks_before"], recovery["ranks_after"]) == ([2, 3], 4, 2), recovery


@pytest.mark.skipif(not OPEN_MPI, reason="needs Open MPI's ULFM (make test-openmpi runs it)")
def test_shrink_job_requeues_when_a_node_s_daemon_is_lost(cluster, tmp_path):
    # Every process of the job on hpt-n2 killed, Open MPI's daemon (prted)
    # too: Open MPI 5.0's runtime ends the whole job then (mpirun exits 0,
    # ULFM or not); jobs/launch.sh names the node and takes the
    # checkpoint-and-requeue path instead of "no result".
    ckpt = tmp_path / "ckpt"
    job_id, _, out = cluster.submit(RING_JOB, *SHRINK_FLAGS, "--steps", "400", "--checkpoint-every", "20",
                                    env={"HPCTRAIN_CHECKPOINT_DIR": str(ckpt), **OMPI_JOB_ENV})
    _first_checkpoint(cluster, ckpt, job_id, out)
    for pid in _node_pids("hpt-n2", what=None):
        os.kill(pid, 9)
    cluster.wait("the requeue", lambda: cluster.job(job_id)[:2] == ("PENDING", 1), 120, job_id, out)
    cluster.cli("scancel", job_id)
    text = _text(out)
    assert ("hpctrain-job: error: Open MPI lost its daemon on node hpt-n2 (the node, or all of the job's "
            "processes on it, died) and its runtime ended every rank; going on from the last checkpoint in "
            f"{ckpt}") in text and "requeueing job" in text, text
    assert checkpoints(ckpt), text
