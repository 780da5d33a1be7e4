"""Allreduce algorithms side by side, in one run: hpctrain's ring (in node
order, and in rank order), the hierarchical allreduce, MPI's native one.

    python -m hpctrain.bench allreduce --ranks 2          # launches mpirun -n 2 itself
    mpirun -n 4 python -m hpctrain.bench allreduce        # or run it under your launcher
    python -m hpctrain.bench allreduce --ranks 2 --plot busbw.png   # and a picture (hpctrain.plot)
    HPCTRAIN_MPIRUN_ARGS="-hosts n1:2,n2:2" python -m hpctrain.bench allreduce --ranks 4 \\
        --algorithms ring,ring-rank,hier,mpi --link-gbit 1    # several nodes: bytes per link too

For each size, the algorithms alternate (so machine noise hits all alike),
each iteration starts after a barrier, and an iteration's time is the slowest
rank's. Reported: median time, algbw = S/t and busbw = algbw * 2(N-1)/N (the
nccl-tests definitions, so busbw is comparable across rank counts).

With --link-gbit R, each algorithm then runs again on its own, and the
lowest rank of every node reads the node's network byte counters
(/sys/class/net/*/statistics, loopback left out) around it: `link MB` is the
most any node sent per allreduce, `must MB` what the algorithm has to send
out of a node (ring: 2(N-1)/N of the buffer from every rank whose right
neighbour is on another node; hier: 2(M-1)/M of it for M nodes; MPI's: not
known), and link efficiency = must bytes / (time x R). On one node nothing
crosses a link and both are 0.
"""
import json
import os
import sys
import time

import numpy as np

from .common import is_rank, launch, parse_size, table

# name on the command line -> (strategy, ring order)
ALGORITHMS = {"ring": ("ring", "node"), "ring-rank": ("ring", "rank"), "hier": ("hier", "node"),
              "mpi": ("mpi", "node")}


def key(name):
    return name.replace("-", "_")


def node_bytes_out():
    """Bytes this node has sent on its network interfaces (loopback left out)."""
    total = 0
    for iface in os.listdir("/sys/class/net"):
        if iface == "lo":
            continue
        try:
            with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
                total += int(f.read())
        except OSError:
            pass
    return total


def must_send(name, topology, nbytes):
    """Bytes the algorithm has to send out of the busiest node per allreduce
    of nbytes (None where the algorithm is not ours to know)."""
    n, m = topology.size, topology.num_nodes
    if m == 1:
        return 0.0
    if name == "hier":
        return 2 * (m - 1) / m * nbytes
    if name in ("ring", "ring-rank"):
        order = topology.by_node() if ALGORITHMS[name][1] == "node" else list(range(n))
        crossing = [0] * m
        for i, r in enumerate(order):
            if topology.node_of[r] != topology.node_of[order[(i + 1) % n]]:
                crossing[topology.node_of[r]] += 1
        return max(crossing) * 2 * (n - 1) / n * nbytes
    return None


def _slowest(comm, values):
    from mpi4py import MPI
    values = np.asarray(values, np.float64)
    comm.Allreduce(MPI.IN_PLACE, values, op=MPI.MAX)
    return values


def measure(comm, sizes, device="cpu", min_time=0.3, max_iters=200, algorithms=("ring", "mpi"),
            link_gbit=None):
    from ..comm import make_allreduce
    from ..comm.topology import Topology
    from ..base import device as dev
    xp, _, _ = dev.select(device)
    topology = Topology(comm)
    strategies = {name: make_allreduce(ALGORITHMS[name][0], topology, xp, ring_order=ALGORITHMS[name][1])
                  for name in algorithms}
    size, rows = comm.Get_size(), []
    first = algorithms[0]
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        buf = xp.ones(n, np.float32)
        for strategy in strategies.values():  # warm-up: connections, scratch buffers
            strategy.allreduce(buf)
        # iterations: enough for ~min_time per algorithm, decided on rank 0
        t0 = time.perf_counter()
        strategies[first].allreduce(buf)
        est = np.array([time.perf_counter() - t0])
        comm.Bcast(est, root=0)
        iters = int(min(max_iters, max(5, min_time / max(est[0], 1e-6))))
        times = {name: np.empty(iters) for name in strategies}
        for i in range(iters):
            for name, strategy in strategies.items():
                buf.fill(1.0)
                dev.synchronize(xp)
                comm.Barrier()
                t = time.perf_counter()
                strategy.allreduce(buf)
                dev.synchronize(xp)
                times[name][i] = time.perf_counter() - t
        row = {"bytes": n * 4, "ranks": size, "nodes": topology.num_nodes, "iters": iters}
        for name, t in times.items():
            med = float(np.median(_slowest(comm, t)))
            row[f"{key(name)}_us"] = med * 1e6
            row[f"{key(name)}_busbw"] = n * 4 / med / 1e9 * 2 * (size - 1) / size
        # busbw ratios as time ratios (the same bytes): defined on 1 rank too, where busbw is 0
        if "ring" in strategies and "mpi" in strategies:
            row["ratio_busbw"] = row["mpi_us"] / row["ring_us"]
            row["ratio_latency"] = row["ring_us"] / row["mpi_us"]
        for name in algorithms[1:]:
            row[f"{key(name)}_vs_{key(first)}"] = row[f"{key(first)}_us"] / row[f"{key(name)}_us"]
        if link_gbit:
            for name, strategy in strategies.items():
                row.update(_link_pass(comm, topology, name, strategy, buf, min(iters, 20), link_gbit, xp, dev))
        rows.append(row)
    topology.free()
    return rows


