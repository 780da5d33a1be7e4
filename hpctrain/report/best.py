"""--keep-best's record: the best validation accuracy so far and its step.
The report offers every validation to it (and writes the file when one
beats them all); every checkpoint records it (checkpoints/resume.py), and a
resumed run takes it back, so it keeps the file an uninterrupted run keeps.
One object, made before both, given to both.

    mpirun -n 2 python -m hpctrain.mnist --data data/mnist-val --eval-every 50 --keep-best best.h5
"""


class Best:
    def __init__(self, path):
        self.path = path      # --keep-best FILE.h5, or None
        self.value = None     # (val accuracy, step) of the best validation so far

    def resumed(self, ckpt):
        """The best so far from a resumed checkpoint (the chief's; None elsewhere)."""
        if ckpt is not None and ckpt.attrs.get("best_val_step", -1) >= 0:
            self.value = (float(ckpt.attrs["best_val_accuracy"]), int(ckpt.attrs["best_val_step"]))

    def beats(self, val_acc):
        """Whether val_acc is a new best (strictly: a tie keeps the earlier, smaller step)."""
        return bool(self.path) and (self.value is None or val_acc > self.value[0])

    def take(self, val_acc, step):
        self.value = (float(val_acc), int(step))

    def checkpoint_attrs(self):
        """What a checkpoint records of it (with --keep-best only: other checkpoints stay as they were)."""
        if not self.path:
            return {}
        acc, step = self.value if self.value is not None else (-1.0, -1)
        return {"best_val_accuracy": acc, "best_val_step": step}
