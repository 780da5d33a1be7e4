"""Scaling past one machine, on paper: fit the latency-bandwidth (alpha-beta)
model to allreduce and ps-exchange measurements made here, then predict step
time and scaling efficiency for 8-256 GPUs on a given network.

    python -m hpctrain.bench model --link-gbit 25 --compute-ms 50 --model-mb 100 [--alpha-us 10]

Models (S bytes of gradient, N workers, P parameter servers):
- ring allreduce: t = 2(N-1)*alpha + 2(N-1)/N * S * beta
  every link carries 2(N-1)/N of the gradient; latency grows with N.
- beta = 8 / (link rate x link efficiency): --link-efficiency 0.85 by default,
  measured for the ring on 4 simulated nodes over TCP (tests/cluster/bench.sh;
  a ring of 2 ranks reached only 0.64 there, MPI's own 0.48).
- parameter servers: t = 2*alpha + 2 * S * (N/P) * beta
  (each server's link carries the slice S/P of every worker's push and pull;
  with P = N that is 2*S*beta, the ring's bandwidth cost without its N-1 latency
  steps — BytePS's argument; with few servers the servers' links saturate).
Step time = compute + communication not hidden (with --overlap f, a fraction
f of the communication hides behind backprop); efficiency = compute / step.
"""
import json
import time

import numpy as np

from .common import is_rank, launch, parse_size, table


def ps_exchange_times(comm, sizes, iters=20):
    """Rank 0 plays one parameter server: every other rank pushes S bytes and
    pulls S bytes back (the ps exchange of one step), timed after a barrier."""
    from mpi4py import MPI
    out = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        buf = np.ones(n, np.float32)
        acc = np.zeros(n, np.float32) if comm.rank == 0 else None
        times = np.empty(iters)
        for i in range(iters + 2):
            comm.Barrier()
            t = time.perf_counter()
            if comm.rank == 0:
                for src in range(1, comm.size):
                    comm.Recv(buf, source=src, tag=1)
                    acc += buf
                reqs = [comm.Isend(acc, dest=d, tag=2) for d in range(1, comm.size)]
                MPI.Request.Waitall(reqs)
            else:
                comm.Send(buf, dest=0, tag=1)
                comm.Recv(buf, source=0, tag=2)
            if i >= 2:
                times[i - 2] = time.perf_counter() - t
        comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
        out.append((n * 4, float(np.median(times))))
    return out


