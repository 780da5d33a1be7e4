"""The --timeline trace (hpctrain/timeline.py): streamed to its temporary
file as it grows, so memory stays bounded over a long run, and renamed into
place whole at the end.

    .venv/bin/python -m pytest -q tests/test_timeline.py
"""
import json
import os
import threading
import time
import tracemalloc

from hpctrain.report import timeline
from hpctrain.report.timeline import Timeline


def spans(tl, n, name="step"):
    t = time.perf_counter()
    for i in range(n):
        tl.add(name, "step", t, t + 1e-6, {"step": i + 1})


def test_memory_stays_bounded_over_many_events_and_the_trace_holds_them_all(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    spans(tl, 100)   # the temporary file is open: what follows is the steady state
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        spans(tl, 10 * timeline.FLUSH_EVERY)
        t = threading.Thread(target=spans, args=(tl, 2 * timeline.FLUSH_EVERY, "allreduce"))
        t.start()
        t.join()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    # Held in memory: FLUSH_EVERY events at most (~0.3 KB each), not 12,100 of them.
    assert grown < 2 * timeline.FLUSH_EVERY * 400, grown
    tl.write()
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    steps = [e for e in events if e["ph"] == "X"]
    assert len(steps) == 100 + 12 * timeline.FLUSH_EVERY
    assert sum(e["name"] == "allreduce" for e in steps) == 2 * timeline.FLUSH_EVERY
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {"main", "thread 1"} and trace["displayTimeUnit"] == "ms"
    assert os.listdir(tmp_path) == ["t.json"]
    spans(tl, 10)   # after write: nothing more, no new temporary
    assert os.listdir(tmp_path) == ["t.json"]


def test_a_short_trace_is_valid_and_a_discarded_one_leaves_nothing(tmp_path):
    short = Timeline(str(tmp_path / "short.json"))
    with short.span("data", cat="data"):
        pass
    short.write()
    assert sorted(e["name"] for e in json.loads((tmp_path / "short.json").read_text())["traceEvents"]) == \
        ["data", "process_name", "thread_name"]
    stopped = Timeline(str(tmp_path / "stopped.json"))
    spans(stopped, timeline.FLUSH_EVERY + 1)
    assert any(n.startswith(".stopped.json.tmp-") for n in os.listdir(tmp_path))
    stopped.discard()
    assert os.listdir(tmp_path) == ["short.json"]
