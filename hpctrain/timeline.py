"""Chrome-trace timeline of the chief's steps (the format Horovod's timeline
uses; open the file in https://ui.perfetto.dev or chrome://tracing).

Spans are complete events ("ph": "X") with microsecond timestamps, one track
(tid) per thread, so a communication thread's bucket allreduces show beside
backprop. Disabled, every call is a no-op costing one attribute lookup.

    mpirun -n 2 python -m hpctrain.mnist --steps 20 --timeline /tmp/t.json
"""
import contextlib
import json
import os
import threading
import time

from .outputs import temp_next_to


class _Span:
    __slots__ = ("tl", "name", "cat", "args", "t0")

    def __init__(self, tl, name, cat, args):
        self.tl, self.name, self.cat, self.args = tl, name, cat, args

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.tl.add(self.name, self.cat, self.t0, time.perf_counter(), self.args)
        return False


# Disabled: nullcontext is reentrant and shareable, one instance serves every span.
_NO_SPAN = contextlib.nullcontext()


class Timeline:
    def __init__(self, path=None, process_name="hpctrain"):
        self.path = path
        self.enabled = path is not None
        self._events = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._tids = {}
        self._process_name = process_name

    def span(self, name, cat="step", **args):
        """with timeline.span("backward", cat="compute"): ..."""
        if not self.enabled:
            return _NO_SPAN
        return _Span(self, name, cat, args or None)

    def model_hooks(self, t_start, on_layer_done):
        """Callbacks for MLP.forward_backward that record a "forward" span and
        one "backward layerI" span per layer, then call on_layer_done(i).
        Disabled: on_layer_done itself and no forward hook (nothing added per step)."""
        if not self.enabled:
            return None, on_layer_done
        last = [t_start]

        def forward_done():
            now = time.perf_counter()
            self.add("forward", "compute", last[0], now)
            last[0] = now

        def layer_done(i):
            now = time.perf_counter()
            self.add(f"backward layer{i}", "compute", last[0], now)
            last[0] = now
            if on_layer_done is not None:
                on_layer_done(i)
        return forward_done, layer_done

    def add(self, name, cat, t_start, t_end, args=None):
        """Record a span measured elsewhere (perf_counter seconds)."""
        if not self.enabled:
            return
        ident = threading.get_ident()
        event = {"name": name, "cat": cat, "ph": "X", "pid": 0,
                 "tid": self._tids.setdefault(ident, len(self._tids)),
                 "ts": round((t_start - self._t0) * 1e6, 1),
                 "dur": round((t_end - t_start) * 1e6, 1)}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    def write(self):
        """Write the trace atomically (temporary file, then rename)."""
        if not self.enabled:
            return
        names = {tid: ("main" if tid == 0 else f"thread {tid}") for tid in self._tids.values()}
        meta = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": self._process_name}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": n}}
                 for tid, n in names.items()]
        fd, tmp = temp_next_to(self.path)   # exclusive, unpredictable: no planted symlink followed
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"traceEvents": meta + self._events, "displayTimeUnit": "ms"}, f)
            os.replace(tmp, self.path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
