"""Pictures (hpctrain.plot): real runs' --metrics files drawn as valid PNGs of
the expected size, the drawn series equal to the records, bad input refused
in one line, and the progress line's ETA.

    .venv/bin/python -m pytest -q tests/test_plot.py
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, run_job, under_mpirun

pytest.importorskip("matplotlib", reason="the plot extra: pip install -e '.[plot]'")
from matplotlib.image import imread  # noqa: E402

from hpctrain import plot  # noqa: E402
from hpctrain.report.report import eta_text

pytestmark = pytest.mark.skipif(under_mpirun(), reason="launches its own mpirun jobs")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 20


def assert_png(path, size_inches):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    height, width = imread(path).shape[:2]
    assert (width, height) == (round(size_inches[0] * plot.DPI), round(size_inches[1] * plot.DPI))


def records(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-rank ring run and a 3-rank async ps run (1 server, 2 workers)."""
    tmp = tmp_path_factory.mktemp("runs")
    common = ["--steps", STEPS, "--hidden", "64", "--log-every", "5", "--eval-every", "10"]
    out = {}
    for name, n, flags in [("ring", 2, ["--mode", "ring"]), ("ps", 3, ["--mode", "ps", "--num-ps", "1", "--async"])]:
        path = tmp / f"{name}.jsonl"
        r = run_job(n, *common, *flags, "--metrics", path, timeout=120)
        assert r.returncode == 0, r.stderr
        out[name] = (path, r.stdout)
    return out


def test_progress_lines_end_with_an_eta(runs):
    for name, (_, stdout) in runs.items():
        lines = [line for line in stdout.splitlines() if re.match(r"(worker \d+: )?step +\d+/", line)
                 and "loss" in line and "test" not in line]
        assert lines, stdout
        for line in lines:
            assert re.search(r"  elapsed [\d.]+s  eta (\d+h\d\dm|\d+m\d\ds|\d+s|\?)( |$)", line), line
        assert lines[-1].split("elapsed")[1].split()[1:3] == ["eta", "0s"], lines[-1]
    # Not a metrics field: records stay what the resume and bench code compare.
    assert all("eta" not in r for r in records(runs["ring"][0]))


def test_eta_text():
    assert [eta_text(s) for s in (0, 42.4, 83, 3599, 7500)] == ["0s", "42s", "1m23s", "59m59s", "2h05m"]


def test_run_plot_series_are_the_records(runs, tmp_path):
    ring_path, ps_path = runs["ring"][0], runs["ps"][0]
    out = tmp_path / "run.png"
    drawn = plot.plot_runs([plot.read_run(ring_path), plot.read_run(ps_path, "async ps")], out)
    assert_png(out, plot.RUN_SIZE)
    for label, path in [("ring", ring_path), ("async ps", ps_path)]:
        recs = records(path)
        steps = [r for r in recs if "event" not in r]
        evals = [r for r in recs if r.get("event") == "eval"]
        final = recs[-1]
        assert final["event"] == "final" and [r["step"] for r in steps][-1] == STEPS
        x, y = drawn[f"loss/{label}"]
        assert x.tolist() == [r["step"] for r in steps] and y.tolist() == [r["loss"] for r in steps]
        x, y = drawn[f"samples_per_s/{label}"]
        assert y.tolist() == [r["samples_per_s"] for r in steps]
        x, y = drawn[f"loss_vs_time/{label}"]
        assert x.tolist() == [r["time_s"] for r in steps]
        x, y = drawn[f"test_accuracy/{label}"]
        assert x.tolist() == [r["step"] for r in evals] + [final["steps"]]
        assert y.tolist() == [r["test_accuracy"] for r in evals] + [final["test_accuracy"]]
    hist = records(ps_path)[-1]["staleness_histogram"]
    bins, counts = drawn["staleness/async ps"]
    assert list(bins) == list(range(len(hist))) and counts.tolist() == hist and sum(hist) > 0
    assert "staleness/ring" not in drawn


