"""Model parallelism: a model's layer list cut into stages on several ranks,
micro-batches pipelined through them. So far only the schedules are built
(schedule.py: pure functions of stages, micro-batches and stage, and a tick
model that checks and times them); the stage exchange and the training loop
come later. Never imports MPI.

    python -m hpctrain.pipeline.schedule --stages 2 --micro-batches 4
"""
from .schedule import (SCHEDULES, Backward, Forward, RecvActivation, RecvGrad, ScheduleError, SendActivation,
                       SendGrad, Span, Timeline, bubble_fraction, diagram, gpipe, one_f_one_b, peak_activations,
                       simulate)

__all__ = ["SCHEDULES", "Backward", "Forward", "RecvActivation", "RecvGrad", "ScheduleError", "SendActivation",
           "SendGrad", "Span", "Timeline", "bubble_fraction", "diagram", "gpipe", "one_f_one_b",
           "peak_activations", "simulate"]
