"""Parameter-server mode: placement, the protocol (sync rounds, snapshot and
restore, DC-ASGD, bounded staleness) and whole jobs.

    .venv/bin/python -m pytest tests/test_ps.py                       # serial + jobs
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_ps.py

Three kinds of tests:
- serial: placement, packing, the DC-ASGD formula;
- MPI (pytest-mpi): ps.Server and ps.Client on COMM_WORLD, with 1 ps below 4
  ranks and 2 ps from 4 on; expectations are computed from the size, so they
  pass at 2, 3 and 4 ranks (the DC-ASGD and staleness tests need 2 workers);
- jobs: `mpirun -n N python -m hpctrain.mnist --mode ps ...` launched from the
  plain pytest pass (they skip inside the MPI pass). Stragglers, a hung server
  and a signal are injected by tests/faults/inject_ps.py (FAULT_SLOW_WORKER=i:s,
  FAULT_HANG_PS=k:v, FAULT_SIGNAL=i:n): see `with_faults`.
"""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import checkpoint_file, checkpoint_path, checkpoint_steps, copy_checkpoint, only_checkpoints
from hpctrain.comm import ps
from hpctrain.nn import mlp

# ---------------------------------------------------------------------------
# serial


def tensor_ranges(hidden):
    return mlp(hidden=hidden).tensor_ranges()


@pytest.mark.parametrize("hidden", [(500, 500), (10,), (3, 5, 7)])
@pytest.mark.parametrize("strategy", ps.PLACEMENTS)
@pytest.mark.parametrize("num_ps", [1, 2, 3, 5, 7])
def test_placement_covers_every_parameter_exactly_once(hidden, strategy, num_ps):
    ranges = tensor_ranges(hidden)
    n = ranges[-1][2]
    layout = ps.place(ranges, num_ps, strategy)
    assert len(layout) == num_ps
    seen = np.zeros(n, np.int64)
    for server in layout:
        assert server == sorted(server)
        for (lo, hi), nxt in zip(server, server[1:] + [(None, None)]):
            assert 0 <= lo < hi <= n
            assert nxt[0] is None or hi < nxt[0]      # merged: no two ranges touch
            seen[lo:hi] += 1
    assert np.all(seen == 1)
    sizes = [sum(hi - lo for lo, hi in s) for s in layout]
    if strategy == "even":
        assert max(sizes) - min(sizes) <= 1 and all(len(s) <= 1 for s in layout)
    else:
        # whole tensors only: every tensor lies inside one server's ranges
        for _, lo, hi in ranges:
            assert sum(1 for s in layout for a, b in s if a <= lo and hi <= b) == 1
    if strategy == "round-robin":
        for i, (_, lo, hi) in enumerate(ranges):
            assert any(a <= lo and hi <= b for a, b in layout[i % num_ps])


def test_greedy_puts_the_biggest_tensor_alone_and_balances_the_rest():
    ranges = tensor_ranges((500, 500))
    layout = ps.place(ranges, 2, "greedy")
    assert layout[0] == [(0, 784 * 500)]               # layer0/W, the biggest
    assert layout[1] == [(784 * 500, ranges[-1][2])]   # everything else: one contiguous range
    layout = ps.place(ranges, 3, "greedy")
    loads = sorted(sum(hi - lo for lo, hi in s) for s in layout)
    assert loads == [5000 + 500 + 500 + 10, 250000, 392000]
    desc = ps.describe(ps.place(ranges, 2, "round-robin"), ranges)
    assert desc[0][1] == ["layer0/W", "layer1/W", "layer2/W"] and desc[1][0] == 500 + 500 + 10
    desc = ps.describe(ps.place(ranges, 2, "even"), ranges)
    half = ranges[-1][2] // 2
    assert desc[0] == (half, [f"layer0/W[0:{half}]"])
    assert desc[1][1][0] == f"layer0/W[{half}:{784 * 500}]"


def test_slice_is_a_view_when_contiguous_and_packs_otherwise():
    flat = np.arange(20, dtype=np.float32)
    one = ps.Slice(flat, [(3, 9)])
    assert not one.packed and np.shares_memory(one.buf, flat) and one.size == 6
    two = ps.Slice(flat, [(0, 2), (10, 13)])
    two.pack()
    assert two.packed and two.buf.tolist() == [0, 1, 10, 11, 12]
    two.buf[:] = -1
    two.unpack()
    assert flat[:2].tolist() == [-1, -1] and flat[10:13].tolist() == [-1, -1, -1] and flat[2] == 2


def test_dc_compensation_matches_the_formula():
    rng = np.random.default_rng(0)
    n = 100_003  # several blocks and a ragged end
    g, w, w_bak = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    lam = 0.7
    direct = (g.astype(np.float64) + lam * g.astype(np.float64) ** 2 * (w.astype(np.float64) - w_bak))
    out = ps.dc_compensate(g.copy(), w, w_bak, lam, np.empty(ps.BLOCK, np.float32))
    np.testing.assert_allclose(out, direct, rtol=1e-5, atol=1e-6)
    same = ps.dc_compensate(g.copy(), w, w_bak, 0.0, np.empty(7, np.float32))
    assert np.array_equal(same, g)


# ---------------------------------------------------------------------------
# MPI: the protocol on COMM_WORLD

TENSORS = [("a", 0, 300), ("b", 300, 310), ("c", 310, 1000)]   # 2 ps round-robin: ps 0 holds a and c
N = 1000


def roles():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    num_ps = 1 if world.size < 4 else 2
    return world, list(range(num_ps)), list(range(num_ps, world.size))