def test_plot_command_writes_a_png_with_labels(runs, tmp_path):
    out = tmp_path / "run.png"
    r = subprocess.run([sys.executable, "-m", "hpctrain.plot", runs["ring"][0], runs["ps"][0], "-o", out,
                        "--label", "ring 2", "--label", "ps async"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == f"wrote {out}\n"
    assert_png(out, plot.RUN_SIZE)


def test_resumed_torn_and_summary_only_files(tmp_path):
    # A resumed run's clock restarts, a killed writer leaves half a line, an
    # older ps file holds only the staleness summary.
    path = tmp_path / "old.jsonl"
    lines = [{"step": 10, "loss": 2.0, "samples_per_s": 100.0, "time_s": 5.0},
             {"step": 20, "loss": 1.5, "samples_per_s": 110.0, "time_s": 9.0},
             {"step": 30, "loss": 1.2, "samples_per_s": 120.0, "time_s": 4.0},
             {"event": "final", "mode": "ps", "sync": False, "steps": 30, "test_accuracy": 0.5,
              "staleness_mean": 1.5, "staleness_max": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 40, "lo')
    run = plot.read_run(path)
    assert [r["step"] for r in run["steps"]] == [10, 20, 30]
    # What plot_runs draws against wall time, and as the accuracy (the final one alone), and
    # instead of a histogram: the summary, written out.
    assert plot.wall_times(run["steps"]) == [5.0, 9.0, 13.0]
    assert plot.accuracy_points(run) == ([30], [0.5])
    assert plot.staleness(run) == ("summary", 1.5, 4)


def test_bad_input_one_line_and_nonzero(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text('{"step": 1, "loss": 2.0, "samples_per_s": 1.0, "time_s": 0.1}\n')
    (tmp_path / "text.jsonl").write_text("step 1 loss 2.0\n")
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    (tmp_path / "final.jsonl").write_text('{"event": "final", "steps": 0}\n')
    out = tmp_path / "x.png"
    cases = [([tmp_path / "missing.jsonl", "-o", out], "missing.jsonl: no such file"),
             ([good, tmp_path / "text.jsonl", "-o", out], "text.jsonl line 1: not JSON"),
             ([tmp_path / "list.jsonl", "-o", out], "list.jsonl line 1: not a JSON object"),
             ([tmp_path / "final.jsonl", "-o", out], "final.jsonl: no step records"),
             ([good, "-o", out, "--label", "a", "--label", "b"], "--label given 2 times for 1 files"),
             ([good, "-o", tmp_path / "no" / "x.png"], "no such directory")]
    for args, message in cases:
        code = plot.main([str(a) for a in args])   # the function `python -m hpctrain.plot` runs
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("hpctrain: error: "), captured.err
        assert message in lines[0] and captured.out == "", lines[0]
        assert not out.exists()


def test_without_matplotlib_one_line_and_exit_2(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"step": 1, "loss": 2.0, "samples_per_s": 1.0, "time_s": 0.1}\n')
    # None in sys.modules makes `import matplotlib` fail, as on a machine without it.
    hide = "import sys; sys.modules['matplotlib'] = None"
    r = subprocess.run([sys.executable, "-c", hide + "\nfrom hpctrain.plot import main\nsys.exit(main(sys.argv[1:]))",
                        good, "-o", tmp_path / "x.png"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert (r.returncode, r.stderr) == (2, f"hpctrain: error: {plot.INSTALL}\n")
    assert "pip install 'hpctrain[plot]'" in plot.INSTALL
    # The benchmarks say so before measuring, and never import it without --plot.
    prog = (hide + "\nfrom hpctrain.bench.__main__ import main\nimport hpctrain.bench.allreduce, "
            "hpctrain.bench.train, hpctrain.report\nsys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", prog, "allreduce", "--plot", tmp_path / "b.png"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert (r.returncode, r.stderr) == (2, f"hpctrain: error: {plot.INSTALL}\n")


def test_allreduce_plot_series_are_the_rows(tmp_path):
    rows = [{"bytes": b, "ring_busbw": 0.1 * i + 0.05, "mpi_busbw": 0.2 * i + 0.01, "ring_rank_busbw": 0.3}
            for i, b in enumerate([4096, 65536, 1 << 20])]
    result = {"ranks": 2, "nodes": 1, "device": "cpu", "algorithms": ["ring", "ring-rank", "mpi"], "rows": rows}
    drawn = plot.plot_allreduce(result, tmp_path / "b.png")
    assert_png(tmp_path / "b.png", plot.ALLREDUCE_SIZE)
    assert set(drawn) == {"busbw/ring", "busbw/ring-rank", "busbw/mpi"}
    x, y = drawn["busbw/mpi"]
    assert x.tolist() == [4096, 65536, 1 << 20] and np.allclose(y, [0.01, 0.21, 0.41])
    assert [plot.size_text(b) for b in x] == ["4K", "64K", "1M"]


def test_validation_accuracy_is_drawn_beside_the_test_accuracy(tmp_path):
    # Data prepared with --val-fraction: eval and final records carry val_accuracy too.
    path = tmp_path / "val.jsonl"
    lines = [{"step": 10, "loss": 2.0, "samples_per_s": 100.0, "time_s": 1.0},
             {"event": "eval", "step": 10, "test_accuracy": 0.5, "val_accuracy": 0.55},
             {"step": 20, "loss": 1.5, "samples_per_s": 110.0, "time_s": 2.0},
             {"event": "eval", "step": 20, "test_accuracy": 0.6, "val_accuracy": 0.62},
             {"event": "final", "mode": "ring", "steps": 20, "test_accuracy": 0.6, "val_accuracy": 0.62}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = plot.read_run(path)
    assert plot.accuracy_points(run, "val_accuracy") == ([10, 20], [0.55, 0.62])
    drawn = plot.plot_runs([run], tmp_path / "val.png")
    assert drawn["val_accuracy/val"][1].tolist() == [0.55, 0.62]
    assert drawn["test_accuracy/val"][1].tolist() == [0.5, 0.6]
    assert plot.draw_runs([run])[0].axes[1].get_title() == "test accuracy (validation dashed)"
    assert_png(tmp_path / "val.png", plot.RUN_SIZE)


def test_a_language_models_run_draws_its_held_out_loss_tokens_per_s_and_lr(tmp_path):
    """Text runs (records with tokens_per_s): the validation loss per token
    (--eval-every's and the final record's), tokens/s and the records' lr,
    not next-token accuracy and samples/s (issue 54 N3). The final record
    of a --final-eval off run (test_loss null) adds no point."""
    path = tmp_path / "gpt.jsonl"
    lines = [{"step": 10, "loss": 4.0, "samples_per_s": 100.0, "tokens_per_s": 6400.0, "time_s": 1.0, "lr": 1e-3},
             {"event": "eval", "step": 10, "test_accuracy": 0.2, "test_loss": 3.9, "val_accuracy": 0.2,
              "val_loss": 3.9},
             {"step": 20, "loss": 3.0, "samples_per_s": 110.0, "tokens_per_s": 7040.0, "time_s": 2.0, "lr": 5e-4},
             {"event": "final", "mode": "ring", "steps": 20, "test_accuracy": 0.3, "test_loss": 2.9,
              "val_accuracy": 0.3, "val_loss": 2.9, "wall_s": 3.0, "compute_s": 1.5, "comm_s": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    fig, drawn = plot.draw_runs([plot.read_run(path)])
    assert drawn["held_out_loss/gpt"][1].tolist() == [3.9, 2.9]
    assert drawn["tokens_per_s/gpt"][1].tolist() == [6400.0, 7040.0]
    assert (drawn["lr/gpt"][0].tolist(), drawn["lr/gpt"][1].tolist()) == ([10, 20], [1e-3, 5e-4])
    assert not any(k.startswith(("test_accuracy/", "samples_per_s")) for k in drawn), drawn
    titles = [ax.get_title() for ax in fig.axes]
    assert "held-out loss per token" in titles and "learning rate" in titles, titles
    lines[-1].update(test_loss=None, test_accuracy=None, val_loss=None, val_accuracy=None, final_eval="off")
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert plot.draw_runs([plot.read_run(path)])[1]["held_out_loss/gpt"][1].tolist() == [3.9]


def test_output_naming_an_input_and_a_deeply_nested_line_are_one_line(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    record = '{"step": 1, "loss": 2.0, "samples_per_s": 1.0, "time_s": 0.1}\n'
    good.write_text(record)
    (tmp_path / "link.jsonl").symlink_to(good)
    deep = tmp_path / "deep.jsonl"
    deep.write_text(record + "[" * 100000 + "]" * 100000 + "\n" + record)
    cases = [([good, "-o", good], f"-o {good} would overwrite the run's input {good} (a file to plot)"),
             ([good, "-o", tmp_path / "link.jsonl"], "link.jsonl would overwrite the run's input"),
             ([deep, "-o", tmp_path / "x.png"], f"{deep} line 2: not JSON")]
    for args, message in cases:
        code = plot.main([str(a) for a in args])
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("hpctrain: error: "), captured.err
        assert message in lines[0], lines[0]
    assert good.read_text() == record and sorted(os.listdir(tmp_path)) == ["deep.jsonl", "good.jsonl", "link.jsonl"]


def finished(path, steps, **final):
    """A --metrics file of these step records and a final record (its times: wall 10 s, 6 compute, 3 comm)."""
    final = {"event": "final", "mode": "ring", "steps": steps[-1]["step"], "test_accuracy": 0.5, "wall_s": 10.0,
             "compute_s": 6.0, "comm_s": 3.0, **final}
    path.write_text("".join(json.dumps(r) + "\n" for r in steps + [final]))
    return plot.read_run(path)


def test_a_run_of_one_record_shows_as_markers(tmp_path):
    # issue 41, 27: a line through one point drew nothing in every panel
    run = finished(tmp_path / "one.jsonl", [{"step": 1, "loss": 2.0, "samples_per_s": 100.0, "time_s": 0.5}])
    fig, drawn = plot.draw_runs([run])
    panels = fig.axes[:5]
    assert all(len(ax.lines) == 1 and ax.lines[0].get_marker() not in (None, "", "None", " ") for ax in panels)
    assert drawn["loss/one"][1].tolist() == [2.0]


def test_the_sixth_panel_is_every_runs_time_and_its_text_fits(tmp_path):
    # issue 41, 27: the panel was empty unless async ps, its note ran past the
    # figure's edge, and the accuracy panel said "(validation dashed)" with none.
    steps = [{"step": s, "loss": 2.0 / s, "samples_per_s": 100.0, "time_s": s / 10} for s in (10, 20)]
    ring = finished(tmp_path / "ring.jsonl", steps)
    old = finished(tmp_path / "an-older-async-ps-run-with-a-long-name.jsonl", steps, mode="ps", sync=False,
                   staleness_mean=1.5, staleness_max=4)
    stopped = tmp_path / "stopped.jsonl"
    stopped.write_text("".join(json.dumps(r) + "\n" for r in steps))
    fig, drawn = plot.draw_runs([ring, old, plot.read_run(stopped)])
    assert drawn["time/ring"][0] == ["compute", "comm", "other"] and drawn["time/ring"][1].tolist() == [6, 3, 1]
    assert "time/stopped" not in drawn and not any(k.startswith("staleness/") for k in drawn)
    sixth = fig.axes[5]
    assert sixth.get_title() == "where the time went (final record)"
    note = " ".join(t.get_text() for t in sixth.texts)
    assert "stopped: no final record" in note and "staleness mean 1.5, max 4" in note.replace("\n  ", " ")
    assert fig.axes[1].get_title() == "test accuracy"
    fig.canvas.draw()
    inside = fig.bbox
    for text in [t for ax in fig.axes for t in ax.texts] + [ax.title for ax in fig.axes]:
        box = text.get_window_extent()
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1, text.get_text()
