"""The node-aware allreduce (comm/hier.py, --ring-order, --allreduce auto) on
fake nodes: a real MPI split of COMM_WORLD given to Topology as its nodes, so
the multi-node code runs as on a cluster, on one machine.

    mpirun -n 4 python -m mpi4py -m pytest --only-mpi tests/test_hier.py   # also -n 2, 3
    python -m pytest -q tests/test_hier.py                                  # the training jobs

Splits are functions of (rank, size), so every test passes at any world size:
"blocks of 2" is one node of 2 at 2 ranks, 2+1 at 3 (unequal: the ring
instead), 2x2 at 4; "one per node" is Nx1 (2x1 at 2 ranks); "round-robin"
puts rank r on node r % 2 (a cyclic launcher placement; 2x2 at 4 ranks);
"1+rest" is 1+2 at 3 ranks (unequal: the ring instead).
"""
import numpy as np
import pytest
from mpi4py import MPI

import test_shard_optimizer as shard_tests
from gpu_fakes import LazyCopier
from hpctrain.base import device
from hpctrain.comm import choose, make_allreduce
from hpctrain.comm.device_buffers import BoundToDevice
from hpctrain.comm.hier import HierAllreduce
from hpctrain.comm.mpi import MpiAllreduce
from hpctrain.comm.ring_allreduce import SEGMENT_BYTES, RingAllreduce
from hpctrain.comm.staged import StagedAllreduce
from hpctrain.comm.topology import Topology

SPLITS = {
    "blocks of 2": lambda rank, size: rank // 2,
    "one per node": lambda rank, size: rank,
    "round-robin": lambda rank, size: rank % 2,
    "1+rest": lambda rank, size: min(rank, 1),
}


def fake_topology(split, comm=MPI.COMM_WORLD):
    node = SPLITS[split](comm.rank, comm.size)
    return Topology(comm, node_comm=comm.Split(node, comm.rank))


