"""Statistics of one parameter server (updates, dropped gradients, staleness),
their wire form (a float64 array sent with the final reply, layout in
protocol.py), and the summary the final metrics record carries.

    python -c "from hpctrain.comm.ps.stats import ServerStats; print(ServerStats(2).to_array(0, 10))"
"""
import numpy as np

from .protocol import (HIST_BINS, S_AFTER_STOP, S_ELEMENTS, S_FIXED, S_ST_COUNT, S_ST_MAX, S_ST_SUM, S_STALE,
                       S_TIMES, S_UPDATES, S_VERSION, T_NAMES, stats_length)


class ServerStats:
    """Counts one server keeps; each gradient is counted where it is decided."""

    def __init__(self, num_workers):
        self.num_workers = num_workers
        self.updates = self.stale_dropped = self.after_stop = 0
        self.st_sum = self.st_count = self.st_max = 0
        self.pushes = np.zeros(num_workers, np.int64)
        self.dropped = np.zeros(num_workers, np.int64)
        self.hist = np.zeros(HIST_BINS, np.int64)
        self.abandoned = np.zeros(num_workers, np.int64)
        # Seconds per activity of the server's loop (T_NAMES): where a round goes.
        self.times = dict.fromkeys(T_NAMES, 0.0)

    def drop(self, worker, stale=True):
        """A gradient not applied: stale (counted per worker) or past the end."""
        if stale:
            self.stale_dropped += 1
            self.dropped[worker] += 1
        else:
            self.after_stop += 1

    def applied(self, staleness, count=1):
        self.st_sum += staleness * count
        self.st_count += count
        self.st_max = max(self.st_max, staleness)
        self.hist[min(max(staleness, 0), HIST_BINS - 1)] += count

    def to_array(self, version, elements):
        out = np.zeros(stats_length(self.num_workers), np.float64)
        out[S_VERSION], out[S_UPDATES], out[S_STALE], out[S_AFTER_STOP] = (version, self.updates,
                                                                          self.stale_dropped, self.after_stop)
        out[S_ST_SUM], out[S_ST_COUNT], out[S_ST_MAX], out[S_ELEMENTS] = (self.st_sum, self.st_count,
                                                                         self.st_max, elements)
        out[S_TIMES: S_FIXED] = [self.times[name] for name in T_NAMES]
        workers = self.num_workers
        out[S_FIXED: S_FIXED + workers] = self.pushes
        out[S_FIXED + workers: S_FIXED + 2 * workers] = self.dropped
        out[S_FIXED + 2 * workers: S_FIXED + 3 * workers] = self.abandoned
        out[S_FIXED + 3 * workers:] = self.hist
        return out


def summarize(stats, num_workers):
    """Final statistics of all servers (rows from Client.final) as a dict: the
    leader's counts (each gradient counted once, as its worker sees it) plus
    per-server lists."""
    workers = num_workers
    lead = stats[0]
    hist = lead[S_FIXED + 3 * workers:].astype(np.int64).tolist()
    while len(hist) > 1 and hist[-1] == 0:
        hist.pop()
    count = lead[S_ST_COUNT]
    return {
        "updates": int(lead[S_UPDATES]),
        "stale_dropped": int(lead[S_STALE]),
        "after_stop_dropped": int(lead[S_AFTER_STOP]),
        "staleness_mean": round(float(lead[S_ST_SUM] / count), 4) if count else 0.0,
        "staleness_max": int(lead[S_ST_MAX]),
        "staleness_histogram": hist,
        "pushes_by_worker": lead[S_FIXED: S_FIXED + workers].astype(np.int64).tolist(),
        "dropped_by_worker": lead[S_FIXED + workers: S_FIXED + 2 * workers].astype(np.int64).tolist(),
        # any server's: each leaves behind the workers it waited for in vain
        "abandoned_workers": [int(w) for w in np.flatnonzero(stats[:, S_FIXED + 2 * workers: S_FIXED + 3 * workers]
                                                            .max(axis=0))],
        "ps_versions": stats[:, S_VERSION].astype(np.int64).tolist(),
        "ps_updates": stats[:, S_UPDATES].astype(np.int64).tolist(),
        "ps_stale_dropped": stats[:, S_STALE].astype(np.int64).tolist(),
        "ps_elements": stats[:, S_ELEMENTS].astype(np.int64).tolist(),
        # per server, seconds of its loop: waiting for requests (idle), summing
        # gradients, the optimizer, starting replies, waiting for replies to drain
        "ps_time_s": [{name: round(float(row[S_TIMES + i]), 4) for i, name in enumerate(T_NAMES)}
                      for row in stats],
    }
