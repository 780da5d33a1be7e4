"""What makes two processes the same job: one list of settings, three uses.

- At start-up every rank compares `same_on_every_rank(args)` (run/startup.py):
  a rank launched with another --lr or --hidden stops the job with one line,
  and so does one with other outputs (--save, --metrics, ...: OUTPUT_FLAGS),
  which only the chief writes: given to another rank alone they would be
  ignored without a word.
- Every checkpoint records `recorded(args, ...)` as attributes (checkpoints/file.py).
- On resume the checkpoint's `same_on_resume(...)` values must equal this run's:
  the model and its state (mode, model, hidden, num_params, optimizer,
  --momentum for --optimizer momentum: its velocity is a sum of gradients
  decayed by that factor, so another value changes what the state means,
  and --adam-betas for --optimizer adam, likewise for its moments), the
  per-worker batch the run was tuned with (batch_size), the shuffle (seed),
  and the learning-rate schedule's shape (`schedule_key`: with cosine,
  --steps too). Everything else may change on resume: the number of
  workers and servers (a resized job goes on: data/reader.py), --steps in
  particular (a resumed job may train longer), --lr, --weight-decay (and
  --weight-decay-on) and --clip-norm (each scales updates, none shapes the state: a deliberate
  change, like --lr); the result is bit-identical to an
  uninterrupted run only when nothing else changed either.
- What a checkpoint from before a setting existed means by it is the
  reader's (checkpoints/read_back.RESUME_DEFAULTS).

    python -c "from hpctrain.flags import cli; from hpctrain.run import identity; print(identity.same_on_every_rank(cli.parse([])))"
"""
import hashlib
import math
import os

from .. import __version__
from ..flags.model_names import is_model_file
from ..nn.sequential import INIT_VERSION

# Flags whose value must be identical on every rank of a job.
RANK_FLAGS = ("mode", "model", "batch_size", "accumulate_steps", "steps", "epochs", "lr", "optimizer", "momentum",
              "adam_betas", "single_pass", "weight_decay_on", "seed", "scale_lr", "warmup_steps",
              "lr_schedule", "lr_decay", "lr_decay_steps", "lr_min", "weight_decay", "clip_norm",
              "allreduce", "ring_order", "fusion_mb", "shard_optimizer", "zero", "num_ps", "ps_ranks", "ps_exchange",
              "sync", "replicas_to_aggregate", "backup_workers", "max_staleness", "dc_lambda", "placement", "checkpoint_every",
              "timeout", "pipeline_stages", "micro_batches", "pipeline_schedule", "virtual_stages", "pipeline_split",
              "augment", "compression", "powersgd_rank", "powersgd_start", "powersgd_min_rate", "powersgd_warm_start",
              "powersgd_epsilon", "powersgd_error_feedback", "block_size", "recompute", "tensor_parallel",
              "sequence_parallel", "init_from", "on_failure", "commit_every", "thread_split", "thread_slices",
              "blas")
# Flags only the chief acts on (its files and lines), compared like the ones
# above but not recorded in checkpoints; paths as the files they name.
# (--eval-tokens and --final-eval: what every rank's share of an evaluation
# takes, compared so that no rank scores another sample or skips alone.)
OUTPUT_FLAGS = ("checkpoint_dir", "keep_checkpoints", "resume", "resume_other_data", "save", "metrics",
                "keep_best", "timeline", "timeline_steps", "eval_every", "log_every", "memory_budget", "tensorboard",
                "eval_tokens", "final_eval")
PATH_FLAGS = ("checkpoint_dir", "save", "metrics", "keep_best", "timeline", "tensorboard")
SAME_ON_RESUME = ("mode", "model", "hidden", "num_params", "optimizer", "momentum", "adam_betas", "batch_size",
                  "accumulate_steps", "seed", "lr_schedule")


def schedule_key(args, total_steps):
    """The --lr-schedule a checkpoint records and a resume must match: the
    schedule and the flags that shape it, and for cosine the last step (its
    curve depends on --steps, so a resume that trains longer would take
    another path). --lr, --scale-lr and --warmup-steps may change on resume
    as before (a deliberate change, like --lr)."""
    if args.lr_schedule == "step":
        return f"step x{args.lr_decay!r} every {args.lr_decay_steps}"
    if args.lr_schedule == "cosine":
        return f"cosine to {args.lr_min!r} at step {total_steps}"
    return "constant"


