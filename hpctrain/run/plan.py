"""Everything the flags, the world and the data decide, made once at start-up
(run/startup.py) into typed, frozen values that the loops, the report and
the checkpoints read instead of the parsed flags; and all of the run's step
and batch arithmetic.

Two decisions, each by every rank alike:
- `make_plan` at start-up, once the world and the data are known: the
  model's spec (the data's image shape and class count), the data workers (a
  pipeline's replicas), the samples per step, the ps replicas to aggregate,
  the fusion size, the rules for --shard-optimizer auto and --overlap auto,
  the pipeline's cuts, the gradient compression, and the learning-rate
  schedule, whose total steps are --steps or --epochs counted over the data
  from step 0;
- `Plan.last_step(resume)`, once the resume point is known: with --epochs,
  a run resized on resume still trains E epochs from the checkpoint's
  samples on (`epochs_end`), not the steps E would be at its new size from
  step 0. The schedule keeps its start-up total: with --lr-schedule cosine a
  resize is refused before (identity.schedule_key).

    python -c "from hpctrain.run.plan import steps_for_epochs; print(steps_for_epochs(1, 4500, 2 * 32))"
"""
import math
from dataclasses import dataclass

import numpy as np

from ..base import device
from ..base.errors import HpctrainError
from ..flags.cli import DEFAULT_EVAL_TOKENS, configuration
from ..data.manifest import load_manifest, train_samples
from ..nn import compiled
from ..nn.spec import ModelSpec
from ..base.precision import FLOAT32, Precision
from ..optim.lr_schedule import learning_rate, schedule_line
from ..pipeline.stages import virtual_stages
from . import identity
from .cluster import cores_available

# --- the arithmetic ------------------------------------------------------------


def aggregated_workers(args, workers):
    """Of the `workers` that take batches of their own, those whose samples
    one optimizer step (update) takes: with the per-worker batch
    (Data.per_update) the one definition that --epochs, the samples a
    checkpoint records, samples/s and the final record's global_batch all
    count by. Ring mode (a pipeline's replicas too): all of them; ps mode:
    the gradients an update aggregates (sync: --replicas-to-aggregate, every
    worker but the backups, whose late gradients are dropped; async: one
    worker's, applied alone)."""
    if args.mode != "ps":
        return workers
    return replicas_to_aggregate(args.sync, args.replicas_to_aggregate, workers, args.backup_workers)


def steps_for_epochs(epochs, train_samples, per_update):
    """--epochs E as global steps: ceil(E * samples / samples per update),
    at least 1. Exact for a whole E and integer arithmetic where E*4 is whole,
    so 1 epoch of 4500 samples at 2 x 32 is 71 steps, not 70 or 72."""
    return max(1, math.ceil(epochs * train_samples / per_update))


def epochs_end(epochs, train_samples, step, samples, per_update):
    """--epochs E resumed at `step` after `samples` training samples: the step
    at which E x train_samples are taken, the rest at per_update a step. So
    a job resized on resume still trains E epochs (within one global batch
    at the end), not the steps E would be at its new size from step 0."""
    per_update = int(per_update)
    if samples == step * per_update:   # all at this size: the steps of a run through, to the bit
        return steps_for_epochs(epochs, train_samples, per_update)
    return step + max(0, math.ceil((epochs * train_samples - samples) / per_update))


def replicas_to_aggregate(sync, given, workers, backup_workers):
    """ps mode: the gradients each update aggregates (sync: --replicas-to-aggregate
    or every worker but the backups; async: each one alone)."""
    if not sync:
        return 1
    return given or workers - backup_workers


def overlap_wanted(flag, xp, local_size, thread_multiple=True):
    """--overlap auto: a communication thread pays only when a core is free to
    run it while backprop computes: always with a GPU doing the math, on CPUs
    only when this node has at least two cores per rank. (Measured on 2 cores,
    2 ranks: the thread's allreduce started only after backprop ended, and with
    4 ranks the extra thread cost throughput.) Never without
    MPI_THREAD_MULTIPLE: two threads would call MPI at once."""
    if not thread_multiple:
        return False
    if flag != "auto":
        return flag == "on"
    return device.is_gpu(xp) or cores_available() >= 2 * local_size