def _link_pass(comm, topology, name, strategy, buf, iters, link_gbit, xp, dev):
    """One algorithm alone for `iters` allreduces: bytes out of the busiest
    node per allreduce, what it must send, and the link efficiency."""
    comm.Barrier()
    before = node_bytes_out() if topology.is_leader else 0
    times = np.empty(iters)
    for i in range(iters):
        dev.synchronize(xp)
        comm.Barrier()
        t = time.perf_counter()
        strategy.allreduce(buf)
        dev.synchronize(xp)
        times[i] = time.perf_counter() - t
    comm.Barrier()
    sent = (node_bytes_out() - before) / iters if topology.is_leader else 0.0
    sent = float(_slowest(comm, [sent])[0])
    med = float(np.median(_slowest(comm, times)))
    must = must_send(name, topology, buf.size * 4)
    k = key(name)
    return {f"{k}_link_mb": sent / 1e6, f"{k}_must_mb": None if must is None else must / 1e6,
            f"{k}_link_eff": None if not must else must / (med * link_gbit * 1e9 / 8)}


def columns(algorithms, link_gbit):
    cols = [("bytes", "bytes", "{:,}")]
    cols += [(f"{a} us", f"{key(a)}_us", "{:,.1f}") for a in algorithms]
    cols += [(f"{a} busbw GB/s", f"{key(a)}_busbw", "{:.3f}") for a in algorithms]
    cols += [(f"{a}/{algorithms[0]}", f"{key(a)}_vs_{key(algorithms[0])}", "{:.2f}") for a in algorithms[1:]]
    if link_gbit:
        for a in algorithms:
            cols += [(f"{a} link MB", f"{key(a)}_link_mb", "{:.2f}"), (f"{a} must MB", f"{key(a)}_must_mb", "{:.2f}"),
                     (f"{a} link eff", f"{key(a)}_link_eff", "{:.2f}")]
    return cols


def main(args):
    algorithms = tuple(a.strip() for a in args.algorithms.split(",") if a.strip())
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown or not algorithms:
        print(f"hpctrain: error: --algorithms: unknown {', '.join(unknown) or '(none given)'} "
              f"(choose from {', '.join(ALGORITHMS)})", file=sys.stderr)
        return 2
    if not is_rank():
        r = launch(args.ranks, ["-m", "hpctrain.bench", *args.argv])
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        return r.returncode
    from ..run.cluster import configure_process
    configure_process()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rows = measure(comm, [parse_size(s) for s in args.sizes.split(",")], args.device,
                   algorithms=algorithms, link_gbit=args.link_gbit)
    if comm.rank == 0:
        result = {"bench": "allreduce", "ranks": comm.size, "nodes": rows[0]["nodes"] if rows else 1,
                  "device": args.device, "algorithms": list(algorithms), "link_gbit": args.link_gbit, "rows": rows}
        if args.json:
            print(json.dumps(result))
        else:
            nodes = rows[0]["nodes"] if rows else 1
            print(f"allreduce, {comm.size} ranks on {nodes} node{'s' if nodes > 1 else ''}, float32, {args.device}: "
                  f"median of the slowest rank per iteration"
                  + (f"; links {args.link_gbit:g} Gbit/s" if args.link_gbit else ""))
            print(table(rows, columns(algorithms, args.link_gbit)))
        if args.plot:
            from ..plot import plot_allreduce
            plot_allreduce(result, args.plot)
            print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
