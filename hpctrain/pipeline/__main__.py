"""python -m hpctrain.pipeline [--stages 2] [--micro-batches 4] [--virtual-stages 2] [--forward-ticks 1]
[--backward-ticks 1]: every schedule's tick diagram, step length, activation peaks per stage and bubble
(schedule.main)."""
import sys

from .schedule import main

sys.exit(main())