class Setup:
    """Servers and workers on a fresh duplicate of COMM_WORLD, each rank with a
    watchdog that aborts the job instead of hanging if a test goes wrong.
    exchange="shared": through one shared-memory window (every rank is on
    this node), with a reply buffer per worker when not sync (as Server
    keeps them)."""

    def __init__(self, placement="round-robin", exchange="mpi", sync=True):
        from mpi4py import MPI
        from hpctrain.comm.deadline import Watchdog
        from hpctrain.comm.ps.shared import SharedExchange, segment_floats
        world, self.servers, self.workers = roles()
        self.comm = world.Dup()
        self.rank = self.comm.rank
        self.is_server = self.rank < len(self.servers)
        self.layout = ps.place(TENSORS, len(self.servers), placement)
        self.dog = Watchdog(60, self.rank, world.Abort)
        color = 0 if not self.is_server else 1
        self.wcomm = world.Split(color, self.rank)   # the workers among themselves
        self.shared = None
        if exchange == "shared":
            node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
            assert node.size == world.size
            size = ps.placement.slice_size(self.layout[self.rank]) if self.is_server else 0
            floats = segment_floats(self.is_server, N, size, len(self.workers), reply_bufs=not sync)
            self.shared = SharedExchange(node, list(range(world.size)), floats, np.float32, self.dog)
            node.Free()

    def serve(self, optimizer_cls, **kw):
        mine = self.layout[self.rank]
        size = sum(hi - lo for lo, hi in mine)
        kw.setdefault("lr_fn", lambda v: 0.5)
        lr_fn = kw.pop("lr_fn")
        server = ps.Server(self.comm, mine, self.workers, self.servers, optimizer_cls(size), lr_fn,
                           watchdog=self.dog, shared=self.shared, **kw)
        server.serve_until_done()
        return server

    def client(self, sync=True):
        self.params = np.zeros(N, np.float32)
        self.grads = np.zeros(N, np.float32) if self.shared is None else self.shared.worker_grads(self.rank, N)
        index = self.rank - len(self.servers)
        return index, ps.Client(self.comm, self.servers, self.layout, self.params, self.grads, index,
                                len(self.workers), sync=sync, watchdog=self.dog, shared=self.shared)

    def close(self):
        if self.shared is not None:
            self.shared.close()
            free_window(self.shared)
        self.wcomm.Free()
        self.comm.Free()


def free_window(shared):
    """Free a SharedExchange's window now, after close(): collective over the
    node, which a test's ranks all reach (a run leaves it to MPI_Finalize:
    shared.py); nothing reads its parts after."""
    with shared.watchdog.waiting("shared-memory exchange: freeing the window", peer=shared.ranks):
        shared.win.Free()


WHOLE = [("p", (N,), 0, N)]   # the flat parameters as one tensor: what a server writes of a snapshot


def flat_writer(rank, ranges):
    """A server's `write` (as loops/ps.server_files', without a model): its
    ranges of the one tensor `p` and of its optimizer state's `<key>/p`."""
    from hpctrain.checkpoints.named import write_part
    from hpctrain.state.parts import flat_parts

    def write(folder, params, states):
        parts = flat_parts(WHOLE, ranges, params) + [
            q for key, a in sorted(states.items()) for q in flat_parts(WHOLE, ranges, a, prefix=f"{key}/")]
        return write_part(folder, rank, [(q.name, q.box, q.view) for q in parts])
    return write


def read_cut(cut, folder, keys):
    """(params, {key: state}) of the checkpoint the servers wrote into
    folder, once the chief wrote its index (named.finish)."""
    from hpctrain.checkpoints.named import finish, open_checkpoint
    tensors = {name: ((N,), "<f4", []) for name in ["p", *(f"{k}/p" for k in keys)]}
    path = finish(os.path.dirname(folder), cut.versions[0], folder, tensors, {}, {}, cut.written)
    with open_checkpoint(path) as ckpt:
        assert sorted(ckpt.files) == [f"rank-{r:05d}.h5" for r in roles()[1]]   # one file per server
        return ckpt.read("p"), {k: ckpt.read(f"{k}/p") for k in keys}


def gradient(worker, step):
    return np.random.default_rng([worker, step]).standard_normal(N).astype(np.float32)


