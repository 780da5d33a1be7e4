"""Which ranks are the parameter servers (--ps-ranks first|spread).

    .venv/bin/python -m pytest tests/test_ps_ranks.py                 # serial + jobs
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_ps_ranks.py

- serial: the rule itself, `cluster.server_ranks(node_of, num_ps, rule)`, on
  node layouts that one machine cannot have (block, round-robin, 3 nodes,
  unequal nodes);
- MPI: a Cluster built with an explicit server list gets every role and
  index from that list (servers need not be the first ranks);
- jobs (plain pass): on one node `first` and `spread` are one layout, bit
  for bit; servers at world ranks [1, 3] of 4 train sync ps to the same
  parameters as servers at [0, 1] (tests/ps_servers_at.py puts them there),
  and a checkpoint written with one layout resumes under the other.
"""
import json
import os

import numpy as np
import pytest

from conftest import checkpoint_path, copy_checkpoint
from hpctrain.run.cluster import PS_RULES, server_ranks

# ---------------------------------------------------------------------------
# serial: the rule


@pytest.mark.parametrize("node_of, num_ps, spread", [
    ([0, 0, 0, 0], 1, [0]),                       # one node: ranks 0..K-1, today's rule
    ([0, 0, 0, 0], 2, [0, 1]),
    ([0, 0, 0, 0], 3, [0, 1, 2]),
    ([0, 0, 1, 1], 1, [0]),                       # block placement, 2 nodes x 2
    ([0, 0, 1, 1], 2, [0, 2]),
    ([0, 0, 1, 1], 3, [0, 1, 2]),
    ([0, 1, 0, 1], 2, [0, 1]),                    # round-robin (srun --distribution=cyclic)
    ([0, 1, 0, 1], 3, [0, 1, 2]),
    ([0, 0, 1, 1, 2, 2], 2, [0, 2]),              # 3 nodes
    ([0, 0, 1, 1, 2, 2], 3, [0, 2, 4]),
    ([0, 0, 1, 1, 2, 2], 4, [0, 1, 2, 4]),
    ([0, 0, 0, 1], 2, [0, 3]),                    # unequal nodes: 3 + 1
    ([0, 0, 0, 1], 3, [0, 1, 3]),                 # node 1 is all server: node 0 takes the next
    ([0, 1, 1, 1], 3, [0, 1, 2]),                 # 1 + 3: node 0 full after one, node 1 gives two
    ([0, 0, 0, 1, 1, 2], 3, [0, 3, 5]),           # 3 + 2 + 1
    ([0, 0, 0, 1, 1, 2], 5, [0, 1, 3, 4, 5]),
])
def test_spread_deals_servers_over_nodes(node_of, num_ps, spread):
    assert server_ranks(node_of, num_ps, "spread") == spread
    assert server_ranks(node_of, num_ps, "first") == list(range(num_ps))


def test_spread_is_first_on_one_node_and_balanced_on_many():
    rng = np.random.default_rng(0)
    for _ in range(300):
        sizes = rng.integers(1, 5, rng.integers(1, 5))
        node_of = [n for n, s in enumerate(sizes) for _ in range(s)]
        if rng.random() < 0.5:   # the same nodes, ranks dealt in another order
            node_of = [int(n) for n in rng.permutation(node_of)]
            first = {}
            node_of = [first.setdefault(n, len(first)) for n in node_of]   # numbered by their lowest rank
        for num_ps in range(1, len(node_of)):
            got = server_ranks(node_of, num_ps, "spread")
            assert got == sorted(set(got)) and len(got) == num_ps
            if len(sizes) == 1:
                assert got == list(range(num_ps))
            per_node = [sum(node_of[r] == n for r in got) for n in range(len(sizes))]
            # A node gets fewer than its share only when it has no rank left.
            share = num_ps // len(sizes)
            assert all(c >= min(share, int(s)) for c, s in zip(per_node, np.bincount(node_of))), (node_of, got)
            # Within a node, the lowest ranks serve.
            for n in range(len(sizes)):
                mine = [r for r in range(len(node_of)) if node_of[r] == n]
                assert [r for r in got if node_of[r] == n] == mine[:per_node[n]]


def test_more_servers_than_ranks_and_an_unknown_rule():
    assert server_ranks([0, 1], 5, "spread") == [0, 1]   # cli.validate refuses this right after
    assert server_ranks([0, 1], 5, "first") == [0, 1]
    with pytest.raises(ValueError, match="unknown --ps-ranks rule 'last'"):
        server_ranks([0], 1, "last")


# ---------------------------------------------------------------------------
# MPI: a Cluster with servers on other ranks than the first


def free(c):
    from mpi4py import MPI
    if c.worker_comm != MPI.COMM_NULL:
        c.worker_comm.Free()
    c.local_comm.Free()


