"""The run's settings, decided once and frozen: what the loops, the report
and the checkpoints read instead of rewriting the parsed flags.

Decided in two steps, each by every rank alike:
- at start-up, once the data is known (session.py): the model's spec (the
  data's image shape and class count) and the learning-rate schedule, whose
  total steps are --steps or --epochs counted over the data from step 0;
- when the loop knows whether it resumes (`decide`): the last step. With
  --epochs, a run resized on resume still trains E epochs from the
  checkpoint's samples on (resume.epochs_end), not the steps E would be at
  its new size from step 0. The schedule keeps its start-up total: with
  --lr-schedule cosine a resize is refused before (settings.schedule_key).

    python -m hpctrain.train --epochs 2 --lr-schedule cosine
"""
from dataclasses import dataclass

from .data import load_manifest
from .nn.spec import ModelSpec
from .optim import learning_rate


@dataclass(frozen=True)
class RunConfig:
    args: object         # the flags as parsed: never written after parsing
    spec: ModelSpec      # the model, shaped for the data (nn/spec.py)
    steps: int           # the last step of this run
    schedule: dict       # optim.learning_rate's arguments

    def lr(self, step):
        """The learning rate of 0-based `step`: a pure function of it (resume is bit-exact)."""
        return learning_rate(step, **self.schedule)


def decide(session, resume):
    """The frozen configuration of this run, once `resume` (a resume.Resume or
    None) is known on every rank."""
    args, steps = session.args, session.schedule["total_steps"]
    if resume is not None and args.epochs is not None:
        from .resume import epochs_end
        train = int(load_manifest(session.data_dir)["train"]["num_samples"])
        steps = epochs_end(args.epochs, train, resume.step, resume.samples, session.cluster.num_workers,
                           args.batch_size)
    return RunConfig(args=args, spec=session.spec, steps=steps, schedule=dict(session.schedule))