EXCHANGES = ["mpi", "shared"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("placement", ["even", "round-robin"])
def test_sync_rounds_sum_in_worker_order_on_every_server(placement, exchange):
    from hpctrain.optim.sgd import SGD
    s = Setup(placement, exchange)
    rounds, lr = 4, 0.5
    W = len(s.workers)
    if s.is_server:
        server = s.serve(SGD, steps=rounds, lr_fn=lambda v: lr)
        assert server.round.version == rounds and server.stats.updates == rounds and server.stats.stale_dropped == 0
        s.close()
        return
    index, client = s.client()
    p0 = np.random.default_rng(123).standard_normal(N).astype(np.float32)
    if index == 0:
        client.restore(0, 0, p0)
    client.pull()
    got = [s.params.copy()]
    versions = []
    while not client.stop:
        s.grads[:] = gradient(index, client.version)
        client.push_pull(float(index))
        got.append(s.params.copy())
        versions.append(client.version)
    stats, _ = client.final()
    s.close()
    # the same arithmetic as the server: sum in worker order, then SGD's params -= g * (lr / W)
    expect = p0.copy()
    assert np.array_equal(got[0], expect)
    for r in range(rounds):
        total = gradient(0, r) if W == 1 else np.add(gradient(0, r), gradient(1, r))
        for w in range(2, W):
            total += gradient(w, r)
        expect -= total * (lr * (1.0 / W))
        assert np.array_equal(got[r + 1], expect), f"round {r}"
    assert versions == list(range(1, rounds + 1))
    assert client.loss == pytest.approx(sum(range(W)) / W)        # the round's mean loss rides along
    summary = ps.summarize(stats, W)
    assert summary["updates"] == rounds and summary["pushes_by_worker"] == [rounds] * W
    assert summary["ps_versions"] == [rounds] * len(s.servers)
    assert sum(summary["ps_elements"]) == N


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_snapshot_and_restore_round_trip_parameters_adam_state_and_positions(exchange):
    import tempfile
    from hpctrain.checkpoints.named import new_folder
    from hpctrain.optim.adam import Adam
    s = Setup("round-robin", exchange, sync=False)
    W = len(s.workers)
    if s.is_server:
        s.serve(Adam, steps=100, sync=False, lr_fn=lambda v: 1e-3 * (v + 1),
                write=flat_writer(s.rank, s.layout[s.rank]))
        s.close()
        return
    index, client = s.client(sync=False)
    top = tempfile.mkdtemp(prefix="ps-snapshot-") if index == 0 else None
    made = contextlib.ExitStack()   # the chief's: each removed unless finish renamed it into place
    if index == 0:
        rng = np.random.default_rng(7)
        p0 = rng.standard_normal(N).astype(np.float32)
        m0 = rng.standard_normal(N).astype(np.float32)
        v0 = rng.random(N).astype(np.float32)
        pos0 = np.arange(2 * W).reshape(W, 2) * 32
        client.restore(7, 5, p0, {"m": m0, "v": v0}, pos0)
        folders = [made.enter_context(new_folder(top, 7)) for _ in range(3)]
        first = client.snapshot(folders[0])
        # one more update on the servers, then the same on a local Adam from the same state
        g = gradient(0, 0)
        s.grads[:] = g
        client.push_pull(0.0, position=(3, 96))
        pushed = s.params.copy()
        second = client.snapshot(folders[1])
        local = Adam(N)
        local.m[:], local.v[:], local.t = m0, v0, 5
        p = p0.copy()
        local.step(p, g, 1e-3 * 8, 1.0)
    s.wcomm.Barrier()        # the others finish only after the snapshots: the final state is the same
    _, final_cut = client.final(folders[2] if index == 0 else None)
    s.close()
    assert (final_cut is None) == (index != 0) and not hasattr(client, "final_state")   # returned, not set aside
    if index != 0:
        return
    versions, ts, _, positions = first
    params, states = read_cut(first, folders[0], ("m", "v"))
    assert versions == [7] * len(s.servers) and ts == [5] * len(s.servers) and first.consistent
    assert np.array_equal(params, p0) and np.array_equal(states["m"], m0) and np.array_equal(states["v"], v0)
    assert np.array_equal(positions, pos0)
    versions, ts, _, positions = second
    params, states = read_cut(second, folders[1], ("m", "v"))
    assert versions == [8] * len(s.servers) and ts == [6] * len(s.servers)
    assert np.array_equal(params, p) and np.array_equal(pushed, p)
    assert np.array_equal(states["m"], local.m) and np.array_equal(states["v"], local.v)
    expect_pos = pos0.copy()
    expect_pos[0] = 3, 96    # the chief's push carried its position; the others' are the restored ones
    assert np.array_equal(positions, expect_pos)
    versions, ts, _, positions = final_cut
    _, states = read_cut(final_cut, folders[2], ("m", "v"))
    made.close()
    assert sorted(os.listdir(top)) == ["ckpt-00000007", "ckpt-00000008"]   # the folders renamed, nothing left
    shutil.rmtree(top)
    assert ts == [6] * len(s.servers) and versions == [8] * len(s.servers) and np.array_equal(states["m"], local.m) and np.array_equal(states["v"], local.v)
    assert np.array_equal(positions, expect_pos) and np.array_equal(s.params, p)


def two_worker_race(s, first, second):
    """Workers 0 and 1 both pull version 0; worker 1 pushes (applied at once),
    then worker 0 pushes its gradient of version 0, one version late.
    Returns (p0, p1, p2) as worker 0 sees them; other workers just finish."""
    index, client = s.client(sync=False)
    p0 = np.random.default_rng(5).standard_normal(N).astype(np.float32)
    if index == 0:
        client.restore(0, 0, p0)
    result = None
    if index < 2:
        client.pull()
        s.wcomm.Barrier()                  # both hold version 0
        if index == 1:
            s.grads[:] = second
            client.push_pull(1.0)
        s.wcomm.Barrier()                  # worker 1's update is in
        if index == 0:
            p1 = p0 - second * np.float32(0.5)
            s.grads[:] = first
            client.push_pull(0.0)
            result = (p0, p1, s.params.copy(), client)
    stats, _ = client.final()
    return result, stats


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("lam", [0.0, 2.0])
def test_dc_asgd_update_matches_a_direct_computation(lam, exchange):
    from hpctrain.optim.sgd import SGD
    s = Setup("round-robin", exchange, sync=False)
    g0, g1 = gradient(0, 1), gradient(1, 1)
    if s.is_server:
        server = s.serve(SGD, steps=100, sync=False, dc_lambda=lam)
        s.close()
        assert server.stats.updates == 2 and server.stats.st_max == 1 and list(server.stats.hist[:3]) == [1, 1, 0]
        return
    result, stats = two_worker_race(s, g0, g1)
    s.close()
    if result is None:
        return
    p0, p1, p2, client = result
    if lam == 0:   # plain async: worker 0's gradient applied as it is, one version late
        assert np.array_equal(p2, p1 - g0 * np.float32(0.5))
    else:
        f64 = np.float64
        direct = g0.astype(f64) + lam * g0.astype(f64) ** 2 * (p1.astype(f64) - p0)
        np.testing.assert_allclose(p2, p1 - 0.5 * direct, rtol=1e-5, atol=1e-6)
        assert not np.allclose(p2, p1 - g0 * np.float32(0.5), rtol=1e-5, atol=1e-6)
    summary = ps.summarize(stats, len(s.workers))
    assert summary["staleness_max"] == 1 and summary["staleness_mean"] == 0.5
    assert summary["staleness_histogram"] == [1, 1] and client.rejected == 0


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_a_push_beyond_max_staleness_is_not_applied_and_brings_fresh_parameters(exchange):
    from hpctrain.optim.sgd import SGD
    s = Setup("even", exchange, sync=False)
    g0, g1 = gradient(0, 2), gradient(1, 2)
    if s.is_server:
        server = s.serve(SGD, steps=100, sync=False, max_staleness=0)
        s.close()
        assert server.stats.updates == 1 and server.stats.stale_dropped == 1
        return
    result, stats = two_worker_race(s, g0, g1)
    s.close()
    if result is None:
        return
    p0, p1, p2, client = result
    assert np.array_equal(p2, p1) and client.rejected == 1 and client.version == 1
    summary = ps.summarize(stats, len(s.workers))
    assert summary["stale_dropped"] == 1 and summary["dropped_by_worker"][:2] == [1, 0]


# ---------------------------------------------------------------------------
# jobs: mpirun -n N python -m hpctrain.mnist --mode ps ...


def saved(path):
    import h5py
    with h5py.File(path, "r") as f:
        return {f"{g}/{k}": f[g][k][()] for g in f for k in f[g]}, dict(f.attrs)


def final_record(path):
    return json.loads(path.read_text().splitlines()[-1])


def ok(r):
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")


def with_faults(**faults):
    """job() keywords that run tests/faults/inject_ps.py with these FAULT_* variables."""
    return {"module": "inject_ps", "env": {"PYTHONPATH": FAULTS, **faults}}


@pytest.mark.parametrize("ranks, num_ps, placement", [(3, 1, "even"), (5, 2, "round-robin")])
def test_sync_ps_equals_ring_under_sgd(job, tmp_path, ranks, num_ps, placement):
    """The same sum in other orders: rounding, compared after 20 steps, before
    a unit crossing ReLU's kink amplifies the last bit (test_train.py's ring
    against mpi: 3e-8 after 20 steps, 1.5e-4 after 50 at 3 workers)."""
    common = ["--optimizer", "sgd", "--lr", "0.05", "--steps", "20", "--log-every", "10"]
    ok(job(ranks, "--mode", "ps", "--num-ps", num_ps, "--placement", placement, "--sync", *common,
           "--save", tmp_path / "ps.h5"))
    ok(job(ranks - num_ps, "--mode", "ring", *common, "--save", tmp_path / "ring.h5"))
    a, attrs = saved(tmp_path / "ps.h5")
    b, _ = saved(tmp_path / "ring.h5")
    assert set(a) == set(b) and attrs["mode"] == "ps" and attrs["step"] == 20
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-5


def test_shared_memory_exchange_gives_the_bits_of_mpi_messages(job, tmp_path):
    """--ps-exchange auto (one node: a shared-memory window) against mpi, sync
    Adam with 2 servers holding packed slices (round-robin): the same
    parameters, and the record says which exchange ran."""
    common = ["--mode", "ps", "--num-ps", 2, "--placement", "round-robin", "--steps", 40, "--hidden", "64,32",
              "--log-every", 40]
    runs = {}
    for exchange in ("auto", "mpi"):
        r = ok(job(5, *common, "--ps-exchange", exchange, "--save", tmp_path / f"{exchange}.h5",
                   "--metrics", tmp_path / f"{exchange}.jsonl"))
        runs[exchange] = saved(tmp_path / f"{exchange}.h5")[0]
        record = final_record(tmp_path / f"{exchange}.jsonl")
        assert record["ps_exchange"] == {"auto": "shared", "mpi": "mpi"}[exchange]
        line = {"auto": "shared memory (only the headers", "mpi": "uses MPI messages"}[exchange]
        assert f"exchange (--ps-exchange {exchange}): the chief uses" in r.stdout and line in r.stdout, r.stdout
    assert all(np.array_equal(runs["auto"][k], runs["mpi"][k]) for k in runs["mpi"])


def test_a_rank_with_another_ps_exchange_is_one_line_not_a_hang(tmp_path):
    """open_shared is collective on the node: a rank launched with another
    --ps-exchange must stop the job at the start-up comparison."""
    from conftest import MPIRUN, REPO
    from hpctrain.run.cluster import child_env
    py = [sys.executable, "-m", "hpctrain.mnist", "--mode", "ps", "--steps", "3", "--hidden", "16", "--timeout", "20"]
    r = subprocess.run([MPIRUN, "-n", "2", *py, ":", "-n", "1", *py, "--ps-exchange", "mpi"],
                       capture_output=True, text=True, timeout=120, env=child_env(), cwd=REPO)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error")]
    assert lines == ["hpctrain: error: ranks disagree on the job: ps_exchange: rank 0 has auto, rank 2 has mpi"], r.stderr


@pytest.mark.mpi(min_size=2)
def test_a_node_shares_memory_only_when_every_rank_can():
    """open_shared: one node with a server and workers gets a window with each
    rank's part; not with --ps-exchange mpi, not when one rank cannot (a GPU
    worker), not when /dev/shm has no room; every rank decides the same."""
    from mpi4py import MPI
    from hpctrain.run.cluster import Cluster
    from hpctrain.comm.ps.shared import open_shared
    world = MPI.COMM_WORLD
    c = Cluster(world, "ps", 1)
    sizes = dict(num_params=N, server_sizes=[N], reply_bufs=True, dtype=np.float32)
    shared, why = open_shared(c, enabled=True, able=True, **sizes)
    assert shared is not None and why == "" and shared.ranks == list(range(world.size))
    # a part may be longer than asked (Open MPI rounds it up to whole pages)
    assert shared.part(0).size >= N * (1 + c.num_workers) and shared.worker_grads(world.size - 1, N).size == N
    assert shared.server_reply_bufs(0, N, c.num_workers).shape == (c.num_workers, N)
    mine = shared.part(world.rank)
    mine[:] = world.rank
    shared.sync()
    world.Barrier()
    shared.sync()
    assert [float(shared.part(r)[-1]) for r in range(world.size)] == list(range(world.size))
    shared.close()
    free_window(shared)
    assert not hasattr(shared, "free")     # no test-only method in production code (the tests free it)
    assert open_shared(c, enabled=False, able=True, **sizes) == (None, "")
    assert open_shared(c, enabled=True, able=world.rank != world.size - 1, **sizes) == (
        None, "a worker on this node is a GPU worker (device buffers go as messages)")
    shared, why = open_shared(c, enabled=True, able=True, room=lambda: N * 4, **sizes)
    assert shared is None and why.startswith("/dev/shm on this node has too little room for the window"), why
    for comm in (c.worker_comm, c.ps_comm, c.local_comm):
        if comm != MPI.COMM_NULL:
            comm.Free()


def test_sync_ps_is_bit_reproducible_at_3_workers(job, tmp_path):
    runs = []
    for name in ("a", "b"):
        ok(job(4, "--mode", "ps", "--num-ps", 1, "--steps", 50, "--hidden", "64", "--log-every", 50,
               "--save", tmp_path / f"{name}.h5"))
        runs.append(saved(tmp_path / f"{name}.h5")[0])
    assert all(np.array_equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_backup_workers_drop_exactly_the_late_gradients(job, tmp_path):
    # 3 workers, aggregate 2; worker 2 sleeps 0.1 s per step while the others take ~2 ms
    m = tmp_path / "m.jsonl"
    ok(job(4, "--mode", "ps", "--num-ps", 1, "--backup-workers", 1, "--hidden", "32", "--steps", 300,
           "--log-every", 100, "--metrics", m, **with_faults(FAULT_SLOW_WORKER="2:0.1")))
    f = final_record(m)
    late = f["pushes_by_worker"][2]
    assert f["updates"] == 300 and f["replicas_to_aggregate"] == 2 and f["backup_workers"] == 1
    assert f["pushes_by_worker"][:2] == [300, 300]          # every fast gradient was used
    assert late >= 1 and f["dropped_by_worker"] == [0, 0, late] and f["stale_dropped"] == late


def test_a_straggler_holds_sync_back_without_backup_workers_and_not_with(job, tmp_path):
    # Worker 1 sleeps 0.1 s per step. Without a backup every round waits for
    # its gradient; with one, rounds close on the first arrival, so the
    # straggler's gradients are mostly late and dropped (not a wall-clock
    # threshold: that flaked on a loaded machine).
    loop, used = {}, {}
    for backup in (0, 1):
        m = tmp_path / f"m{backup}.jsonl"
        ok(job(3, "--mode", "ps", "--backup-workers", backup, "--hidden", "32", "--steps", 15,
               "--log-every", 15, "--metrics", m, **with_faults(FAULT_SLOW_WORKER="1:0.1")))
        f = final_record(m)
        assert f["updates"] == 15
        loop[backup] = f["loop_s"]
        used[backup] = [p - d for p, d in zip(f["pushes_by_worker"], f["dropped_by_worker"])]
    assert loop[0] >= 15 * 0.1
    assert used[0] == [15, 15]                    # every round held both gradients
    assert sum(used[1]) == 15                     # one gradient per round: the first to arrive
    assert used[1][1] < used[1][0]                # ... mostly the fast worker's


def test_async_converges_and_reports_staleness(job, tmp_path):
    m = tmp_path / "m.jsonl"
    r = ok(job(3, "--mode", "ps", "--async", "--steps", 300, "--log-every", 100, "--metrics", m))
    f = final_record(m)
    assert f["test_accuracy"] >= 0.85, f
    assert f["steps"] == 300 and f["updates"] == 300 and f["sync"] is False
    assert sum(f["staleness_histogram"]) == 300 and f["staleness_max"] >= 1 and f["staleness_mean"] > 0
    assert sum(f["pushes_by_worker"]) == 300 + f["after_stop_dropped"]
    out = r.stdout
    assert "/job:ps/task:0 = rank 0" in out and "/job:worker/task:1 = rank 2" in out
    assert "/job:ps/task:0: 648,010 parameters, 2,592,040 bytes" in out
    assert re.search(r"^worker 0: step +\d+/300", out, re.M) and re.search(r"^worker 1: step +\d+/300", out, re.M)


def test_async_with_dc_asgd_and_bounded_staleness_trains(job, tmp_path):
    m = tmp_path / "m.jsonl"
    ok(job(4, "--mode", "ps", "--num-ps", 2, "--placement", "greedy", "--async", "--dc-lambda", "0.5",
           "--max-staleness", 1, "--hidden", "64", "--steps", 200, "--log-every", 100, "--lr", "1e-3",
           "--metrics", m))
    f = final_record(m)
    assert f["updates"] == 200 and f["staleness_max"] <= 1 and f["dc_lambda"] == 0.5
    assert f["test_accuracy"] > 0.6, f


@pytest.mark.parametrize("mode", ["--sync", "--async"])
def test_a_signal_on_one_worker_stops_every_rank(job, tmp_path, mode):
    m = tmp_path / "m.jsonl"
    r = job(4, "--mode", "ps", "--num-ps", 2, mode, "--hidden", "32", "--steps", 5000, "--log-every", 10,
            "--metrics", m, timeout=120, **with_faults(FAULT_SIGNAL="1:20"))
    assert r.returncode == 75, r.stderr
    errors = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(errors) == 1 and re.match(r"hpctrain: error: stopped by SIGUSR1 after step \d+;", errors[0]), errors
    step = int(re.search(r"after step (\d+)", errors[0]).group(1))
    if mode == "--sync":
        assert step == 20   # worker 1's 20th push asked; that round was the last
    assert f"stopping after step {step}: signal received" in r.stdout
    assert m.exists()


def test_a_stopped_sync_run_resumes_where_an_uninterrupted_run_ends(job, tmp_path):
    # 2 ps + 2 workers, Adam: checkpoints every 15 steps (SNAPSHOT) and at the
    # signal (the final state); resuming from either ends bit for bit where
    # the uninterrupted run ends.
    common = ["--mode", "ps", "--num-ps", 2, "--steps", 40, "--hidden", "64", "--log-every", 10]
    ok(job(4, *common, "--save", tmp_path / "straight.h5"))
    ckpt = tmp_path / "ckpt"
    r = job(4, *common, "--checkpoint-dir", ckpt, "--checkpoint-every", 15,
            **with_faults(FAULT_SIGNAL="1:22"))
    assert r.returncode == 75, r.stderr
    assert f"stopped by SIGUSR1 after step 22; checkpoint {checkpoint_path(ckpt, 22)}" in r.stderr
    assert checkpoint_steps(ckpt) == [15, 22] and only_checkpoints(ckpt), os.listdir(ckpt)
    from hpctrain.checkpoints.named import open_checkpoint
    for step in (15, 22):   # each server wrote its own part (ranks 0 and 1); the chief, no state to write, none
        with open_checkpoint(checkpoint_path(ckpt, step)) as written:
            assert sorted(written.files) == ["rank-00000.h5", "rank-00001.h5"], written.files
    periodic = tmp_path / "periodic"
    periodic.mkdir()
    copy_checkpoint(checkpoint_path(ckpt, 15), periodic)
    straight, _ = saved(tmp_path / "straight.h5")
    for directory, step in ((ckpt, 22), (periodic, 15)):
        r = ok(job(4, *common, "--checkpoint-dir", directory, "--save", tmp_path / "resumed.h5"))
        assert f"resumed from {checkpoint_path(directory, step)} at step {step}" in r.stdout
        resumed, attrs = saved(tmp_path / "resumed.h5")
        assert attrs["step"] == 40 and all(np.array_equal(straight[k], resumed[k]) for k in straight)
        assert 40 in checkpoint_steps(directory)


@pytest.mark.parametrize("mode", ["sync-backup", "async"])
def test_a_checkpoint_is_one_cut_across_servers(job, tmp_path, mode):
    """With backup workers (a slow chief: the others move the rounds on while
    it takes a snapshot) every checkpoint holds one version and one optimizer
    step on every server (issue 10, part 2.1); async servers are at their own
    versions, and every cut is written at ps 0's (issue 19, part 3.1)."""
    cuts, ckpt = tmp_path / "cuts.jsonl", tmp_path / "ckpt"
    if mode == "async":
        ranks, flags = 4, ["--async"]
    else:
        ranks, flags = 5, ["--backup-workers", 1]
    ok(job(ranks, "--mode", "ps", "--num-ps", 2, *flags, "--hidden", "32", "--steps", 60,
           "--checkpoint-dir", ckpt, "--checkpoint-every", 5, "--keep-checkpoints", 100, "--log-every", 60,
           **with_faults(FAULT_SLOW_WORKER="0:0.02", PROBE_CUTS=str(cuts))))
    records = [json.loads(line) for line in cuts.read_text().splitlines()]
    assert records and records[-1]["kind"] == "final"
    written = set(checkpoint_steps(ckpt))
    for rec in records:
        one = len(set(rec["versions"])) == 1 and len(set(rec["ts"])) == 1
        if mode != "async":
            assert one, rec            # sync: the leader's hold makes every cut one version
        assert rec['versions'][0] in written, rec
    for step in written:
        attrs = saved_attrs(checkpoint_file(checkpoint_path(ckpt, step)))
        assert attrs["optimizer_t"] == attrs["step"]      # Adam: one step per version, on every server


def saved_attrs(path):
    import h5py
    with h5py.File(path, "r") as f:
        return dict(f.attrs)


def start_job(n, *args, env):
    """Like the job fixture, but running in the background (tests/faults/inject_ps.py)."""
    from conftest import MPIRUN, REPO
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("PMI_", "MPI_LOCAL", "OMPI_", "PMIX_", "HYDRA_"))}
    full_env.update({"PYTHONPATH": FAULTS, **env})
    cmd = [MPIRUN, "-n", str(n), sys.executable, "-m", "inject_ps", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            cwd=REPO)


