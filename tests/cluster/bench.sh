#!/usr/bin/env bash
# bench.sh [RATE] -- hpctrain's benchmarks across simulated nodes (docs/clusters.md):
#   1. bench allreduce, 2 nodes x 2 ranks, block and round-robin placement:
#      ring (node order), ring-rank (rank order), hier, mpi; busbw, bytes per
#      link against what each algorithm must send, link efficiency
#   2. bench train, same layouts: samples/s and the step split for each algorithm
#   3. the alpha-beta model against the ring at 2 and 4 nodes x 1 rank
# Links between nodes are shaped to RATE (default 1gbit) with TBF (shape.sh).
# Needs root; brings up its own 5 nodes (hpt-n0 login, hpt-n1..4) and takes
# them down at the end. Run from the repository root after `make test-serial`.
# About 10 minutes on 2 cores. Env: BENCH_SIZES, BENCH_STEPS, BENCH_REPEATS.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
rate=${1:-1gbit}
gbit=$(python3 -c "import re,sys; v,u=re.fullmatch(r'([0-9.]+)(g|m|k)?bit','$rate').groups(); print(float(v)*{'g':1,'m':1e-3,'k':1e-6,None:1e-9}[u])")
PY=${HPCTRAIN_PYTHON:-$repo/.venv/bin/python}
sizes=${BENCH_SIZES:-1M,4M,16M,64M}
steps=${BENCH_STEPS:-300}
repeats=${BENCH_REPEATS:-2}
cd "$repo"
trap '"$here/shape.sh" off >/dev/null 2>&1 || true; "$here/netns.sh" down >/dev/null' EXIT
"$here/netns.sh" up 5
"$here/shape.sh" "$rate"
on() {  # on HOSTS CMD...: CMD on the login node, its mpirun ranks on HOSTS
    local hosts=$1; shift
    "$here/on.sh" hpt-n0 env PYTHONPATH="$repo" \
        HPCTRAIN_MPIRUN_ARGS="-launcher ssh -launcher-exec $here/fake-ssh -hosts $hosts" "$@"
}
echo "== links between nodes: $rate ($gbit Gbit/s) each way, TBF; inside a node: shared memory"
for placement in block:hpt-n1:2,hpt-n2:2 round-robin:hpt-n1:1,hpt-n2:1; do
    name=${placement%%:*}; hosts=${placement#*:}
    echo
    echo "== bench allreduce, 2 nodes x 2 ranks, $name placement (-hosts $hosts)"
    on "$hosts" "$PY" -m hpctrain.bench allreduce --ranks 4 --sizes "$sizes" \
        --algorithms ring,ring-rank,hier,mpi --link-gbit "$gbit"
done
for placement in block:hpt-n1:2,hpt-n2:2 round-robin:hpt-n1:1,hpt-n2:1; do
    name=${placement%%:*}; hosts=${placement#*:}
    echo
    echo "== bench train, 2 nodes x 2 ranks, $name placement, $steps steps x $repeats"
    on "$hosts" "$PY" -m hpctrain.bench train --ranks 4 --steps "$steps" --repeats "$repeats" \
        --compare allreduce=ring,hier,mpi
    on "$hosts" "$PY" -m hpctrain.bench train --ranks 4 --steps "$steps" --repeats "$repeats" \
        --compare ring-order=node,rank -- --allreduce ring
done
echo
echo "== bench model's ring prediction against the ring, 1 rank per node ($gbit Gbit/s at --link-efficiency 0.85; alpha from 4K)"
for hosts in hpt-n1:1,hpt-n2:1 hpt-n1:1,hpt-n2:1,hpt-n3:1,hpt-n4:1; do
    n=$(tr ',' '\n' <<< "$hosts" | wc -l)
    on "$hosts" "$PY" -m hpctrain.bench allreduce --ranks "$n" --sizes 4K,16M,64M \
        --algorithms ring --link-gbit "$gbit" --json |
    "$PY" -c "
import json, sys
from hpctrain.bench.model import predict
d = json.loads(sys.stdin.read()); n = d['ranks']; eff = 0.85
alpha = d['rows'][0]['ring_us'] * 1e-6 / (2 * (n - 1))      # 4K: latency-bound
for r in d['rows'][1:]:
    pred = predict(n, r['bytes'], (alpha, alpha), 8 / ($gbit * 1e9 * eff), 0.0, 0.0, 1.0)['ring_comm_ms'] / 1e3
    meas = r['ring_us'] * 1e-6
    print(f'{n} nodes x 1 rank, {r[\"bytes\"] / 2**20:g} MiB: measured {meas * 1e3:.1f} ms, model {pred * 1e3:.1f} ms, '
          f'error {(meas - pred) / pred:+.0%}; link {r[\"ring_link_mb\"]:.1f} MB sent, must {r[\"ring_must_mb\"]:.1f} MB, '
          f'link efficiency {r[\"ring_link_eff\"]:.2f}')
"
done