def shard_wanted(flag, workers=1, xp=np, allreduce="auto"):
    """--shard-optimizer auto is a fixed rule, not a measurement: on where
    `python -m hpctrain.bench train --compare shard-optimizer=off,on` measured
    it faster (1.20-1.35x at 2 and 4 ranks for 2.6 to 80 MB of gradients, on
    CPUs) and where it gives the same parameters bit for bit: 2 or more
    workers, NumPy, and hpctrain's own ring or hierarchical allreduce
    (`--allreduce auto|ring|hier`; MPI's reduce-scatter sums in another
    order). Off on GPUs until the device check has compared both there.
    With --compression too: on several nodes hier then shards by the node's
    ring (comm/compressed_exchange.py NodeShards), so only the compressed sum crosses
    the nodes; measured on one node, where the unsharded optimizer cost the
    compressed runs more than compression did (docs/ring.md)."""
    if flag != "auto":
        return flag == "on"
    return workers >= 2 and xp is np and allreduce in ("auto", "ring", "hier")


def zero_stage(args, workers=1, xp=np):
    """The ZeRO stage a run takes: --zero where given (its old name
    --shard-optimizer on|off: 1|0), else shard_wanted's rule (1 or 0)."""
    if args.zero is not None:
        return args.zero
    return 1 if shard_wanted(args.shard_optimizer, workers, xp, args.allreduce) else 0


# --- the plan ---------------------------------------------------------------------

@dataclass(frozen=True)
class Data:
    """The data and how it is dealt: `workers` take batches of their own (a
    pipeline's replicas; ps: the workers), each `batches` of `batch_size` a
    step (--accumulate-steps K, or a pipeline's --micro-batches M);
    the batches of `aggregated` of them make one optimizer step (aggregated_workers)."""
    dir: str
    digest: str          # the manifest's (what ranks and checkpoints compare)
    train_samples: int
    has_val: bool
    workers: int
    batch_size: int
    batches: int
    seed: int
    augment: str         # --augment: "crop,flip" and the like, "" for none (data/augment.py)
    block_size: int      # --block-size: a text sample's tokens (data/tokens.py); images ignore it
    text: bool           # token windows (prepare --text), not images
    aggregated: int      # the workers whose batches one optimizer step takes (ps: the gradients it aggregates)
    val_is_test: bool = False   # the val split is the test split's files (text's one held-out tail)
    # text: the held-out tokens an evaluation scores (--eval-tokens; data/splits.held_out's
    # sample, the same at every evaluation); None: every window (images: every image)
    eval_tokens: int = None
    # --data A:0.7,B:0.3: ((path, weight), ...) of the blend (data/blend.py), dir its first set's
    # (the held-out split, the vocabulary); None: one directory
    blend: tuple = None

    @property
    def tokens_per_sample(self):
        """What a rate counts per sample in a line of text data's (tokens/s); 0 for images."""
        return self.block_size if self.text else 0

    @property
    def per_worker(self):
        """Samples one worker takes per optimizer step."""
        return self.batch_size * self.batches

    @property
    def per_update(self):
        """Training samples one optimizer step takes, globally (aggregated_workers)."""
        return self.aggregated * self.per_worker

    def per_update_line(self):
        """per_update in words: "2 workers x 32", "1 of 2 workers x 32 (...)"."""
        if self.aggregated == self.workers:
            return f"{self.workers} worker{'s' if self.workers != 1 else ''} x {self.per_worker}"
        return (f"{self.aggregated} of {self.workers} workers x {self.per_worker} (the gradients an update "
                f"aggregates)")


