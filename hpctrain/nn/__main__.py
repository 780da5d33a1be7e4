"""python -m hpctrain.nn [--model NAME] [--shape 28,28] [--classes 10] [--hidden 500,500]:
a zoo model's spec (layers, output shapes, parameters, buffer layout)."""
import argparse

from .zoo import MODELS, mlp

parser = argparse.ArgumentParser(prog="python -m hpctrain.nn", description=__doc__)
parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
parser.add_argument("--shape", default="28,28", help="image shape, e.g. 32,32,3 (default: %(default)s)")
parser.add_argument("--classes", type=int, default=10)
parser.add_argument("--hidden", default="500,500", help="the mlp's widths")
args = parser.parse_args()
shape = tuple(int(d) for d in args.shape.split(","))
if args.model == "mlp":
    spec = mlp(shape, args.classes, hidden=[int(w) for w in args.hidden.split(",") if w])
else:
    spec = MODELS[args.model](shape, args.classes)
print("\n".join(spec.summary()))
for name, lo, hi in spec.tensor_ranges():
    print(f"{name:10s} [{lo:>7}, {hi:>7})  {hi - lo:>7} floats")
