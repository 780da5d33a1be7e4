"""Per-step timings and memory, summarised into the final metrics record so
`python -m hpctrain.bench train` can report medians without a timeline.

A step's time splits into compute (forward and backward on the main thread)
and wait (the main thread blocked after backprop), and the wait into
communication and optimizer work that overlap did not hide behind backprop.
optimizer_total counts all update time, hidden or not.
"""
import os
import resource

import numpy as np

# Keep the last this-many steps: enough for stable medians, bounded memory.
CAPACITY = 20000


def rss_bytes():
    """Resident memory of this process now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class StepStats:
    FIELDS = ("step", "compute", "wait", "comm_exposed", "optimizer_exposed", "optimizer_total")

    def __init__(self):
        self.base_rss = rss_bytes()
        self.trained_rss = None   # the high-water mark as the training loop ended (before the final evaluation)
        self._rows = np.zeros((CAPACITY, len(self.FIELDS)))
        self._n = 0

    def record(self, step_s, compute_s, wait_s, comm_exposed_s, optimizer_exposed_s, optimizer_total_s):
        self._rows[self._n % CAPACITY] = (step_s, compute_s, wait_s, comm_exposed_s,
                                          optimizer_exposed_s, optimizer_total_s)
        self._n += 1

    def training_ended(self):
        """The training loop is over: its high-water mark, before the final evaluation's batches."""
        self.trained_rss = peak_rss_bytes()

    def summary(self, warmup_fraction=0.1):
        """Medians over the steps after warm-up (seconds), and memory (bytes)."""
        n = min(self._n, CAPACITY)
        skip = int(self._n * warmup_fraction) if self._n <= CAPACITY else 0
        rows = self._rows[:n][skip:] if n else self._rows[:0]
        out = {"peak_rss_bytes": peak_rss_bytes(), "base_rss_bytes": self.base_rss,
               "trained_rss_bytes": self.trained_rss or peak_rss_bytes()}
        if len(rows):
            for i, name in enumerate(self.FIELDS):
                out[f"{name}_median_s"] = float(np.median(rows[:, i]))
        return out