@dataclass(frozen=True)
class Optimizer:
    name: str            # adam, sgd, momentum
    momentum: float
    betas: tuple         # Adam's (beta1, beta2)
    weight_decay: float
    decay_ranges: tuple  # the model's (lo, hi) weight decay applies to (None: every element)
    clip_norm: float     # None: no clipping
    steps: int           # the run's optimizer steps (whether numba's pass pays: optim/base.fuse_pays)
    single_pass: str     # --single-pass auto|on|off
    dtype: np.dtype = FLOAT32.optimizer   # its state's (the plan's precision.optimizer)

    @property
    def fused(self):
        return {"auto": "auto", "on": True, "off": False}[self.single_pass]

    @property
    def kwargs(self):
        """optimizers.make_optimizer's keyword arguments."""
        return dict(momentum=self.momentum, betas=self.betas, weight_decay=self.weight_decay,
                    decay_ranges=self.decay_ranges, steps=self.steps, fused=self.fused, dtype=self.dtype)


@dataclass(frozen=True)
class Schedule:
    """schedule.learning_rate's arguments; total_steps: --steps, or --epochs counted from step 0."""
    base_lr: float
    workers: int
    scale_lr: bool
    warmup_steps: int
    schedule: str
    decay: float
    decay_steps: int
    lr_min: float
    total_steps: int

    def lr(self, step):
        """The learning rate of 0-based `step`: a pure function of it (resume is bit-exact)."""
        return learning_rate(step, **self.__dict__)

    def line(self):
        return schedule_line(**self.__dict__)


@dataclass(frozen=True)
class Ring:
    """Ring mode (and a pipeline stage's replicas): the allreduce and its buckets."""
    allreduce: str
    cuda_aware: str
    ring_order: str
    fusion_elems: int       # --fusion-mb in gradient elements (precision.grads; 0: one bucket)
    zero: int               # the ZeRO stage over the replicas: 1 the optimizer state and updates sharded,
    #                         2 the gradient too (nn/grad_slots.py), 3 and the parameters, gathered a bucket
    #                         at a time (nn/sharded_store.py); 0 unsharded (and outside ring mode)
    overlap: bool           # a communication thread overlaps the buckets with backprop
    accumulate_steps: int
    slices: int = 1         # --thread-split samples: the slices each (micro-)batch is cut into (nn/sample_split.py)


@dataclass(frozen=True)
class Compression:
    """--compression and PowerSGD's settings (comm/compressed_exchange.py): what ring
    mode's buckets and a pipeline stage's replicas exchange."""
    kind: str = "none"          # none, fp16, bf16, powersgd
    rank: int = 4               # --powersgd-rank
    start: int = 0              # --powersgd-start: float32 before this step
    min_rate: float = 2.0       # --powersgd-min-rate
    warm_start: bool = True     # --powersgd-warm-start
    epsilon: float = 0.0        # --powersgd-epsilon
    error_feedback: bool = True  # --powersgd-error-feedback
    seed: int = 0               # --seed: the initial Qs' draw

    @property
    def stateful(self):
        """Whether it keeps state from step to step (error feedback, Q) that checkpoints carry."""
        return self.kind == "powersgd"


def compression_plan(args):
    if args.compression != "powersgd":
        return Compression(kind=args.compression, seed=args.seed)
    return Compression(kind="powersgd", rank=args.powersgd_rank, start=args.powersgd_start,
                       min_rate=args.powersgd_min_rate, warm_start=args.powersgd_warm_start == "on",
                       epsilon=args.powersgd_epsilon, error_feedback=args.powersgd_error_feedback == "on",
                       seed=args.seed)


@dataclass(frozen=True)
class Ps:
    num_ps: int
    ps_ranks: str
    sync: bool
    replicas: int           # gradients per update (aggregated_workers: Data.aggregated)
    backup_workers: int
    max_staleness: int      # None: unbounded
    dc_lambda: float
    placement: str
    exchange: str           # auto (shared memory where it can) or mpi
    device: str             # where servers keep their slice: cpu or gpu


@dataclass(frozen=True)
class Pipe:
    stages: int
    micro_batches: int
    schedule: str           # gpipe, 1f1b, interleaved
    cuts: tuple             # layer indices [0, ..., len(layers)]: P + 1, or PV + 1 (chunks); () without a pipeline
    virtual_stages: int = 1   # V chunks per stage (the interleaved schedule)

    @property
    def split(self):
        """The inner cut points as --pipeline-split writes them."""
        return ",".join(map(str, self.cuts[1:-1]))


