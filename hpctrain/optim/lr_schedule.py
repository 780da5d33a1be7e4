"""The learning-rate schedules (constant, step, cosine; each after a linear
warm-up): the lr of a step, a pure function of it, and the line that names
the schedule's key points (the chief prints it at start). The run's plan
(run/plan.py) asks it for each step's lr; the optimizers (optimizers.py)
take that lr as it is.

    .venv/bin/python -m pytest -q tests/test_optim.py tests/test_recipe.py
"""
import math


SCHEDULES = ("constant", "step", "cosine")


def learning_rate(step, base_lr, workers=1, scale_lr=False, warmup_steps=0, schedule="constant",
                  decay=0.1, decay_steps=0, lr_min=0.0, total_steps=None):
    """lr for 0-based `step`, a pure function of it (so a resume is bit-exact):
    base (times workers with --scale-lr), shaped by `schedule`, ramped
    linearly from 1/warmup to full over the first warmup_steps (Goyal et al.).

    constant: base. step: base * decay ** (step // decay_steps), counted from
    step 0 (the warm-up ramps whatever the schedule gives). cosine: base at
    the end of the warm-up, down to lr_min (not scaled by --scale-lr) at the
    last step, total_steps - 1: lr_min + (base - lr_min) * (1 + cos(pi * p)) / 2,
    p = (step - warmup_steps) / (total_steps - 1 - warmup_steps)."""
    lr = base_lr * (workers if scale_lr else 1)
    if schedule == "step":
        lr *= decay ** (step // decay_steps)
    elif schedule == "cosine":
        span = max(total_steps - 1 - warmup_steps, 1)
        p = min(max(step - warmup_steps, 0) / span, 1.0)
        lr = lr_min + (lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * p))
    if warmup_steps and step < warmup_steps:
        lr *= (step + 1) / warmup_steps
    return lr


def schedule_line(base_lr, workers=1, scale_lr=False, warmup_steps=0, schedule="constant", decay=0.1,
                  decay_steps=0, lr_min=0.0, total_steps=None):
    """The schedule's key points in one line (the chief prints it at start)."""
    lr = base_lr * (workers if scale_lr else 1)
    warm = f" (after {warmup_steps} warm-up steps)" if warmup_steps else ""
    if schedule == "step":
        return f"lr: step from {lr:g}{warm}, times {decay:g} every {decay_steps} steps"
    if schedule == "cosine":
        return f"lr: cosine from {lr:g}{warm} to {lr_min:g} at step {total_steps}"
    return f"lr: constant {lr:g}{warm}"
