"""python -m hpctrain.nn [--hidden 500,500]: the MLP's spec (layers, shapes, buffer layout)."""
import argparse

from .zoo import mlp

parser = argparse.ArgumentParser(prog="python -m hpctrain.nn", description=__doc__)
parser.add_argument("--hidden", default="500,500")
args = parser.parse_args()
spec = mlp(hidden=[int(w) for w in args.hidden.split(",") if w])
print("\n".join(spec.summary()))
for name, lo, hi in spec.tensor_ranges():
    print(f"{name:10s} [{lo:>7}, {hi:>7})  {hi - lo:>7} floats")