def fit(xs, ys):
    """y = a*x0 + b*x1, a, b >= 0, least squares in relative error (so the
    small-message points, which set alpha, count as much as the large ones)."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    coef, *_ = np.linalg.lstsq(xs / ys[:, None], np.ones_like(ys), rcond=None)
    return [max(float(c), 0.0) for c in coef]


def measure(ranks, sizes="4K,64K,1M,4M,16M"):
    """alpha/beta for ring and ps from measurements at `ranks` ranks on this machine."""
    from .allreduce import measure as allreduce_measure
    from ..run.cluster import configure_process
    configure_process()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    sizes = [parse_size(s) for s in sizes.split(",")]
    rows = allreduce_measure(comm, sizes, min_time=0.2)
    n = comm.size
    ring_a, ring_b = fit([[2 * (n - 1), 2 * (n - 1) / n * r["bytes"]] for r in rows],
                         [r["ring_us"] * 1e-6 for r in rows])
    ps = ps_exchange_times(comm, sizes)
    w = n - 1
    ps_a, ps_b = fit([[2, 2 * s * w] for s, _ in ps], [t for _, t in ps])
    return {"ranks": n, "ring_alpha_s": ring_a, "ring_beta_s_per_byte": ring_b,
            "ps_alpha_s": ps_a, "ps_beta_s_per_byte": ps_b,
            "ring_points": [(r["bytes"], r["ring_us"] * 1e-6) for r in rows], "ps_points": ps}


def predict(n, s, alphas, beta, compute, overlap, ps_ratio):
    ring_alpha, ps_alpha = alphas
    ring = 2 * (n - 1) * ring_alpha + 2 * (n - 1) / n * s * beta
    p = max(1, int(round(n * ps_ratio)))
    ps = 2 * ps_alpha + 2 * s * (n / p) * beta
    out = {"gpus": n, "servers": p, "ring_comm_ms": ring * 1e3, "ps_comm_ms": ps * 1e3}
    for name, t in (("ring", ring), ("ps", ps)):
        step = compute + (1 - overlap) * t if (1 - overlap) * t > 0 else compute
        step = max(step, t)  # communication can hide, but not below its own time
        out[f"{name}_step_ms"] = step * 1e3
        out[f"{name}_eff"] = compute / step
    out["winner"] = "ring" if out["ring_step_ms"] <= out["ps_step_ms"] else "ps"
    return out


def main(args):
    if not is_rank():
        r = launch(args.ranks, ["-m", "hpctrain.bench", *args.argv])
        print(r.stdout, end="")
        if r.returncode:
            print(r.stderr[-2000:])
        return r.returncode
    fitted = measure(args.ranks, args.sizes)
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank != 0:
        return 0
    # The network to predict for: beta from its link speed; alpha as given, or
    # the per-step latency fitted here (hpctrain's own software overhead).
    if args.alpha_us is None:
        alphas = (fitted["ring_alpha_s"], fitted["ps_alpha_s"])
    else:
        alphas = (args.alpha_us * 1e-6, args.alpha_us * 1e-6)
    # Links never carry their nominal rate: calibrated against hpctrain's ring
    # across simulated nodes over TCP (tests/cluster/bench.sh), 4 nodes: 0.82-0.87.
    beta = 8 / (args.link_gbit * 1e9 * args.link_efficiency)
    s = args.model_mb * 2**20
    compute = args.compute_ms * 1e-3
    rows = [predict(n, s, alphas, beta, compute, args.overlap, args.ps_ratio) for n in (8, 16, 32, 64, 128, 256)]
    if args.json:
        print(json.dumps({"bench": "model", "fitted_here": fitted, "predicted": rows}))
        return 0
    f = fitted
    print(f"fitted on this machine ({f['ranks']} ranks, shared memory):")
    print(f"  ring: alpha {f['ring_alpha_s'] * 1e6:.2f} us, beta {f['ring_beta_s_per_byte'] * 1e9:.3f} ns/byte "
          f"(= {1 / max(f['ring_beta_s_per_byte'], 1e-15) / 1e9:.2f} GB/s per link)")
    print(f"  ps:   alpha {f['ps_alpha_s'] * 1e6:.2f} us, beta {f['ps_beta_s_per_byte'] * 1e9:.3f} ns/byte "
          f"(= {1 / max(f['ps_beta_s_per_byte'], 1e-15) / 1e9:.2f} GB/s at the server)")
    print(f"predicted for {args.model_mb:g} MB of gradients, {args.compute_ms:g} ms compute per step, "
          f"{args.link_gbit:g} Gbit/s links at {args.link_efficiency:g} efficiency, alpha ring {alphas[0] * 1e6:.1f} us / ps {alphas[1] * 1e6:.1f} us, "
          f"overlap {args.overlap:g}, "
          f"ps servers = {args.ps_ratio:g} x workers:")
    print(table(rows, [("GPUs", "gpus", "{}"), ("servers", "servers", "{}"),
                       ("ring comm ms", "ring_comm_ms", "{:.1f}"), ("ps comm ms", "ps_comm_ms", "{:.1f}"),
                       ("ring step ms", "ring_step_ms", "{:.1f}"), ("ps step ms", "ps_step_ms", "{:.1f}"),
                       ("ring eff", "ring_eff", "{:.2f}"), ("ps eff", "ps_eff", "{:.2f}"),
                       ("faster", "winner", "{}")]))
    return 0
