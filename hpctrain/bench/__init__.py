"""Benchmarks, each launching its own MPI jobs through the same mpirun:

    python -m hpctrain.bench allreduce [--ranks 2] [--sizes 4K,1M,16M] [--json]
    python -m hpctrain.bench train --mode ring --ranks 1,2,4 [--json] [-- extra hpctrain flags]
    python -m hpctrain.bench model [--link-gbit 25] [--compute-ms 50] [--model-mb 100]
    python -m hpctrain.bench pipeline [--micro-batches 4,8] [--quick] [--json] [-- extra hpctrain flags]

Speed is shown here, never asserted in tests: run these on a quiet machine and
compare ratios measured in one run.
"""
