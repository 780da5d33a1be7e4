"""python -m hpctrain.pipeline [--stages 2] [--micro-batches 4] [--forward-ticks 1] [--backward-ticks 1]:
both schedules' tick diagrams, step length, activation peaks per stage and bubble."""
import argparse

from .schedule import SCHEDULES, bubble_fraction, diagram, simulate

parser = argparse.ArgumentParser(prog="python -m hpctrain.pipeline", description=__doc__)
parser.add_argument("--stages", type=int, default=2, help="pipeline stages P (default: %(default)s)")
parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches M (default: %(default)s)")
parser.add_argument("--forward-ticks", type=int, default=1, help="ticks a forward takes (default: %(default)s)")
parser.add_argument("--backward-ticks", type=int, default=1, help="ticks a backward takes (default: %(default)s)")
args = parser.parse_args()
P, M = args.stages, args.micro_batches
try:
    for name, schedule in SCHEDULES.items():
        timeline = simulate(schedule, P, M, args.forward_ticks, args.backward_ticks)
        print(f"{name}\n{diagram(timeline)}\n{timeline.ticks} ticks, "
              f"activation sets held per stage {list(timeline.activations)}\n")
    print(f"bubble (P - 1)/(M + P - 1) = {bubble_fraction(P, M):.3f}")
except ValueError as e:
    parser.error(str(e))
