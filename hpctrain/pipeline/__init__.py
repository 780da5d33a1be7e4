"""Model parallelism: a model's layer list cut into stages on several ranks,
micro-batches pipelined through them. schedule.py: the schedules (pure
functions of stages, micro-batches, stage and virtual stages, and a tick
model that checks and times them); stages.py: where the layers are cut
(into P stages, or PV chunks for the interleaved schedule), which flags a
pipeline refuses; grid.py: the stage x replica grid's communicators;
stage.py: one stage's chunks, their model copies and their gradient sum.
The loop that runs them is hpctrain/loops/pipe.py, the engine one stage
runs (engine.py). Importing the package imports no MPI (only schedule.py);
the modules take the communicators they are given (grid.py splits one), and
engine.py, tied.py and whole.py import mpi4py for its constants (IN_PLACE,
the ops).

    python -m hpctrain.pipeline --stages 2 --micro-batches 4    # every schedule's tick diagram
"""
from .schedule import (SCHEDULES, Backward, Forward, RecvActivation, RecvGrad, ScheduleError, SendActivation,
                       SendGrad, Span, Ticks, actions_for, bubble_fraction, chunk_index, chunk_peaks, delivery,
                       diagram, gpipe, interleaved, one_f_one_b, peak_activations, simulate)

__all__ = ["SCHEDULES", "Backward", "Forward", "RecvActivation", "RecvGrad", "ScheduleError", "SendActivation",
           "SendGrad", "Span", "Ticks", "actions_for", "bubble_fraction", "chunk_index", "chunk_peaks", "delivery",
           "diagram", "gpipe", "interleaved", "one_f_one_b", "peak_activations", "simulate"]