def wait_for(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.1)


def local_steps(progress, worker):
    """The worker's local step count as its PROBE_PROGRESS file says (0: none yet)."""
    try:
        return int((progress / f"worker-{worker}.steps").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def stop_one_async_worker(tmp_path, stopped_for, steps=600, timeout=8):
    """4 ranks (1 ps, 3 workers), async, --timeout `timeout`; worker 2 (rank 3) stops
    itself in its 20th step with its push sent and its reply posted (both
    2.6 MB: they stay half-way while it is stopped); SIGCONT after
    `stopped_for` seconds (None: never). Returns (result, worker 0's local
    steps when worker 2 stopped, when it went on)."""
    pids, progress = tmp_path / "pids", tmp_path / "progress"
    pids.mkdir()
    progress.mkdir()
    proc = start_job(4, "--mode", "ps", "--async", "--steps", steps, "--log-every", 300, "--timeout", timeout,
                     "--metrics", tmp_path / "m.jsonl",
                     env={"FAULT_PID_DIR": str(pids), "PROBE_PROGRESS": str(progress),
                          "FAULT_STOP_WORKER": "2:20"})
    pid = None
    try:
        wait_for(lambda: (pids / "rank-3.pid").exists(), 120, "pid file")
        pid = int((pids / "rank-3.pid").read_text())
        wait_for(lambda: stopped(pid), 120, "stop of worker 2")
        before = local_steps(progress, 0)
        if stopped_for:
            time.sleep(stopped_for)
        else:   # stopped for good: the others seen training on (polled: the deadline is the test's time)
            wait_for(lambda: local_steps(progress, 0) - before >= 20 or proc.poll() is not None, 60,
                     "steps of worker 0")
        during = local_steps(progress, 0)
        if stopped_for:
            os.kill(pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), before, during


def test_async_a_stopped_worker_does_not_stop_the_others(job, tmp_path):
    """Issue 10, part 2.2: the server never waits on one worker's gradient or
    reply; the stopped one is named in one line, and the job ends normally
    once it is back (before the deadline)."""
    r, before, during = stop_one_async_worker(tmp_path, stopped_for=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert during - before >= 20, (before, during)        # the others trained while worker 2 was stopped
    warnings = [line for line in r.stderr.splitlines() if "has sent nothing" in line]
    assert len(warnings) == 1 and warnings[0].startswith("hpctrain: warning: worker 2 (rank 3)"), r.stderr
    f = final_record(tmp_path / "m.jsonl")
    assert f["steps"] == 600 and f["updates"] == 600


def test_async_a_worker_that_never_returns_ends_the_job_at_the_deadline(job, tmp_path):
    # 100000 steps: the others are still training at the deadline. --timeout 5
    # (the suite's time), as the other 4-rank ps stalls: the others are seen
    # training (20 steps) well within it.
    r, before, during = stop_one_async_worker(tmp_path, stopped_for=None, steps=100000, timeout=5)
    assert r.returncode == 3, r.stderr[-3000:]
    assert during - before >= 20, (before, during)
    assert re.search(r"^hpctrain: error: rank 0 waited \d+ s for rank 3 \(requests from worker 2\); "
                     r"giving up \(--timeout 5\)$", r.stderr, re.M), r.stderr


@pytest.mark.parametrize("mode", ["backup", "async"])
def test_a_worker_stuck_for_good_is_left_behind_and_the_result_is_written(job, tmp_path, mode):
    """Issue 10, part 2.3: worker 2 stops for good in its 3rd step (early: in
    async mode the others could finish the 60 versions before a 10th); the
    others finish the run; at the deadline the servers leave it behind, the
    chief writes --save, the final checkpoint and the final record, and the
    job ends with exit 3 and a line naming it."""
    ckpt, m, save = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "p.h5"
    flags = ["--backup-workers", 1] if mode == "backup" else ["--async"]
    pids = tmp_path / "pids"
    pids.mkdir()
    try:
        # --timeout 5, not 8 (the suite's time): the others' 60 steps take a second or two
        r = job(4, "--mode", "ps", *flags, "--hidden", "32", "--steps", 60, "--log-every", 30, "--timeout", 5,
                "--checkpoint-dir", ckpt, "--metrics", m, "--save", save, timeout=120,
                **with_faults(FAULT_STOP_WORKER="2:3", FAULT_PID_DIR=str(pids)))
    finally:
        try:
            os.kill(int((pids / "rank-3.pid").read_text()), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
    assert r.returncode == 3, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert len(errors) == 1 and errors[0].startswith("hpctrain: error: worker 2 (rank 3) sent nothing for "
                                                     "--timeout 5 s and never finished; the result of step 60 "
                                                     "is written"), r.stderr
    f = final_record(m)
    assert f["event"] == "final" and f["steps"] == 60 and f["abandoned_workers"] == [2]
    params, attrs = saved(save)
    assert attrs["step"] == 60 and attrs["mode"] == "ps"
    assert 60 in checkpoint_steps(ckpt)


def test_a_server_that_stops_answering_is_a_deadline_error(job):
    r = job(3, "--mode", "ps", "--hidden", "32", "--steps", 1000, "--timeout", 3,
            timeout=60, **with_faults(FAULT_HANG_PS="0:5"))
    assert r.returncode == 3, r.stderr
    assert re.search(r"^hpctrain: error: rank [12] waited \d+ s for rank 0 \(.*\); giving up \(--timeout 3\)$",
                     r.stderr, re.M), r.stderr


@pytest.mark.parametrize("ranks, flags, expect", [
    (2, ["--num-ps", "2"], "needs more than 2 ranks"),
    (3, ["--replicas-to-aggregate", "3"], "is more than the 2 workers"),
    (3, ["--backup-workers", "2"], "must be less than the 2 workers"),
])
def test_invalid_layouts_are_one_line_errors(job, tmp_path, ranks, flags, expect):
    from hpctrain.base.errors import HpctrainError
    from hpctrain.flags import cli
    with pytest.raises(HpctrainError, match=re.escape(expect)):   # cli.validate, as every rank runs it
        cli.validate(cli.parse(["--mode", "ps", *flags], quiet=True), ranks)
    if "--num-ps" not in flags:
        return   # the whole job for the first alone: the same agreed line for each
    r = job(ranks, "--mode", "ps", *flags, "--save", tmp_path / "p.h5", timeout=60)
    errors = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(errors) == 1 and expect in errors[0], r.stderr
    assert errors[0].startswith("hpctrain: error:") and not (tmp_path / "p.h5").exists()


def test_ps_device_gpu_path_equals_host_servers_and_resumes(job, tmp_path):
    """--ps-device gpu (servers update on the device through optim.OnDevice;
    NumPy stands in for CuPy through tests/numpy_as_gpu.py) gives the same
    bits as host servers, also across a checkpoint and resume."""
    common = ["--mode", "ps", "--num-ps", 2, "--steps", 30, "--hidden", "64"]
    stand_in = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}
    ok(job(4, *common, "--save", tmp_path / "host.h5"))
    ok(job(4, *common, "--ps-device", "gpu", "--save", tmp_path / "dev.h5", env=stand_in, module="numpy_as_gpu"))
    host, _ = saved(tmp_path / "host.h5")
    dev, _ = saved(tmp_path / "dev.h5")
    assert all(np.array_equal(host[k], dev[k]) for k in host)
    ckpt = tmp_path / "ckpt"
    ok(job(4, *common[:-4], "--steps", 15, "--hidden", "64", "--ps-device", "gpu", "--checkpoint-dir", ckpt,
           env=stand_in, module="numpy_as_gpu"))
    ok(job(4, *common, "--ps-device", "gpu", "--checkpoint-dir", ckpt, "--save", tmp_path / "resumed.h5",
           env=stand_in, module="numpy_as_gpu"))
    resumed, _ = saved(tmp_path / "resumed.h5")
    assert all(np.array_equal(host[k], resumed[k]) for k in host)


@pytest.mark.parametrize("nap", [False, True])
def test_waits_some_and_all_complete_with_or_without_naps(nap):
    from mpi4py import MPI

    from hpctrain.comm.waits import Waits
    comm = MPI.COMM_SELF
    waits = Waits(nap)
    got = np.zeros(3, np.int64)
    recv = [comm.Irecv(got[i:i + 1], 0, 40 + i) for i in range(3)]
    sends = [comm.Isend(np.full(1, 7 + i, np.int64), 0, 40 + i) for i in (1, 2)]
    ready = set()
    while len(ready) < 2:
        ready |= set(waits.some(recv))
    assert ready == {1, 2} and list(got[1:]) == [8, 9]
    waits.all(sends)
    last = comm.Isend(np.full(1, 7, np.int64), 0, 40)
    waits.all([recv[0], last])
    assert waits.some(recv) is None and got[0] == 7   # nothing active any more


def test_ps_gpu_worker_path_equals_the_cpu_one_and_resumes(job, tmp_path):
    """GPU workers' wiring (the prefetcher, staged host mirrors of parameters
    and gradients; tests/staged_workers.py stages them through NaN-filled,
    lazy copies on NumPy, and MPI messages) gives the same bits as the CPU
    workers (shared-memory exchange), with packed slices (round-robin
    placement), also across a checkpoint and resume."""
    common = ["--mode", "ps", "--num-ps", 2, "--placement", "round-robin", "--steps", 30, "--hidden", "64,32"]
    stand_in = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}
    ok(job(4, *common, "--save", tmp_path / "host.h5"))
    ok(job(4, *common, "--save", tmp_path / "staged.h5", env=stand_in, module="staged_workers"))
    host, _ = saved(tmp_path / "host.h5")
    staged, _ = saved(tmp_path / "staged.h5")
    assert all(np.array_equal(host[k], staged[k]) for k in host)
    ckpt = tmp_path / "ckpt"
    half = [a if a != 30 else 15 for a in common]
    ok(job(4, *half, "--checkpoint-dir", ckpt, env=stand_in, module="staged_workers"))
    ok(job(4, *common, "--checkpoint-dir", ckpt, "--save", tmp_path / "resumed.h5", env=stand_in,
           module="staged_workers"))
    resumed, _ = saved(tmp_path / "resumed.h5")
    assert all(np.array_equal(host[k], resumed[k]) for k in host)


def test_the_protocol_self_check_on_one_rank_says_it_needs_two():
    """A raise with one line and exit 2, not an assert that python -O drops."""
    r = subprocess.run([sys.executable, "-O", "-m", "hpctrain.comm.ps"], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (2, "hpctrain: error: the ps self-check runs on at least 2 ranks, got 1\n")