def lengths(size):
    return sorted({0, 1, max(size - 1, 0), size + 1, 7, 2 * size + 1, 1001, SEGMENT_BYTES // 4 * size + 5})


def same_everywhere(comm, x):
    first = x.copy()
    comm.Bcast(first, root=0)
    return np.array_equal(x, first)


# --- hier against MPI and the flat ring ----------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("split", list(SPLITS))
def test_hier_equals_mpi_and_the_ring_on_random_data(split):
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    with fake_topology(split) as topology:
        hier = make_allreduce("hier", topology, np)
        algo, why = choose("hier", topology)
    # Unequal nodes: the node-ordered ring, and the line says so.
    assert type(hier) is (HierAllreduce if topology.equal_nodes else RingAllreduce)
    assert (algo == "hier") == topology.equal_nodes and why == hier.choice
    if not topology.equal_nodes:
        assert "equal ranks per node" in why and "node order" in why
    ring, mpi = RingAllreduce(comm), MpiAllreduce(comm)
    for n in lengths(comm.size):
        x = rng.standard_normal(n).astype(np.float32)
        a, b, c, again = x.copy(), x.copy(), x.copy(), x.copy()
        hier.allreduce(a)
        mpi.allreduce(b)
        ring.allreduce(c)
        hier.allreduce(again)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)
        assert np.array_equal(a, again), n          # bit-identical run to run
        assert same_everywhere(comm, a), n
    for s in (hier, ring, mpi):
        s.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("split", ["blocks of 2", "one per node", "round-robin"])
def test_hier_reduce_scatter_owns_disjoint_covering_summed_parts(split):
    comm = MPI.COMM_WORLD
    size, rank = comm.size, comm.rank
    with fake_topology(split) as topology:
        if not topology.equal_nodes:
            pytest.skip("unequal nodes at this size: hier is the ring (tested above)")
        hier = HierAllreduce(topology)
    for n in lengths(size):
        # integer-valued floats: every summation order gives the same bits
        mine = (rank * 1000 + np.arange(n) % 97).astype(np.float32)
        want = (1000 * sum(range(size)) + size * (np.arange(n) % 97)).astype(np.float32)
        buf = mine.copy()
        lo, hi = hier.reduce_scatter(buf)
        assert (lo, hi) == hier.shard(n) and np.array_equal(buf[lo:hi], want[lo:hi]), (n, lo, hi)
        parts = np.empty((size, 2), np.int64)
        comm.Allgather(np.array([lo, hi], np.int64), parts)
        tiles = sorted(map(tuple, parts.tolist()))
        assert tiles[0][0] == 0 and tiles[-1][1] == n, (n, tiles)
        assert all(tiles[i][1] == tiles[i + 1][0] for i in range(size - 1)), (n, tiles)
        # allgather alone: only the owned part written, everyone gets everything
        gathered = np.full(n, -1.0, np.float32)
        gathered[lo:hi] = want[lo:hi]
        hier.allgather(gathered)
        hier.allgather(buf)
        assert np.array_equal(gathered, want) and np.array_equal(buf, want), n
    hier.free()


# --- the node-ordered ring ---------------------------------------------------------

class RecordingWatchdog:
    def __init__(self):
        self.peers = set()

    def waiting(self, what, peer=None):
        from contextlib import nullcontext
        self.peers.add((what, tuple(peer) if isinstance(peer, list) else peer))
        return nullcontext()


@pytest.mark.mpi(min_size=2)
def test_node_ordered_ring_on_round_robin_nodes_equals_the_rank_ordered_ring():
    comm = MPI.COMM_WORLD
    size, rank = comm.size, comm.rank
    dog = RecordingWatchdog()
    with fake_topology("round-robin") as topology:
        by_node = make_allreduce("ring", topology, np, watchdog=dog, ring_order="node")
        by_rank = make_allreduce("ring", topology, np, ring_order="rank")
        order = topology.by_node()
    assert order == [r for r in range(size) if r % 2 == 0] + [r for r in range(size) if r % 2 == 1]
    assert by_node.world_ranks == order and by_rank.world_ranks == list(range(size))
    x = np.random.default_rng(rank).standard_normal(SEGMENT_BYTES // 4 * size + 5).astype(np.float32)
    a, b = x.copy(), x.copy()
    by_node.allreduce(a)
    by_rank.allreduce(b)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert same_everywhere(comm, a)
    # The watchdog's line names the neighbours as world ranks, not ring positions.
    at = order.index(rank)
    neighbours = tuple(sorted({order[(at - 1) % size], order[(at + 1) % size]}))
    assert dog.peers == {("ring allreduce", neighbours)}
    by_node.free()
    by_rank.free()


@pytest.mark.mpi(min_size=1)
def test_on_one_node_auto_is_todays_ring_in_rank_order():
    comm = MPI.COMM_WORLD
    with Topology(comm, node_comm=comm.Split(0, comm.rank)) as topology:
        auto = make_allreduce("auto", topology, np)
        hier = make_allreduce("hier", topology, np)
    assert type(auto) is RingAllreduce and auto.world_ranks == list(range(comm.size))
    assert auto.choice == f"auto: {comm.size} rank{'s' if comm.size > 1 else ''} on one node"
    x = np.random.default_rng(comm.rank).standard_normal(1001).astype(np.float32)
    a, b, c = x.copy(), x.copy(), x.copy()
    auto.allreduce(a)
    hier.allreduce(b)
    RingAllreduce(comm).allreduce(c)
    assert np.array_equal(a, c) and np.array_equal(b, c)   # bit for bit, hier included
    auto.free()
    hier.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("split", list(SPLITS))
def test_auto_picks_by_topology_and_says_why(split):
    with fake_topology(split) as topology:
        strategy = make_allreduce("auto", topology, np)
        nodes, equal = topology.num_nodes, topology.equal_nodes
    want = RingAllreduce if nodes == 1 or not equal else HierAllreduce
    assert type(strategy) is want and strategy.choice.startswith("auto: ")
    assert (f"on {nodes} nodes" in strategy.choice) == (nodes > 1)
    strategy.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("split", list(SPLITS))
def test_napping_waits_reach_both_of_hiers_rings_and_change_no_bit(split, monkeypatch):
    """hpctrain.dist's strategy where ranks outnumber cores (`auto` with its
    napping waits: hier across nodes) against the program's (MPI's blocking
    Sendrecv): the same bits, one chunk and several segments, and every ring
    exchange naps: 2(L-1) inside the node and 2(M-1) across nodes."""
    from hpctrain.comm.waits import Waits
    comm = MPI.COMM_WORLD
    with fake_topology(split) as topology:
        spin = make_allreduce("auto", topology, np)
        nap = make_allreduce("auto", topology, np, waits=Waits(nap=True))
        hier, nodes, local = topology.equal_nodes, topology.num_nodes, topology.local_size
    assert type(nap) is (HierAllreduce if hier and nodes > 1 else RingAllreduce)
    for n in (5, SEGMENT_BYTES // 4 * comm.size * 3 + 7):
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        a, b = spin.allreduce(x.copy()), nap.allreduce(x.copy())
        assert np.array_equal(a, b) and not np.array_equal(a, x)
    naps, napped = Waits._naps, []
    monkeypatch.setattr(Waits, "_naps", staticmethod(lambda: napped.append(1) or naps()))
    nap.allreduce(np.ones(5, np.float32))
    exchanges = 2 * (local - 1) + 2 * (nodes - 1) if hier and nodes > 1 else 2 * (comm.size - 1)
    assert len(napped) == exchanges
    spin.allreduce(np.ones(5, np.float32))
    assert len(napped) == exchanges   # the program's rings never nap
    spin.free()
    nap.free()


# --- device buffers, and the sharded optimizer -------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch):
    class FakeXp:
        __name__ = "fakecupy"
    monkeypatch.setattr(device, "is_gpu", lambda xp: xp is not np)
    monkeypatch.setattr(device, "copier", lambda xp: LazyCopier())
    monkeypatch.setattr(device, "current_device", lambda xp: None if xp is np else 0)
    monkeypatch.setattr(device, "use_device", lambda xp, device_id: None)
    return FakeXp()


@pytest.mark.mpi(min_size=2)
def test_hier_on_device_buffers_is_wrapped_like_the_ring(fake_gpu):
    comm = MPI.COMM_WORLD
    size, rank = comm.size, comm.rank
    with fake_topology("one per node") as topology:
        staged = make_allreduce("hier", topology, fake_gpu, cuda_aware="no")
        direct = make_allreduce("hier", topology, fake_gpu, cuda_aware="yes")
    assert isinstance(staged, BoundToDevice) and isinstance(staged.inner, StagedAllreduce)
    assert isinstance(staged.inner.inner, HierAllreduce)
    assert isinstance(direct, BoundToDevice) and isinstance(direct.inner, HierAllreduce)
    for strategy in (staged, direct):
        x = np.full(1001, rank, np.float32)
        strategy.allreduce(x)
        assert np.all(x == sum(range(size)))
        y = np.full(1001, rank, np.float32)
        lo, hi = strategy.reduce_scatter(y)
        assert (lo, hi) == strategy.shard(1001) and np.all(y[lo:hi] == sum(range(size)))
        strategy.allgather(y)
        assert np.array_equal(x, y)


def hier_on_fake_nodes(comm):
    """Two ranks per node where the size allows it, else one per node."""
    node = comm.rank // 2 if comm.size % 2 == 0 else comm.rank
    with Topology(comm, node_comm=comm.Split(node, comm.rank)) as topology:
        return HierAllreduce(topology)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("fusion_elems, overlap", [(0, False), (300, True)])
def test_sharded_optimizer_on_hier_is_bit_identical_to_unsharded_hier(monkeypatch, optimizer,
                                                                       fusion_elems, overlap):
    comm = MPI.COMM_WORLD
    monkeypatch.setitem(shard_tests.STRATEGIES, "hier", hier_on_fake_nodes)
    plain, plain_losses, plain_stops, _ = shard_tests.run_steps(comm, "hier", optimizer, False,
                                                                fusion_elems, overlap)
    shard, losses, stops, opt = shard_tests.run_steps(comm, "hier", optimizer, True, fusion_elems, overlap)
    assert np.array_equal(plain, shard) and same_everywhere(comm, shard)
    assert losses == plain_losses == [float(sum(r + 1 + s for r in range(comm.size))) for s in range(4)]
    assert stops == plain_stops == [False, False, True, False]
    owned = np.array([opt.size], np.int64)
    comm.Allreduce(MPI.IN_PLACE, owned)
    assert owned[0] == opt.full_size


# --- training jobs (one node: hier is the node's ring, the flat ring bit for bit) --

def test_one_node_hier_auto_and_both_ring_orders_train_to_identical_parameters(job, tmp_path):
    common = ["--steps", "10", "--log-every", "5", "--batch-size", "16", "--hidden", "37,19",
              "--timeout", "60"]
    runs = {"ring node": ["--allreduce", "ring"], "ring rank": ["--allreduce", "ring", "--ring-order", "rank"],
            "hier": ["--allreduce", "hier"], "auto": [],
            "hier sharded": ["--allreduce", "hier", "--shard-optimizer", "on"]}
    out = {}
    for name, flags in runs.items():
        path = tmp_path / f"{name.replace(' ', '-')}.h5"
        r = job(4, *common, *flags, "--save", path, timeout=120)
        assert r.returncode == 0, r.stderr
        out[name] = shard_tests.params(path)
        if name == "hier":
            assert "hpctrain: allreduce hier (4 ranks on one node: the node's ring" in r.stdout, r.stdout
        if name == "auto":
            assert "hpctrain: allreduce ring (auto: 4 ranks on one node)" in r.stdout, r.stdout
    for name in runs:
        assert sorted(out[name]) == sorted(out["ring node"])
        for k in out[name]:
            assert np.array_equal(out[name][k], out["ring node"][k]), (name, k)
