"""The benchmarks and the timeline run and produce what they promise (their
figures are not checked: speed is shown by the benchmarks, never asserted)."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

try:
    from matplotlib.image import imread
    from hpctrain import plot
except ImportError:   # without the plot extra the benchmarks still run, unplotted
    plot = None

from conftest import REPO, under_mpirun

pytestmark = pytest.mark.skipif(under_mpirun(), reason="launches its own mpirun jobs")


def plot_flag(png):
    return ["--plot", png] if plot else []


def assert_plot(png, function, out, same):
    """--plot wrote a PNG of the promised size, and drawing the --json rows
    gives the series they hold (skipped without the plot extra)."""
    if plot is None:
        return
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    size = plot.ALLREDUCE_SIZE if function == "plot_allreduce" else plot.TRAIN_SIZE
    assert imread(png).shape[:2] == (round(size[1] * plot.DPI), round(size[0] * plot.DPI))
    data = out if function == "plot_allreduce" else out["rows"]
    assert same(getattr(plot, function)(data, png.with_name("again.png")))


def bench(*args, timeout=300):
    r = subprocess.run([sys.executable, "-m", "hpctrain.bench", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_bench_allreduce_quick(tmp_path):
    png = tmp_path / "busbw.png"
    out = json.loads(bench("allreduce", "--ranks", "2", "--sizes", "4K,300K", "--json", *plot_flag(png)))
    assert out["ranks"] == 2 and [r["bytes"] for r in out["rows"]] == [4096, 307200]
    for row in out["rows"]:
        assert row["ring_us"] > 0 and row["mpi_us"] > 0 and row["ring_busbw"] > 0
    assert_plot(png, "plot_allreduce", out, lambda drawn: {
        name: (x.tolist(), y.tolist()) for name, (x, y) in drawn.items()} == {
        f"busbw/{a}": ([r["bytes"] for r in out["rows"]], [r[f"{a}_busbw"] for r in out["rows"]])
        for a in ("ring", "mpi")})
    table = bench("allreduce", "--ranks", "2", "--sizes", "4K")
    assert "busbw" in table and "4,096" in table


def test_bench_train_quick_ring_and_ps(tmp_path):
    png = tmp_path / "train.png"
    out = json.loads(bench("train", "--mode", "ring", "--ranks", "1,2", "--steps", "40", "--repeats", "1",
                           "--json", *plot_flag(png), "--", "--hidden", "64"))
    assert [r["ranks"] for r in out["rows"]] == [1, 2]
    for row in out["rows"]:
        assert row["samples_per_s"] > 0 and row["step_ms"] > 0 and row["compute_ms"] > 0
        assert row["peak_mb"] > 0 and row["mem_target_mb"] > 0

    def same(drawn):
        x, y = drawn["samples_per_s/ring"]
        assert x.tolist() == [1, 2] and y.tolist() == [r["samples_per_s"] for r in out["rows"]]
        for key, part in [("compute_ms", "compute"), ("comm_ms", "comm not hidden"),
                          ("optimizer_ms", "optimizer not hidden")]:
            # a stacked bar's height comes back as top - bottom: equal up to rounding
            assert np.allclose(drawn[f"step/{part}"][1], [r[key] for r in out["rows"]], rtol=1e-9, atol=1e-9)
        stacked = sum(drawn[f"step/{part}"][1] for _, part in plot.STEP_PARTS)
        waits = [r["compute_ms"] + max(r["wait_ms"], r["comm_ms"] + r["optimizer_ms"]) for r in out["rows"]]
        assert np.allclose(stacked, waits)
        return True
    assert_plot(png, "plot_train", out, same)
    out = json.loads(bench("train", "--mode", "ps", "--ranks", "3", "--steps", "40", "--repeats", "1",
                           "--json", "--", "--hidden", "64", "--num-ps", "1"))
    assert out["rows"][0]["workers"] == 2 and out["rows"][0]["samples_per_s"] > 0


def test_bench_model_quick():
    out = json.loads(bench("model", "--ranks", "2", "--sizes", "4K,1M", "--json"))
    assert [r["gpus"] for r in out["predicted"]] == [8, 16, 32, 64, 128, 256]
    assert all(r["winner"] in ("ring", "ps") for r in out["predicted"])
    assert out["fitted_here"]["ring_beta_s_per_byte"] > 0


RING_SPANS = {"data", "forward", "backward layer0", "backward layer2", "wait for gradients", "step"}


@pytest.mark.parametrize("mode, extra, must_have, collectives", [
    ("ring", ["--fusion-mb", "0.5", "--overlap", "on", "--shard-optimizer", "off"], RING_SPANS, ["allreduce ["]),
    ("ring", ["--fusion-mb", "0.5", "--overlap", "on"], RING_SPANS, ["reduce-scatter [", "allgather ["]),
    ("ps", ["--num-ps", "1"], {"data", "forward", "backward layer0", "push+pull", "push", "wait for parameters"}, []),
])
def test_timeline_is_a_chrome_trace_with_every_span_kind(job, tmp_path, mode, extra, must_have, collectives):
    path = tmp_path / "t.json"
    r = job(3, "--mode", mode, "--steps", "10", "--timeline", path, *extra)
    assert r.returncode == 0, r.stderr
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    assert must_have <= names, must_have - names
    assert all(e["dur"] >= 0 and {"ts", "pid", "tid", "cat"} <= set(e) for e in spans)
    for kind in collectives:   # sharded by default on CPUs: reduce-scatter + allgather
        assert any(n.startswith(kind) for n in names), kind
    if mode == "ring":
        assert any(n.startswith("optimizer [") for n in names)
        assert sum(e["name"] == "step" for e in spans) == 10


def test_bench_train_compare_two_settings_in_one_run():
    out = json.loads(bench("train", "--ranks", "2", "--steps", "40", "--repeats", "1", "--compare",
                           "shard-optimizer=off,on", "--json", "--", "--hidden", "64"))
    assert [r["setting"] for r in out["rows"]] == ["shard-optimizer=off", "shard-optimizer=on"]
    first, second = out["rows"]
    assert first["speedup"] == 1.0 and second["speedup"] > 0
    assert 1.0 <= first["amdahl_bound"] <= 2.0   # 1 / (1 - f (1 - 1/2)) with 0 <= f <= 1
    assert first["optimizer_ratio"] == 1.0 and second["optimizer_ratio"] > 0


@pytest.mark.skipif(not os.path.exists(os.path.join(REPO, ".git")), reason="needs the repository's history")
def test_bench_train_against_a_commit_runs_both_codes_interleaved(capsys):
    from argparse import Namespace
    from hpctrain.bench.against import report
    from hpctrain.flags.cli import parse
    out = json.loads(bench("train", "--ranks", "2", "--steps", "20", "--repeats", "1", "--against", "HEAD~1",
                           "--json", "--", "--hidden", "32"))
    old, new = out["rows"]
    assert (old["code"], new["code"]) == ("HEAD~1", "this") and old["ranks"] == new["ranks"] == 2
    assert new["x_commit"] == new["samples_per_s"] / old["samples_per_s"] > 0
    assert new["ratio_min"] == new["ratio_max"] == pytest.approx(new["x_commit"])
    # The table without --json: the same report, over the rows this run measured (a second
    # bench run, two more jobs and an archive, would measure nothing this one did not).
    args = Namespace(json=False, mode="ring", steps=20, repeats=1, against="HEAD~1")
    assert report(args, out["rows"], parse(["--mode", "ring", "--hidden", "32"]), ["--hidden", "32"]) == 0
    table = capsys.readouterr().out
    assert "this/commit" in table and len(table.splitlines()) == 5, table


def test_bench_train_against_no_such_commit_is_one_line():
    r = subprocess.run([sys.executable, "-m", "hpctrain.bench", "train", "--ranks", "1", "--against", "no-such-commit"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("hpctrain: error: --against no-such-commit: not a commit") and r.stderr.count("\n") == 1


def test_bench_train_ps_versus_ring_in_one_run():
    out = json.loads(bench("train", "--mode", "ps", "--ranks", "3", "--steps", "30", "--repeats", "1",
                           "--versus-ring", "--json", "--", "--hidden", "64", "--num-ps", "1"))
    ring, sync, asyn = out["rows"]
    assert [r["setting"] for r in out["rows"]] == ["ring", "ps sync", "ps async"]
    assert (ring["ranks"], sync["ranks"], asyn["ranks"]) == (2, 3, 3)
    assert ring["x_ring"] == 1.0 and sync["x_sync"] == 1.0 and asyn["x_ring"] > 0
    for row in (sync, asyn):
        ms = row["server_ms"]
        assert ms["total"] > 0 and ms["idle"] >= 0 and ms["optimizer"] > 0


def test_bench_versus_ring_compares_ps_settings_in_the_same_run():
    out = json.loads(bench("train", "--mode", "ps", "--ranks", "3", "--steps", "20", "--repeats", "1",
                           "--versus-ring", "--compare", "ps-exchange=mpi,auto", "--json", "--",
                           "--hidden", "32", "--num-ps", "1"))
    assert [r["setting"] for r in out["rows"]] == ["ring", "ps sync ps-exchange=mpi", "ps async ps-exchange=mpi",
                                                   "ps sync ps-exchange=auto", "ps async ps-exchange=auto"]
    sync_mpi, sync_auto = out["rows"][1], out["rows"][3]
    assert sync_mpi["x_sync"] == 1.0 and sync_auto["x_sync"] == 1.0 and sync_auto["x_ring"] > 0


def test_ps_is_measured_against_the_unsharded_ring():
    from hpctrain.bench.train import ring_baseline_flags
    assert ring_baseline_flags(["--num-ps", "2", "--hidden", "64", "--async"]) == [
        "--hidden", "64", "--shard-optimizer", "off"]
    assert ring_baseline_flags(["--num-ps=2", "--shard-optimizer", "on"]) == ["--shard-optimizer", "on"]


# Every process a bench starts, wherever its launcher puts it (Hydra starts
# each proxy and rank in a session of its own), inherits this variable.
TAG = "HPCTRAIN_TEST_BENCH"


def tagged(tag):
    """{pid: argv} of this machine's processes whose environment holds TAG=tag."""
    mark = f"{TAG}={tag}\0".encode()
    found = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark in f.read():
                    with open(f"/proc/{name}/cmdline", "rb") as g:
                        found[int(name)] = g.read().decode(errors="replace").split("\0")
        except OSError:
            pass
    return found


