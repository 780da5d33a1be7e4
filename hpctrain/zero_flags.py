"""--zero (ring mode's ZeRO stage) and its old name --shard-optimizer: the
one-line refusals of a stage that cannot run (cli.validate calls
check_zero). Standard library only, as cli.py. The stage a run takes is
run/plan.zero_stage's.

    mpirun -n 2 python -m hpctrain.train --zero 3 --mode ps     # one line, exit 2
"""
from .errors import HpctrainError


def check_zero(args):
    """--zero and its old name --shard-optimizer: one line for a stage that cannot run."""
    if args.zero is not None and args.shard_optimizer != "auto":
        raise HpctrainError(f"--zero {args.zero} and --shard-optimizer {args.shard_optimizer} both given: "
                            "--shard-optimizer is --zero's old name (on: --zero 1, off: --zero 0); give one")
    flag = f"--zero {args.zero}" if args.zero is not None else "--shard-optimizer on"
    stage = args.zero if args.zero is not None else 1 if args.shard_optimizer == "on" else 0
    if stage and args.mode == "ps":
        raise HpctrainError(f"{flag} is for --mode ring (in ps mode the servers already hold the parameters and "
                            "the optimizer state in shards)")
    if stage and args.allreduce == "nccl":
        raise HpctrainError(f"{flag} does not work with --allreduce nccl yet "
                            "(its reduce-scatter needs equal parts); use --allreduce auto, ring, hier or mpi")
    if stage >= 2 and args.compression == "powersgd":
        raise HpctrainError(f"--zero {stage} does not take --compression powersgd: its error feedback keeps a "
                            f"full-length gradient on every rank, the memory stage {stage} saves; use --zero 1 "
                            "(or --compression fp16|bf16)")
    if stage >= 2 and args.pipeline_stages > 1:
        raise HpctrainError(f"--zero {stage} does not work with --pipeline-stages yet (a stage sums its "
                            "micro-batches into a full-length gradient); use --zero 1")
