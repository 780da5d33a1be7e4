"""Chrome-trace timeline of the chief's steps (the format Horovod's timeline
uses; open the file in https://ui.perfetto.dev or chrome://tracing).

Spans are complete events ("ph": "X") with microsecond timestamps, one track
(tid) per thread, so a communication thread's bucket allreduces show beside
backprop; spans another rank measured (the pipeline's stages,
pipeline/trace.py) go to a process (pid) of that rank's own, merged into the
chief's one file. Disabled, every call is a no-op costing one attribute lookup;
past --timeline-steps steps too (the trace of the steps before is written).

Streamed: at most FLUSH_EVERY events are held in memory; the rest are in an
exclusive temporary file next to the trace (files.temp_name_next_to), renamed
into place whole by write() at the end, so a job of millions of steps holds
no more than a short one, and the trace is never half-written. A run that
ends before write() removes the temporary (discard()); a killed one's is
swept at the next start. A trace that cannot be written (a full disk) is a
warning: the run goes on without it.

    mpirun -n 2 python -m hpctrain.mnist --steps 20 --timeline /tmp/t.json
"""
import contextlib
import json
import os
import sys
import threading
import time

from ..base.files import create_new, one_line, temp_name_next_to

# Events held in memory before they go to the file: ~0.3 MB.
FLUSH_EVERY = 1000


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
NO_SPAN = contextlib.nullcontext()


class Timeline:
    def __init__(self, path=None, process_name="hpctrain", steps=0):
        """steps: the steps it records (--timeline-steps; 0: every one); the
        trace of those is written at the end all the same."""
        self.path = path
        self.enabled = path is not None   # a trace is written at the end
        self.recording = self.enabled     # spans are added: until `steps` steps have ended
        self._steps, self._done = int(steps), 0
        self._events = []   # not yet in the file
        self._file = None   # the temporary file, once the first events are in it
        self._tmp = None
        self._written = 0   # events in the file
        self.written = False   # the trace is in place at path (write)
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._tids = {}
        self._processes = {0: {"name": process_name}}

    def step_ended(self):
        """One more step of the run has ended (frame.Frame.timed): past
        --timeline-steps, nothing more is recorded."""
        self._done += 1
        if self._steps and self._done >= self._steps:
            self.recording = False

    def span(self, name, cat="step", **args):
        """with timeline.span("backward", cat="compute"): ..."""
        if not self.recording:
            return NO_SPAN
        return _Span(self, name, cat, args or None)

    def model_hooks(self, t_start, on_layer_done, on_forward_done=None):
        """Callbacks for a model's forward_backward that record a "forward" span
        and one "backward layerI" span per layer, then call on_forward_done()
        and on_layer_done(i). Disabled: those two themselves (nothing added per step)."""
        if not self.recording:
            return on_forward_done, on_layer_done
        last = [t_start]

        def forward_done():
            now = time.perf_counter()
            self.add("forward", "compute", last[0], now)
            last[0] = now
            if on_forward_done is not None:
                on_forward_done()

        def layer_done(i):
            now = time.perf_counter()
            self.add(f"backward layer{i}", "compute", last[0], now)
            last[0] = now
            if on_layer_done is not None:
                on_layer_done(i)
        return forward_done, layer_done

    def add(self, name, cat, t_start, t_end, args=None, pid=0):
        """Record a span measured elsewhere (perf_counter seconds); `pid`: the
        process it goes to (another rank's, named by name_process)."""
        if not self.recording:
            return
        ident = threading.get_ident()
        event = {"name": name, "cat": cat, "ph": "X", "pid": pid,
                 "tid": self._tids.setdefault(ident, len(self._tids)),
                 "ts": round((t_start - self._t0) * 1e6, 1),
                 "dur": round((t_end - t_start) * 1e6, 1)}
        if args:
            event["args"] = args
        with self._lock:
            if not self.recording:
                return   # written, discarded or given up since the check above
            self._events.append(event)
            if len(self._events) >= FLUSH_EVERY:
                self._flush()

    def name_process(self, pid, name, **args):
        """The name (and any further args) that process `pid`'s metadata event carries."""
        self._processes[pid] = {"name": name, **args}

    def _flush(self):
        """Under the lock: the events held so far to the temporary file."""
        events, self._events = self._events, []
        try:
            if self._file is None:
                # Exclusive, unpredictable: no planted symlink followed.
                self._tmp = temp_name_next_to(self.path)   # held before the file exists: discard() finds it
                self._file = os.fdopen(create_new(self._tmp), "w")
                self._file.write('{"traceEvents": [\n')
            sep = ",\n" if self._written else ""
            self._file.write(sep + json.dumps(events)[1:-1])   # one encoder call per chunk: no brackets
            self._written += len(events)
        except OSError as e:
            self._give_up(e)

    def write(self):
        """Finish the trace and rename it into place. Nothing is added after."""
        if not self.enabled:
            return
        names = {tid: ("main" if tid == 0 else f"thread {tid}") for tid in self._tids.values()}
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": args} for pid, args in self._processes.items()]
        meta += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": n}}
                 for tid, n in names.items()]
        with self._lock:
            self._events += meta
            self._flush()
            if not self.enabled:
                return   # _flush gave up
            self.enabled = self.recording = False
            try:
                self._file.write('\n], "displayTimeUnit": "ms"}\n')
                self._file.close()
                os.replace(self._tmp, self.path)
                self._tmp = None
                self.written = True
            except OSError as e:
                self._give_up(e)
            finally:
                self._discard()

    def _give_up(self, error):
        self.enabled = self.recording = False
        self._discard()
        print(f"hpctrain: warning: --timeline {self.path}: cannot write ({one_line(error)}); no timeline is "
              f"written, the run goes on", file=sys.stderr, flush=True)

    def discard(self):
        """Remove the temporary file of a trace that was not written (the run
        ended otherwise): every exit path calls it; after write() a no-op."""
        with self._lock:
            self.enabled = self.recording = False
            self._discard()

    def _discard(self):
        self._events = []
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass
            self._tmp = None