@dataclass(frozen=True)
class Outputs:
    checkpoint_dir: str
    checkpoint_every: int
    keep_checkpoints: int
    resume: str
    resume_other_data: bool
    save: str
    metrics: str
    keep_best: str
    timeline: str
    timeline_steps: int
    eval_every: int
    log_every: int
    tensorboard: str
    final_eval: str = "on"   # --final-eval off: no evaluation after the last step


@dataclass(frozen=True)
class Plan:
    mode: str               # ring or ps (a pipeline is ring mode with pipe.stages > 1)
    model: str              # --model as given
    hidden: tuple           # the MLP's widths
    spec: ModelSpec
    data: Data
    optimizer: Optimizer
    schedule: Schedule
    ring: Ring
    ps: Ps
    pipe: Pipe
    outputs: Outputs
    epochs: float           # None: --steps
    timeout: float
    world_size: int
    recorded: dict          # what a checkpoint records of the job (identity.recorded)
    resume_key: dict        # what a resume must match (identity.same_on_resume)
    compression: Compression = Compression()   # --compression (ring mode, a pipeline's replicas)
    precision: Precision = FLOAT32   # hpctrain/base/precision.py: the dtypes of parameters, gradients, optimizer state, compute
    init_from: str = None   # --init-from PATH: a fresh run's parameters from it (interop/pretrained.py)
    config: dict = None     # the merged flags (cli.configuration): the final record's and each checkpoint's `config`

    @property
    def pipelined(self):
        return self.pipe.stages > 1

    @property
    def per_step(self):
        """Training samples one optimizer step takes, globally (Data.per_update)."""
        return self.data.per_update

    def lr(self, step):
        return self.schedule.lr(step)

    def last_step(self, resume):
        """The run's last step, once `resume` (a checkpoints.resume.Resume or None)
        is known on every rank."""
        if resume is None or self.epochs is None:
            return self.schedule.total_steps
        return epochs_end(self.epochs, self.data.train_samples, resume.step, resume.samples, self.per_step)


def data_plan(args, cluster, data_dir, digest, manifest, has_val, blend=None):
    """How the data is dealt: the workers that take batches of their own (a
    pipeline's or a tensor group's replicas, world / (stages x tensor ranks)),
    their samples per step, and the samples an update takes. blend: the
    sets of --data A:0.7,B:0.3 (their windows together are its samples)."""
    workers = cluster.num_workers // (args.pipeline_stages * args.tensor_parallel)
    samples = train_samples(manifest, args.block_size) if blend is None else \
        sum(train_samples(load_manifest(path), args.block_size) for path, _ in blend)
    return Data(dir=str(data_dir), digest=digest, train_samples=samples,
                has_val=bool(has_val), workers=workers, batch_size=args.batch_size,
                batches=args.accumulate_steps * args.micro_batches, seed=args.seed, augment=args.augment,
                block_size=args.block_size, text=manifest.get("kind") == "tokens",
                aggregated=aggregated_workers(args, workers),
                val_is_test=bool(has_val) and manifest.get("val") == manifest.get("test"),
                eval_tokens=eval_tokens_of(args, manifest),
                blend=None if blend is None else tuple((str(path), weight) for path, weight in blend))


def eval_tokens_of(args, manifest):
    """The held-out tokens each evaluation scores: text's --eval-tokens N,
    its default cap (cli.DEFAULT_EVAL_TOKENS), or None for all of them (all;
    images, which take no sample)."""
    if manifest.get("kind") != "tokens" or args.eval_tokens == 0:
        return None
    return args.eval_tokens or DEFAULT_EVAL_TOKENS


def schedule_plan(args, data):
    """The learning-rate schedule; its total: --steps, or --epochs counted over the data from step 0."""
    steps = args.steps
    if args.epochs is not None:
        steps = steps_for_epochs(args.epochs, data.train_samples, data.per_update)
    return Schedule(base_lr=args.lr, workers=data.workers, scale_lr=args.scale_lr, warmup_steps=args.warmup_steps,
                    schedule=args.lr_schedule, decay=args.lr_decay, decay_steps=args.lr_decay_steps,
                    lr_min=args.lr_min, total_steps=steps)