@pytest.mark.mpi(min_size=2)
def test_roles_follow_the_server_list(monkeypatch):
    from mpi4py import MPI
    from hpctrain.run import cluster
    from hpctrain.run.cluster import Cluster
    from ps_servers_at import servers_at
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    servers = list(range(1, size, 2))                 # 2: [1]; 3: [1]; 4: [1, 3]
    workers = [r for r in range(size) if r not in servers]
    monkeypatch.setattr(cluster, "server_ranks", servers_at(servers))
    c = Cluster(world, "ps", len(servers))
    assert (c.ps_ranks, c.worker_ranks, c.num_workers) == (servers, workers, len(workers))
    assert c.chief_rank == 0 and c.is_chief == (rank == 0)
    assert c.is_ps == (rank in servers) and c.is_worker == (rank in workers)
    if c.is_ps:
        assert c.ps_index == servers.index(rank) and c.worker_index is None
        assert c.worker_comm == MPI.COMM_NULL
    else:
        # The workers' communicator is in worker order: its rank 0 is the chief.
        assert c.worker_index == workers.index(rank) == c.worker_comm.Get_rank() and c.ps_index is None
    assert [c.role_name(r) for r in servers] == [f"/job:ps/task:{k}" for k in range(len(servers))]
    assert [c.role_name(r) for r in workers] == [f"/job:worker/task:{w}" for w in range(len(workers))]
    assert c.servers_line().endswith(f"/job:ps/task:{len(servers) - 1} = rank {servers[-1]} on {c.hosts[servers[-1]]}")
    free(c)
    monkeypatch.setattr(cluster, "server_ranks", servers_at([size]))
    with pytest.raises(ValueError, match="distinct, sorted"):
        Cluster(world, "ps", 1)
    monkeypatch.undo()
    for rule in PS_RULES:
        c = Cluster(world, "ps", 1, rule)
        assert c.ps_ranks == server_ranks(c.node_of, 1, rule) and c.ps_ranks == [0]   # rank 0 leads node 0
        assert c.num_nodes == len(set(c.node_of)) and len(c.hosts) == size
        free(c)


# ---------------------------------------------------------------------------
# jobs

TESTS = os.path.dirname(os.path.abspath(__file__))
COMMON = ["--mode", "ps", "--num-ps", "2", "--sync", "--steps", "24", "--log-every", "12", "--batch-size", "16",
          "--hidden", "32", "--timeout", "120"]


def servers_at(ranks):
    """job() keywords that put the servers at these world ranks (tests/ps_servers_at.py)."""
    return {"module": "ps_servers_at", "env": {"PYTHONPATH": TESTS, "PS_SERVERS": ",".join(map(str, ranks))}}


def run(job, out, *flags, **kw):
    out.mkdir(parents=True, exist_ok=True)
    r = job(4, *COMMON, *flags, "--save", out / "p.h5", "--metrics", out / "m.jsonl", **kw)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def result(out):
    import h5py
    with h5py.File(out / "p.h5", "r") as f:
        params = {f"{g}/{k}": f[g][k][()] for g in f for k in f[g]}
    final = json.loads((out / "m.jsonl").read_text().splitlines()[-1])
    return params, final


def assert_same(a, b):
    (pa, fa), (pb, fb) = a, b
    assert sorted(pa) == sorted(pb)
    for k in pa:
        assert np.array_equal(pa[k], pb[k]), k
    for k in ("steps", "test_accuracy", "test_loss"):
        assert fa[k] == fb[k], k


def test_first_and_spread_are_one_layout_on_one_node(job, tmp_path):
    first = run(job, tmp_path / "first", "--ps-ranks", "first")
    spread = run(job, tmp_path / "spread")   # the default
    assert_same(result(tmp_path / "first"), result(tmp_path / "spread"))
    for r, rule in ((first, "first"), (spread, "spread")):
        assert f"ps servers (--ps-ranks {rule}, 1 node): /job:ps/task:0 = rank 0 on " in r.stdout, r.stdout
        assert ", /job:ps/task:1 = rank 1 on " in r.stdout
    final = result(tmp_path / "spread")[1]
    assert final["ps_ranks"] == "spread" and final["server_ranks"] == [0, 1]


def test_servers_on_later_ranks_train_the_same_and_checkpoints_move_between_layouts(job, tmp_path):
    ckpt = ["--checkpoint-every", "8"]
    run(job, tmp_path / "first", "--ps-ranks", "first", "--checkpoint-dir", tmp_path / "first" / "ckpt", *ckpt)
    r = run(job, tmp_path / "later", "--checkpoint-dir", tmp_path / "later" / "ckpt", *ckpt, **servers_at([1, 3]))
    out = r.stdout
    assert "/job:ps/task:0 = rank 1 on " in out and "/job:ps/task:1 = rank 3 on " in out, out
    assert "/job:worker/task:0 = rank 0  (chief)" in out and "/job:worker/task:1 = rank 2\n" in out, out
    baseline = result(tmp_path / "first")
    assert result(tmp_path / "later")[1]["server_ranks"] == [1, 3]
    assert_same(baseline, result(tmp_path / "later"))
    # A checkpoint holds full flat arrays; which slice a server gets is its
    # ps task index's (placement), not its rank's: step 8 of either layout
    # resumes under the other and ends where the uninterrupted run ends.
    for written, resumed, kw in (("first", "b", servers_at([1, 3])), ("later", "a", {})):
        where = tmp_path / resumed / "ckpt"
        where.mkdir(parents=True)
        copy_checkpoint(checkpoint_path(tmp_path / written / "ckpt", 8), where)
        r = run(job, tmp_path / resumed, "--checkpoint-dir", where, *ckpt, "--ps-ranks", "first", **kw)
        assert "at step 8" in r.stdout, r.stdout
        assert_same(baseline, result(tmp_path / resumed))