def _job(args):
    """The job's settings as str, int and float values (what HDF5 attributes and
    fixed-width byte records can carry)."""
    job = {k: getattr(args, k) for k in RANK_FLAGS}
    job["hidden"] = ",".join(map(str, args.hidden))
    job["adam_betas"] = ",".join(map(repr, args.adam_betas))
    # Batches per optimizer step per worker: a pipeline's --micro-batches M
    # takes the samples (and gives the bits) of --accumulate-steps M, so its
    # checkpoints resume in ring mode with --accumulate-steps M, and back.
    job["accumulate_steps"] = args.accumulate_steps * args.micro_batches
    job["hpctrain"] = __version__
    return job


def _model(spec):
    """The model as checkpoints record it (nn/spec.py): its identity and
    size, built for the data's shapes, so a checkpoint of a model for other
    data (another image size or class count) is not resumed."""
    return {"model": spec.identity, "num_params": int(spec.full.num_params)}   # a tensor slice's: the whole model's


def _where(path):
    """A path flag as ranks compare it: the file it names (relative paths
    resolved), within the 64-byte records of comm/agree.check_consistency: a
    longer one is its end and a hash of the whole."""
    if not path:
        return "-"
    where = os.path.realpath(path)
    if len(where) > 60:
        where = hashlib.sha256(where.encode()).hexdigest()[:8] + "..." + where[-45:]
    return where


def same_on_every_rank(args):
    # Before the data is read: --hidden is compared here, the data itself
    # by its manifest's digest (run/startup.py); the model follows from both. The same outputs everywhere, the
    # checkpoint directory included: a rank with another --checkpoint-dir
    # would wait for checkpoints forever.
    outputs = {k: _where(getattr(args, k)) if k in PATH_FLAGS else getattr(args, k) for k in OUTPUT_FLAGS}
    job = dict(_job(args), **outputs)
    if args.model is not None and is_model_file(args.model):   # None: --init-from's model, compared later
        # FILE.py:FUNCTION: not the path (relative on one rank, absolute on
        # another, or a copy per node), but what it names: the function here,
        # the file's code and the model it builds in run/startup.py.
        job["model"] = f"FILE.py:{args.model.rpartition(':')[2]}"
    return job


def same_on_resume(args, num_workers, spec, total_steps):
    """total_steps: the lr schedule's (Plan.schedule), which cosine's curve
    follows. --hidden only for the MLP, which it sizes (another model's
    identity pins it down, and --hidden has no effect on it); --momentum
    only for --optimizer momentum and --adam-betas only for --optimizer adam,
    the ones that use them."""
    job = dict(_job(args), **_model(spec), num_workers=int(num_workers),
               lr_schedule=schedule_key(args, total_steps))
    unused = unused_by(args.optimizer) | ({"hidden"} if args.model != "mlp" else set())
    return {k: job[k] for k in SAME_ON_RESUME if k not in unused}


def unused_by(optimizer):
    """The optimizer settings an --optimizer does not use (--momentum but for
    momentum, --adam-betas but for adam): recorded with every checkpoint (they
    are flags of the job), neither compared on resume nor listed
    (hpctrain/checkpoint.py)."""
    return {name for name, user in (("momentum", "momentum"), ("adam_betas", "adam")) if optimizer != user}


def recorded(args, world_size, num_workers, spec, layers_key="NumPy"):
    """Everything a checkpoint records about the run that wrote it (--hidden:
    the MLP's; --block-size: a text model's; init_version: how its initial parameters were drawn; tuning:
    how its layers round, "NumPy" or the compiled layers' tuning key, which
    a resume compares: checkpoints/resume.py)."""
    job = dict(_job(args), **_model(spec), world_size=int(world_size), num_workers=int(num_workers),
               inputs=int(math.prod(spec.input_shape)), classes=int(spec.classes), init_version=INIT_VERSION,
               tuning=str(layers_key))
    if args.model != "mlp":
        del job["hidden"]
    if spec.input_kind != "tokens":   # --block-size sizes a text model's samples only
        del job["block_size"]
    return job