def single_pass(args):
    """--single-pass, where auto is on with compiled layers: numba is in the
    process then, so the optimizer's pass has no start-up to pay back
    (optim/base.fuse_pays) and saves from the first step (the small
    GPT's Adam: 0.8 against 2.1 ms a step). The same bits either way."""
    return "on" if args.single_pass == "auto" and compiled.on() else args.single_pass


def thread_slices(args, spec, xp):
    """The slices --thread-split samples cuts a batch into (1: the ops
    split), or one line where this model or device cannot take them (the
    flags alone: flags/parallel_flags.check_thread_split)."""
    if args.thread_split != "samples":
        return 1
    if spec.num_state:
        raise HpctrainError("--thread-split samples cannot split batch norm: its statistics are the whole "
                            "batch's; use --thread-split ops")
    if xp is not np:
        raise HpctrainError("--thread-split samples is for the CPU's threads: this run is on a GPU "
                            "(use --thread-split ops, or --device cpu)")
    return args.thread_slices


def make_plan(args, world, spec, data, schedule, cuts, layers_key="NumPy"):
    """The plan of a run: `args` the flags, `world` the run/world.World, the
    spec of the model for the data, the data and schedule plans above, the
    pipeline's cut points (None without one), how its layers round (the
    chief's compiled-layer tuning key, or "NumPy"). Every rank alike."""
    cluster, workers = world.cluster, data.workers
    ring = args.mode == "ring"
    stage = zero_stage(args, workers, world.xp)   # --zero, or the default's rule
    precision = FLOAT32   # the one precision a run takes today (hpctrain/base/precision.py)
    return Plan(
        mode=args.mode, model=args.model, hidden=tuple(args.hidden), spec=spec, data=data,
        optimizer=Optimizer(args.optimizer, args.momentum, tuple(args.adam_betas), args.weight_decay,
                            spec.decay_ranges if args.weight_decay_on == "matrices" else None, args.clip_norm,
                            schedule.total_steps, single_pass(args), precision.optimizer),
        schedule=schedule,
        # --on-failure shrink: auto is the flat ring, whose one communicator holds every rank
        # (run/startup.check_shrink_layout says why hier is not)
        ring=Ring(allreduce="ring" if args.on_failure == "shrink" and args.allreduce == "auto" else args.allreduce,
                  cuda_aware=args.cuda_aware, ring_order=args.ring_order,
                  fusion_elems=int(args.fusion_mb * (1 << 20)) // precision.grads.itemsize,
                  zero=stage if ring else 0,
                  overlap=ring and overlap_wanted(args.overlap, world.xp, cluster.local_size,
                                                  world.thread_multiple),
                  accumulate_steps=args.accumulate_steps, slices=thread_slices(args, spec, world.xp)),
        ps=Ps(num_ps=cluster.num_ps, ps_ranks=args.ps_ranks, sync=args.sync,
              replicas=data.aggregated,
              backup_workers=args.backup_workers, max_staleness=args.max_staleness, dc_lambda=args.dc_lambda,
              placement=args.placement, exchange=args.ps_exchange, device=args.ps_device),
        pipe=Pipe(stages=args.pipeline_stages, micro_batches=args.micro_batches, schedule=args.pipeline_schedule,
                  cuts=tuple(cuts or ()), virtual_stages=virtual_stages(args)),
        outputs=Outputs(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                        keep_checkpoints=args.keep_checkpoints, resume=args.resume,
                        resume_other_data=args.resume_other_data, save=args.save, metrics=args.metrics,
                        keep_best=args.keep_best, timeline=args.timeline, timeline_steps=args.timeline_steps,
                        eval_every=args.eval_every, log_every=args.log_every, tensorboard=args.tensorboard,
                        final_eval=args.final_eval),
        epochs=args.epochs, timeout=args.timeout, world_size=cluster.size, init_from=args.init_from,
        recorded=identity.recorded(args, cluster.size, workers, spec, layers_key),
        resume_key=identity.same_on_resume(args, workers, spec, schedule.total_steps),
        compression=compression_plan(args), precision=precision, config=configuration(args))
