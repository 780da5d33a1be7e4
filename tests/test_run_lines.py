"""What a run says when it starts and when it ends: the start-up lines name
only what this run uses (no CuPy hint on a CPU run, counts in the singular
where there is one, the compiled kernels its layers run), say that
--augment and --tensorboard are on, and the run ends with one line per file
it wrote.

    python -m pytest -q tests/test_run_lines.py
"""
import json
import os
import re

import pytest

from hpctrain.data import bundled_sample_dir, prepare
from hpctrain.report.report import tensorboard_view

pytestmark = pytest.mark.usefixtures("job")

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "custom_model.py")


@pytest.fixture(scope="module")
def val_data(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("val") / "mnist-val")
    prepare(bundled_sample_dir(), out, shards=2, log=None, val_fraction=0.1)
    return out


def test_a_cpu_run_of_one_worker_says_what_it_uses(job):
    """One worker, one epoch, an MLP of the user's with compiled layers on:
    no CuPy install hint, no "0 ps", no "1 epochs", no convolution kernels."""
    pytest.importorskip("numba")
    r = job(1, "--device", "auto", "--epochs", "1", "--batch-size", "900", "--log-every", "5",
            "--model", f"{EXAMPLE}:build", "--compiled-layers", "on")
    assert r.returncode == 0, r.stderr
    assert "pip install" not in r.stdout and "cupy-cuda" not in r.stdout, r.stdout
    assert "world size 1 (1 worker), ZeRO stage 0 (nothing sharded, the default), device cpu" in r.stdout, r.stdout
    assert "steps: 1 epoch of 4500 samples at 1 worker x 900 = 5 steps" in r.stdout, r.stdout
    layers = [line for line in r.stdout.splitlines() if line.startswith("layers:")]
    assert layers == ["layers: NumPy (no layer of this model has a compiled kernel)"], r.stdout


def test_a_small_cnn_names_the_kernels_it_runs(job):
    pytest.importorskip("numba")
    r = job(2, "--model", "small_cnn", "--steps", "1", "--batch-size", "8", "--compiled-layers", "on",
            "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "(2 workers)" in r.stdout, r.stdout
    layers = [line for line in r.stdout.splitlines() if line.startswith("layers:")]
    assert len(layers) == 1 and "direct convolutions" in layers[0] and "max pooling" in layers[0], layers
    assert "batch norm" not in layers[0], layers   # small_cnn has none


def test_the_run_ends_with_one_line_per_file_written(job, tmp_path, val_data):
    """--save, --keep-best (which step), the last checkpoint, --metrics,
    --tensorboard, --timeline: each named once at the end, after the
    result; --augment and --tensorboard said on at the start."""
    pytest.importorskip("tensorboardX")
    save, best, metrics, board, trace, ckpt = (tmp_path / n for n in ("p.h5", "best.h5", "m.jsonl", "tb",
                                                                      "t.json", "ckpt"))
    r = job(2, "--data", val_data, "--steps", "20", "--log-every", "10", "--eval-every", "10",
            "--save", save, "--keep-best", best, "--metrics", metrics, "--tensorboard", board,
            "--timeline", trace, "--checkpoint-dir", ckpt, "--checkpoint-every", "10", "--augment", "crop,flip")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "augment: random 28x28 crops of the image padded by 3 px, left-right flips of half the images; " \
           "training batches only (test and val sets as they are)" in lines, r.stdout
    assert f"tensorboard: the --metrics records as scalars in {board} ({tensorboard_view(board)})" in lines
    end = lines[[i for i, line in enumerate(lines) if line.startswith("test accuracy")][-1] + 1:]
    final = json.loads(metrics.read_text().splitlines()[-1])
    kept = [json.loads(s) for s in metrics.read_text().splitlines() if '"val_accuracy"' in s]
    best_step = max(kept, key=lambda m: (m["val_accuracy"], -m.get("step", m.get("steps"))))
    best_step = best_step.get("step", best_step.get("steps"))
    newest = sorted(os.listdir(ckpt))[-1]
    assert end[0] == f"wrote --save {save} (the parameters after step 20)", r.stdout
    assert re.fullmatch(rf"wrote --keep-best {best} \(the parameters after step {best_step}: the best val "
                        rf"accuracy, 0\.\d{{4}}\)", end[1]), (end, best_step)
    assert end[2] == f"last checkpoint {ckpt / newest} (step 20)", end
    assert end[3:] == [f"wrote --metrics {metrics} (the final record last)",
                       f"wrote --tensorboard {board} ({tensorboard_view(board)})",
                       f"wrote --timeline {trace}"], end
    assert final["event"] == "final" and trace.exists() and best.exists()


def test_a_run_without_output_files_names_none(job):
    r = job(2, "--steps", "2", "--log-every", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].startswith("test accuracy"), r.stdout


def test_async_workers_progress_lines_stay_whole_unbuffered(job):
    """Two async ps workers print their own progress lines; unbuffered
    (PYTHONUNBUFFERED, which many images set) a line's text and newline went
    out in two writes and the launcher put the other worker's line between
    them. Every line is whole: one worker's, ending where it should."""
    r = job(3, "--mode", "ps", "--num-ps", "1", "--async", "--steps", "400", "--log-every", "1",
            "--batch-size", "8", "--hidden", "32", env={"PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stderr
    progress = [line for line in r.stdout.splitlines() if "step " in line and "loss" in line
                and not line.startswith("test accuracy")]
    assert len(progress) > 300, r.stdout
    broken = [line for line in progress
              if not re.fullmatch(r"worker [01]: step +\d+/400  loss [^w]*\(local step \d+\)", line)]
    assert not broken, broken[:3]


def test_the_start_line_counts_the_workers_the_data_is_dealt_over():
    # Issue 54, 10: at --tensor-parallel 2 on 4 ranks it said "4 workers"; the data goes to 2.
    from hpctrain.flags import cli
    from hpctrain.run.startup import workers_said
    assert workers_said(cli.parse(["--tensor-parallel", "2"]), 4, 4) == "2 workers x --tensor-parallel 2"
    assert workers_said(cli.parse(["--tensor-parallel", "2"]), 2, 2) == "1 worker x --tensor-parallel 2"
    assert (workers_said(cli.parse(["--tensor-parallel", "2", "--pipeline-stages", "2"]), 8, 8)
            == "2 workers x --pipeline-stages 2 x --tensor-parallel 2")
    assert workers_said(cli.parse([]), 3, 3) == "3 workers"


def test_a_resume_on_more_workers_counts_one_worker_as_one():
    # Issue 54, 10: "written with 1 workers".
    from types import SimpleNamespace
    from hpctrain.checkpoints.resume import resumed_line
    plan = SimpleNamespace(data=SimpleNamespace(workers=2), epochs=None, schedule=SimpleNamespace(scale_lr=False))
    resume = SimpleNamespace(step=5, checkpoint=SimpleNamespace(attrs={"num_workers": 1}, data_positions=[[0, 40]]))
    line = resumed_line(plan, "ckpt-00000005.h5", resume, 10)
    assert "; written with 1 worker, this run has 2: the rest of epoch 0 (from sample 40) is dealt over 2 workers" \
        in line, line
