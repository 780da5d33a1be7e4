"""--keep-best's record: the best validation so far and its step. An image
classifier is judged by its validation accuracy; a language model (text
data, a per-token loss whose next-token accuracy says little) by its
validation loss, as nanoGPT keeps its checkpoint. The report offers every
validation to it (and writes the file when one beats them all); every
checkpoint records it (checkpoints/resume.py), and a resumed run takes it
back, so it keeps the file an uninterrupted run keeps. One object, made
before both, given to both.

    mpirun -n 2 python -m hpctrain.mnist --data data/mnist-val --eval-every 50 --keep-best best.h5
"""


class Best:
    def __init__(self, path, by_loss=False):
        self.path = path          # --keep-best FILE.h5, or None
        self.by_loss = by_loss    # lower val loss wins (text), else higher val accuracy
        self.key = "best_val_loss" if by_loss else "best_val_accuracy"
        self.value = None         # (val loss or accuracy, step) of the best validation so far

    @property
    def measure(self):
        """What it compares, as its lines and attributes name it."""
        return "val loss" if self.by_loss else "val accuracy"

    def resumed(self, ckpt):
        """The best so far from a resumed checkpoint (the chief's; None elsewhere)."""
        if ckpt is not None and ckpt.attrs.get("best_val_step", -1) >= 0 and self.key in ckpt.attrs:
            self.value = (float(ckpt.attrs[self.key]), int(ckpt.attrs["best_val_step"]))

    def beats(self, val_loss, val_acc):
        """Whether this validation is a new best (strictly: a tie keeps the earlier, smaller step)."""
        if not self.path:
            return False
        if self.value is None:
            return True
        return val_loss < self.value[0] if self.by_loss else val_acc > self.value[0]

    def take(self, val_loss, val_acc, step):
        self.value = (float(val_loss if self.by_loss else val_acc), int(step))

    def checkpoint_attrs(self):
        """What a checkpoint records of it (with --keep-best only: other checkpoints stay as they were)."""
        if not self.path:
            return {}
        value, step = self.value if self.value is not None else (-1.0, -1)
        return {self.key: value, "best_val_step": step}
