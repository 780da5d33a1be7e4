"""The dtypes of a run, decided once: the precision section of the plan
(run/plan.py `Plan.precision`), handed to whatever allocates or checks a
float array of the model's, instead of a float32 written into each module.

- params: the flat parameter buffer, what --save, --keep-best and the
  checkpoints write, what a ps server keeps;
- grads: the flat gradient buffer, so the gradient wire and its buckets;
- optimizer: the optimizer's state (Adam's m and v, momentum's velocity);
- compute: activations, the arrays layers return, and what pipeline stages
  send each other (their activations and input gradients).

Today every field is float32 (`FLOAT32`, the only precision a run takes:
`--compression fp16/bf16` changes what goes over the wire, not what is kept).
A 16-bit compute with float32 master parameters (mixed precision) becomes a
second constant here. Allocations of the model's floats take their dtype from
the plan, from the array they follow, or from `file_dtype` (what a file holds);
the few float32 literals left elsewhere say why they are fixed.

    python -m hpctrain.base.precision        # the run's precision, as the plan records it
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Precision:
    params: np.dtype
    grads: np.dtype
    optimizer: np.dtype
    compute: np.dtype

    def __post_init__(self):
        for name in ("params", "grads", "optimizer", "compute"):
            object.__setattr__(self, name, np.dtype(getattr(self, name)))

    def record(self):
        """{field: dtype name}: what a checkpoint records of the precision."""
        return {name: getattr(self, name).name for name in ("params", "grads", "optimizer", "compute")}


FLOAT32 = Precision(params=np.float32, grads=np.float32, optimizer=np.float32, compute=np.float32)
PRECISIONS = {"float32": FLOAT32}   # what a run takes, by name (a --precision flag would choose here)

# The parameter dtypes a checkpoint or parameter file may hold: those of the precisions above.
FLOATS = tuple({p.params for p in PRECISIONS.values()})


def draw_dtype(dtype):
    """The dtype an array of `dtype` draws its initial values in: NumPy's
    generators draw float32 and float64 only, so float64 for float64 and
    float32 for every other float (cast after: a 16-bit buffer rounds a
    float32 draw)."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def file_dtype(dtype):
    """The dtype a file holds `dtype` as: little-endian whatever the machine
    ("<f4" for float32), so a checkpoint moves between machines."""
    return np.dtype(dtype).newbyteorder("<")


if __name__ == "__main__":
    print(FLOAT32.record())