def kill_tagged(tag, seconds=20):
    """SIGKILL, by pid, whatever a test's bench left (a regression's fork bomb included)."""
    deadline = time.monotonic() + seconds
    while (pids := tagged(tag)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def wait_for(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def start_bench(tmp_path, *args):
    """The bench in a process of its own, tagged; its temporary files under tmp_path/tmp."""
    tag = uuid.uuid4().hex
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, **{TAG: tag, "TMPDIR": str(tmp_path / "tmp")})
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain.bench", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    return tag, proc


def test_bench_on_one_rank_launches_one_job(tmp_path):
    # A world of one rank has no launcher variable that tells it from a plain
    # process: the bench's rank must not launch again (that was a fork bomb).
    tag, proc = start_bench(tmp_path, "allreduce", "--ranks", "1", "--sizes", "4K", "--json")
    most = 0
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and most <= 10:
            most = max(most, len(tagged(tag)))
            time.sleep(0.02)
    finally:
        kill_tagged(tag)
        out, err = proc.communicate()
    # the bench, mpirun, its proxy, the one rank (and a launcher's fork in passing)
    assert most <= 6, f"{most} processes"
    assert proc.returncode == 0, err[-3000:]
    out = json.loads(out)
    assert out["ranks"] == 1 and out["rows"][0]["mpi_vs_ring"] > 0


@pytest.mark.parametrize("args", [
    ["allreduce", "--ranks", "0"], ["allreduce", "--ranks", "100000"], ["train", "--ranks", "1,0"],
    ["train", "--ranks", "2,100000", "--steps", "1"], ["compare", "--ranks", "100000"], ["model", "--ranks", "1"],
])
def test_a_rank_count_this_machine_cannot_run_is_one_line(args, capsys, monkeypatch):
    from hpctrain.bench.__main__ import main

    def launched(cmd, *a, **k):   # (subprocess.run starts its process through Popen too)
        raise AssertionError(f"launched {cmd}")
    monkeypatch.setattr(subprocess, "Popen", launched)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpctrain: error: --ranks ") and err.count("\n") == 1, err


@pytest.mark.parametrize("args", [
    ["train", "--ranks", "1,x"], ["allreduce", "--ranks", "two"], ["allreduce", "--sizes", "4K,4Q"],
    ["train", "--steps", "0"], ["train", "--repeats", "-1"], ["model", "--link-gbit", "0"],
    ["model", "--overlap", "nan"], ["model", "--link-efficiency", "1.5"], ["frob"], ["allreduce", "--frob"],
    ["train", "--ranks", "1", "--steps", "1", "--", "--frob"], ["train", "--ranks", "1", "--", "--hidden", "x"],
    ["train", "--ranks", "1", "--steps", "1", "--compare", "nonsense"],
    ["train", "--ranks", "1", "--steps", "1", "--compare", "shard-optimizer=off"],
    ["train", "--ranks", "1", "--steps", "1", "--compare", "frob=1,2"],
    ["train", "--ranks", "1", "--steps", "1", "--compare", "shard-optimizer=off,maybe"],
    ["train", "--mode", "ps", "--ranks", "3", "--versus-ring", "--compare", "ps-exchange=mpi,frob", "--",
     "--num-ps", "1"],
    ["pipeline", "--stages", "1"], ["pipeline", "--schedules", "gpipe,frob"], ["pipeline", "--micro-batches", "4,0"],
    ["pipeline", "--schedules", "1f1b,interleaved", "--micro-batches", "3"],
    ["pipeline", "--", "--hidden", "x"], ["compare", "--model", "frob", "--ranks", "1"],
    ["compare", "--model", "gpt:layers=2", "--ranks", "1"], ["compare", "--model", "gpt:layers=1,heads=3,width=8"],
    ["compare", "--model", "lenet", "--block-size", "8", "--ranks", "1"], ["compare", "--batch-size", "8"],
    ["compare", "--model", "gpt:layers=1,heads=2,width=8", "--block-size", "0"],
    ["compare", "--thread-split", "samples", "--ranks", "1"], ["compare", "--blas", "mkl", "--ranks", "1"],
    ["layers", "--model", "small_cnn", "--blas", "mkl"], ["layers", "--model", "lenet", "--block-size", "8"],
    ["layers", "--model", "gpt:layers=1,heads=3,width=8"], ["layers", "--model", "gpt:layers=1,frob=2"],
    ["layers", "--model", "gpt:layers=1,heads=2,width=8", "--threads", "2"],
])
def test_a_bad_bench_argument_is_one_line_before_anything_runs(args, capsys, monkeypatch):
    from hpctrain.bench.__main__ import main

    def launched(cmd, *a, **k):
        raise AssertionError(f"launched {cmd}")
    monkeypatch.setattr(subprocess, "Popen", launched)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpctrain: error: ") and err.count("\n") == 1, err


def test_a_bad_bench_argument_exits_2_without_a_traceback():
    r = subprocess.run([sys.executable, "-m", "hpctrain.bench", "train", "--ranks", "1,x"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("hpctrain: error: argument --ranks: '1,x': want comma-separated whole numbers, "
                        "e.g. 1,2,4 (see --help)\n")


def test_a_run_that_refuses_its_flags_is_its_one_line():
    # a refusal only the job can make (the world size): its line, not a block
    r = subprocess.run([sys.executable, "-m", "hpctrain.bench", "train", "--mode", "ps", "--ranks", "1", "--steps",
                        "1", "--repeats", "1", "--", "--hidden", "8", "--num-ps", "1"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("hpctrain: error: --mode ps with --num-ps 1 needs more than 1 ranks")
    assert "(in: mpirun -n 1 python -m hpctrain.mnist --mode ps " in r.stderr


def test_more_ranks_than_the_cores_can_run_only_when_insisted_on():
    from hpctrain.bench.common import RANKS_PER_CORE, check_ranks
    from hpctrain.base.errors import HpctrainError
    many = RANKS_PER_CORE * os.cpu_count() + 1
    check_ranks([1, many], oversubscribe_ok=True)
    with pytest.raises(HpctrainError, match=f"--ranks {many}: .*--oversubscribe-ok"):
        check_ranks([1, many])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_the_bench_takes_its_mpirun_and_ranks_down(tmp_path, sig):
    tag, proc = start_bench(tmp_path, "train", "--ranks", "2", "--steps", "1000000", "--repeats", "1", "--",
                            "--hidden", "16")

    def ranks():
        return [p for p, argv in tagged(tag).items() if argv[:3] == [sys.executable, "-m", "hpctrain.mnist"]]
    try:
        # Training: the job's start-up lines are out (an mpirun that wrote
        # to a dead bench's pipe would die of it, as this one need not).
        assert wait_for(lambda: any((tmp_path / "tmp").glob("*/m-ring-2.jsonl")), 120), proc.poll()
        assert len(ranks()) == 2
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        gone = wait_for(lambda: not tagged(tag), 20)
        left = tagged(tag)
    finally:
        kill_tagged(tag)
    assert gone, left
    if sig == signal.SIGTERM:   # one line, the shell's code, its temporary folder removed
        assert proc.returncode == 128 + signal.SIGTERM
        assert err == "hpctrain: error: stopped by SIGTERM; its MPI job was taken down\n"
        assert list((tmp_path / "tmp").iterdir()) == []


def test_bench_pipeline_quick_prints_each_stage_against_its_bounds():
    out = bench("pipeline", "--quick").splitlines()
    header = out[2]
    for column in ("bubble", "(P-1)/(M+P-1)", "act held", "bound", "act MB", "bound MB", "params+opt MB",
                   "unpipelined MB", "x unpipelined"):
        assert column in header, header
    names = [c.strip() for c in header.strip("|").split("|")]
    rows = [dict(zip(names, (c.strip() for c in line.strip("|").split("|")))) for line in out[4:]]
    assert [(r["schedule"], r["M"], r["stage"]) for r in rows] == [
        ("gpipe", "2", "0"), ("gpipe", "2", "1"), ("1f1b", "2", "0"), ("1f1b", "2", "1")]
    # the bounds: (P - 1)/(M + P - 1) = 1/3; activations GPipe M, 1F1B min(P - s, M)
    assert [r["(P-1)/(M+P-1)"] for r in rows] == ["0.333"] * 4
    assert [int(r["bound"]) for r in rows] == [2, 2, 2, 1]
    # measured from the order the spans ran in, not their lengths
    assert [int(r["act held"]) for r in rows] == [2, 2, 2, 1]
    # and the model copies holding them: 1F1B's stage 1 allocates one activation set, not M
    assert [int(r["copies"]) for r in rows] == [2, 2, 2, 1]
    for r in rows:
        assert 0 <= float(r["bubble"]) < 1
    # each stage holds its slice of the parameters and the optimizer state: together the whole model's
    assert abs(float(rows[0]["x unpipelined"]) + float(rows[1]["x unpipelined"]) - 1) < 0.02


def test_bench_pipeline_measures_the_interleaved_chunks_against_their_bounds():
    out = bench("pipeline", "--quick", "--schedules", "interleaved", "--hidden", "32,32,32").splitlines()
    names = [c.strip() for c in out[2].strip("|").split("|")]
    rows = [dict(zip(names, (c.strip() for c in line.strip("|").split("|")))) for line in out[4:]]
    # P = 2, V = 2: stage s holds chunks s and s + 2 of the 4; the tick model's bubble (P - 1)/(VM + P - 1) = 1/5
    assert [(r["schedule"], r["stage"], r["layers"], r["V"]) for r in rows] == [
        ("interleaved", "0", "[0,2) [4,6)", "2"), ("interleaved", "1", "[2,4) [6,8)", "2")]
    assert [r["(P-1)/(VM+P-1)"] for r in rows] == ["0.200"] * 2
    # chunk activation sets, summed over a stage's chunks: min(2(P - s - 1) + (V - 1)P + 1, VM) at M = 2
    assert [int(r["bound"]) for r in rows] == [int(r["act held"]) for r in rows] == [4, 3]
    assert [int(r["copies"]) for r in rows] == [4, 3]
    assert abs(float(rows[0]["x unpipelined"]) + float(rows[1]["x unpipelined"]) - 1) < 0.02


@pytest.mark.parametrize("name", ["lenet", "cnn", "resnet", "small_cnn"])
def test_the_torch_twin_of_a_zoo_model_is_the_same_network(name):
    """bench compare --model's yardstick (torch, a benchmark-only dependency:
    skipped without it): the same parameter count and, on the same weights,
    the same logits."""
    pytest.importorskip("torch")
    from hpctrain.bench.torch_models import same_model
    r = same_model(name)
    assert r["hpctrain_params"] == r["torch_params"]
    assert r["max_logit_diff"] < 1e-4 * max(1.0, r["max_logit"]), r


def test_the_torch_twin_of_the_gpt_is_the_same_network():
    """bench compare --model gpt:...'s yardstick (nanoGPT in torch,
    bench/torch_gpt.py): the same parameter count with the tied head once,
    and on the same weights (biases and LayerNorm's moved off 0 and 1) the
    same logits."""
    pytest.importorskip("torch")
    from hpctrain.bench.torch_gpt import same_gpt
    r = same_gpt({"layers": 2, "heads": 2, "width": 16, "dropout": 0.0}, vocab=11, block_size=8)
    assert r["hpctrain_params"] == r["torch_params"] == 11 * 16 + 8 * 16 + 2 * (12 * 16 * 16 + 13 * 16) + 2 * 16
    assert r["max_logit_diff"] < 1e-4 * max(1.0, r["max_logit"]), r


def test_bench_compare_gpt_gives_tokens_per_s_of_both():
    """compare --model gpt:...: both sides run at --block-size and --batch-size, in tokens/s;
    hpctrain's runs take --thread-split and --blas (MKL's products, where it is installed)."""
    pytest.importorskip("torch")
    from hpctrain.nn import blas
    library = "mkl" if blas.available() else "numpy"
    out = json.loads(bench("compare", "--model", "gpt:layers=1,heads=2,width=16", "--block-size", "8",
                           "--batch-size", "3", "--ranks", "1", "--steps", "4", "--repeats", "1",
                           "--thread-split", "samples", "--blas", library, "--json"))
    assert (out["unit"], out["block_size"], out["batch_size"]) == ("tokens/s", 8, 3)
    assert out["check"]["hpctrain_params"] == out["check"]["torch_params"]
    row, = out["rows"]
    assert row["ranks"] == 1 and row["hpctrain"] > 0 and row["torch"] > 0
    # one rank on several cores takes --thread-split samples (the run's own config says so)
    assert row["thread_split"] == ("samples" if row["threads"] > 1 else "ops"), row
    assert row["blas"] == out["blas"] == library, row
    assert row["hpctrain"] == pytest.approx(3 * 8 / (row["step_ms"] / 1e3))
    # MFU of both against the SGEMM the runs measured (report/mfu.py): in proportion to their tokens/s
    assert 0 < row["mfu"] < 1 and row["torch_mfu"] == pytest.approx(row["mfu"] * row["torch"] / row["hpctrain"])


def test_bench_layers_gpt_gives_a_steps_parts_beside_pytorchs():
    """layers --model gpt:...: one thread's training steps (Adam included) by
    kind of work, the parts adding up to the timed step, each part that
    the model has taking time; PyTorch's twin beside it by the same kinds."""
    torch = pytest.importorskip("torch")
    out = json.loads(bench("layers", "--model", "gpt:layers=1,heads=2,width=16", "--block-size", "8", "--batch", "3",
                           "--vocab", "11", "--steps", "3", "--compiled-layers", "on", "--json"))
    assert (out["block_size"], out["batch"], out["vocab"], out["blas"]) == (8, 3, 11, "numpy")
    parts = {row["part"]: row for row in out["parts"]}
    assert list(parts) == ["2-D products", "attention: heads, softmax", "GELU", "LayerNorm", "Linear: bias",
                           "embeddings", "loss", "optimizer", "the rest"]
    assert sum(row["ms"] for row in out["parts"]) == pytest.approx(out["step_timed_ms"])
    for name, row in parts.items():
        if name != "the rest":   # what the timers leave: it may be anything near 0
            assert row["ms"] > 0, row
        assert row["torch_ms"] is not None
    for name in ("2-D products", "attention: heads, softmax", "GELU", "LayerNorm", "optimizer"):
        assert parts[name]["torch_ms"] > 0, (name, parts[name])
    assert out["step_ms"] > 0 and out["torch_step_ms"] > 0 and torch is not None
