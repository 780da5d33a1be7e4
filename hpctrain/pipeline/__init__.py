"""Model parallelism: a model's layer list cut into stages on several ranks,
micro-batches pipelined through them. schedule.py: the schedules (pure
functions of stages, micro-batches and stage, and a tick model that checks
and times them); stages.py: where the layers are cut, which flags a pipeline
refuses; grid.py: the stage x replica grid's communicators; stage.py: one
stage's model copies and their gradient sum. The loop that runs them is
hpctrain/loops/pipe.py, the engine one stage runs (engine.py). Never imports MPI (grid.py splits a communicator it is given).

    python -m hpctrain.pipeline --stages 2 --micro-batches 4    # both schedules' tick diagrams
"""
from .schedule import (SCHEDULES, Backward, Forward, RecvActivation, RecvGrad, ScheduleError, SendActivation,
                       SendGrad, Span, Ticks, bubble_fraction, diagram, gpipe, one_f_one_b, peak_activations,
                       simulate)

__all__ = ["SCHEDULES", "Backward", "Forward", "RecvActivation", "RecvGrad", "ScheduleError", "SendActivation",
           "SendGrad", "Span", "Ticks", "bubble_fraction", "diagram", "gpipe", "one_f_one_b",
           "peak_activations", "simulate"]
