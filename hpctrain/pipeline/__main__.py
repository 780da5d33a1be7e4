"""python -m hpctrain.pipeline [--stages 2] [--micro-batches 4] [--forward-ticks 1] [--backward-ticks 1]:
both schedules' tick diagrams, step length, activation peaks per stage and bubble (schedule.main)."""
from .schedule import main

main()
