"""The sharding and splitting flags' one-line refusals, where a setting
cannot run (cli.validate calls them): --zero (ring mode's ZeRO stage) and
its old name --shard-optimizer (`check_zero`), --tensor-parallel and
--sequence-parallel (`check_tensor_parallel`), --thread-split samples
(`check_thread_split`). Standard library only, as
cli.py. The stage a run takes is run/plan.zero_stage's.

    mpirun -n 2 python -m hpctrain.train --zero 3 --mode ps     # one line, exit 2
    mpirun -n 3 python -m hpctrain.train --tensor-parallel 2    # one line, exit 2
    python -m hpctrain.train --thread-split samples --zero 2     # one line, exit 2
"""
from ..base.errors import HpctrainError


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
                            "micro-batches into a full-length gradient; what it would save: docs/parallelism.md); "
                            "use --zero 1")


def check_tensor_parallel(args, world_size):
    """--tensor-parallel T and --sequence-parallel where they cannot run: one line each."""
    t = args.tensor_parallel
    if t == 1:
        if args.sequence_parallel:
            raise HpctrainError("--sequence-parallel cuts the positions over a tensor group: it needs "
                                "--tensor-parallel T > 1")
        return
    if args.mode == "ps":
        raise HpctrainError(f"--tensor-parallel {t} is for --mode ring: a ps worker pulls and pushes the whole "
                            f"model, and a split layer's ranks must exchange activations inside every layer")
    p = args.pipeline_stages
    if world_size % (t * p):
        raise HpctrainError(f"--tensor-parallel {t}" + (f" x --pipeline-stages {p}" if p > 1 else "") +
                            f" does not divide the {world_size} ranks (the world is " + ("P x " if p > 1 else "") +
                            "T x R: R replicas of a model split over T ranks" + (", in P stages" if p > 1 else "") +
                            ")")
    if args.compression == "powersgd":
        raise HpctrainError(f"--compression powersgd with --tensor-parallel {t}: not yet (its error feedback "
                            f"would be one slice's, checkpointed whole); use --compression bf16, fp16 or none")


def check_thread_split(args):
    """--thread-split samples (nn/sample_split.py) where it cannot run: one
    line each. Its slices each keep a whole-length gradient and run the
    whole model: a ring replica's step on the CPU, nothing that shards the
    gradient or cuts the model."""
    if args.thread_split != "samples":
        return
    why = ("--mode ps" if args.mode == "ps" else
           f"--zero {args.zero}" if args.zero is not None and args.zero >= 2 else
           f"--tensor-parallel {args.tensor_parallel}" if args.tensor_parallel > 1 else
           f"--pipeline-stages {args.pipeline_stages}" if args.pipeline_stages > 1 else
           "--device gpu" if args.device == "gpu" else None)
    if why:
        raise HpctrainError(f"--thread-split samples does not work with {why}: each slice runs the whole "
                            "model into a whole-length gradient of its own (ring mode, --zero 0 or 1, the CPU); "
                            "use --thread-split ops")
