"""The run's settings, decided once and frozen: what the loops, the report
and the checkpoints read instead of rewriting the parsed flags.

Decided in two steps, each by every rank alike:
- at start-up, once the data is known (session.py): the model's spec (the
  data's image shape and class count) and the learning-rate schedule, whose
  total steps are --steps or --epochs counted over the data from step 0;
- when the loop knows whether it resumes (`decide`): the last step, and in
  ring mode the fixed rules for --shard-optimizer auto and --overlap auto
  (`shard_wanted`, `overlap_wanted`). With
  --epochs, a run resized on resume still trains E epochs from the
  checkpoint's samples on (resume.epochs_end), not the steps E would be at
  its new size from step 0. The schedule keeps its start-up total: with
  --lr-schedule cosine a resize is refused before (settings.schedule_key).

    python -m hpctrain.train --epochs 2 --lr-schedule cosine
"""
from dataclasses import dataclass

import numpy as np

from .. import device
from .cluster import cores_available
from ..data import load_manifest
from ..nn.spec import ModelSpec
from ..optim.optimizers import learning_rate


def worker_batch(args):
    """Samples one worker takes per optimizer step: --batch-size x --accumulate-steps
    (a pipeline's replica: x --micro-batches, refused with --accumulate-steps)."""
    return args.batch_size * args.accumulate_steps * args.micro_batches


def fusion_elems(args):
    """--fusion-mb in float32 elements: the gradient buckets' size (0: one bucket)."""
    return int(args.fusion_mb * (1 << 20)) // 4


def data_workers(args, num_workers):
    """The workers that take batches of their own: a pipeline's replicas (world / stages)."""
    return num_workers // args.pipeline_stages


@dataclass(frozen=True)
class RunConfig:
    args: object         # the flags as parsed: never written after parsing
    spec: ModelSpec      # the model, shaped for the data (nn/spec.py)
    steps: int           # the last step of this run
    schedule: dict       # optim.learning_rate's arguments
    shard_optimizer: bool = False   # ring: optimizer state and updates sharded over the workers
    overlap: bool = False           # ring: a communication thread overlaps the buckets with backprop

    @property
    def worker_batch(self):
        return worker_batch(self.args)

    def lr(self, step):
        """The learning rate of 0-based `step`: a pure function of it (resume is bit-exact)."""
        return learning_rate(step, **self.schedule)


def decide(session, resume):
    """The frozen configuration of this run, once `resume` (a resume.Resume or
    None) is known on every rank."""
    args, steps = session.args, session.schedule["total_steps"]
    if resume is not None and args.epochs is not None:
        from ..checkpoints.resume import epochs_end
        train = int(load_manifest(session.data_dir)["train"]["num_samples"])
        steps = epochs_end(args.epochs, train, resume.step, resume.samples, session.data_workers,
                           worker_batch(args))
    ring = args.mode == "ring"
    return RunConfig(args=args, spec=session.spec, steps=steps, schedule=dict(session.schedule),
                     shard_optimizer=ring and shard_wanted(args.shard_optimizer, session.data_workers,
                                                           session.xp, args.allreduce),
                     overlap=ring and overlap_wanted(args.overlap, session.xp, session.cluster,
                                                     session.thread_multiple))


def overlap_wanted(flag, xp, cluster, thread_multiple=True):
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
    return device.is_gpu(xp) or cores_available() >= 2 * cluster.local_size

def shard_wanted(flag, workers=1, xp=np, allreduce="auto"):
    """--shard-optimizer auto is a fixed rule, not a measurement: on where
    `python -m hpctrain.bench train --compare shard-optimizer=off,on` measured
    it faster (1.20-1.35x at 2 and 4 ranks for 2.6 to 80 MB of gradients, on
    CPUs) and where it gives the same parameters bit for bit: 2 or more
    workers, NumPy, and hpctrain's own ring or hierarchical allreduce
    (`--allreduce auto|ring|hier`; MPI's reduce-scatter sums in another
    order). Off on GPUs until the device check has compared both there."""
    if flag != "auto":
        return flag == "on"
    return workers >= 2 and xp is np and allreduce in ("auto", "ring", "hier")

