"""Pictures where people would rather look than read: runs (their --metrics
files) overlaid, and the benchmarks' rows. matplotlib is optional
(`pip install 'hpctrain[plot]'`); figures are drawn with the Agg backend,
straight to PNG, no display needed.

    python -m hpctrain.plot ring.jsonl ps.jsonl -o run.png
    python -m hpctrain.plot m.jsonl --label "2 ranks" -o run.png
    python -m hpctrain.bench allreduce --ranks 2 --plot busbw.png
    python -m hpctrain.bench train --ranks 1,2 --plot train.png

Every plotting function returns the series it drew, {name: (x, y)}, read
back from the figure's own artists, so tests compare the picture's data with
the records it came from rather than trusting the code that drew it.
"""
import json
import os
import sys
import textwrap

import numpy as np

from .flags.arguments import Parser
from .base.errors import EXIT_BAD_INPUT, HpctrainError, one_line_errors
from .base.overwrites import Input
from .run.outputs import check_output_file
from .base.files import one_line, write_atomically

INSTALL = "plotting needs matplotlib: pip install 'hpctrain[plot]'"
DPI = 80
RUN_SIZE = (12, 6.5)        # inches; 960 x 520 pixels at DPI
ALLREDUCE_SIZE = (7, 4.5)   # 560 x 360
TRAIN_SIZE = (11, 4.5)      # 880 x 360


def require():
    """matplotlib, or the one line that says how to install it (exit 2)."""
    try:
        import matplotlib
    except ImportError:
        raise HpctrainError(INSTALL, exit_code=EXIT_BAD_INPUT) from None
    return matplotlib


def check_output(path, flag, inputs=()):
    """Refuse an output we could not write before anything long runs, or
    that would overwrite one of the inputs (run/outputs.check_output_file:
    a device or FIFO at its name included, which the rename would replace)."""
    check_output_file(path, flag, inputs=[Input(given, "a file to plot") for given in inputs])


def _figure(size, rows=1, cols=1, **margins):
    require()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    # A Figure on an Agg canvas, not pyplot: no global state, no display.
    fig = Figure(figsize=size, dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    # Fixed margins rather than tight_layout, which draws everything twice
    # (a third of the time of a figure).
    fig.subplots_adjust(**{"left": 0.07, "right": 0.98, "bottom": 0.1, "top": 0.92, "wspace": 0.25,
                           "hspace": 0.45, **margins})
    return fig, axes


def _save(fig, path):
    """The figure as a PNG of 256 colours: a third of the bytes of the full
    colour one, no visible difference on lines and bars (the docs keep theirs
    small). Pillow comes with matplotlib."""
    from PIL import Image
    fig.canvas.draw()
    rgb = Image.frombuffer("RGBA", fig.canvas.get_width_height(), fig.canvas.buffer_rgba()).convert("RGB")
    image = rgb.quantize(256)
    try:
        # whole or not at all: never a half-written picture, nor one written through a link into an input
        write_atomically(path, lambda f: image.save(f, format="png", optimize=True), binary=True)
    except OSError as e:
        raise HpctrainError(f"{path}: cannot write ({one_line(e)})") from None


def _line(drawn, key, ax, x, y, **kw):
    if len(x) == 1:   # a line through one point draws nothing: a run that logged once
        kw.setdefault("marker", "o")
    (artist,) = ax.plot(x, y, **kw)
    drawn[key] = (np.asarray(artist.get_xdata(), float), np.asarray(artist.get_ydata(), float))


def _bars(drawn, key, ax, x, heights, names, **kw):
    bars = ax.bar(x, heights, **kw)
    drawn[key] = (list(names), np.array([b.get_height() for b in bars], float))
    return bars


def size_text(nbytes):
    """4K, 64K, 1M: sizes as the --sizes flag spells them."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return str(nbytes)


# ---------------------------------------------------------------------------
# runs: --metrics files

def read_run(path, label=None):
    """One --metrics file: {label, steps, evals, final}. A bad file raises a
    one-line HpctrainError. A torn last line (a killed writer's, with no
    newline after it) is left out, as a resumed run leaves it out."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise HpctrainError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise HpctrainError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    lines = text.split("\n")
    steps, evals, final = [], [], None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):   # RecursionError: nested deeper than json can parse
            if number == len(lines):   # no newline after it: the writer was killed mid-line
                continue
            raise HpctrainError(f"{path} line {number}: not JSON (a --metrics file is JSON Lines)") from None
        if not isinstance(record, dict):
            raise HpctrainError(f"{path} line {number}: not a JSON object (a --metrics file holds one per line)")
        event = record.get("event")
        if event is None and _number(record.get("step")) and _number(record.get("loss")):
            steps.append(record)
        elif event == "eval" and _number(record.get("step")) and _number(record.get("test_accuracy")):
            evals.append(record)
        elif event == "final":
            final = record
    if not steps:
        raise HpctrainError(f"{path}: no step records (write one with python -m hpctrain.mnist --metrics FILE)")
    if label is None:
        label = os.path.splitext(os.path.basename(path))[0]
    return {"label": label, "steps": steps, "evals": evals, "final": final}


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def wall_times(steps):
    """time_s of each step record, made continuous: a resumed run's clock
    goes on from its checkpoint's, but in a file from before that it
    started again from 0, so each restart is placed after the last time seen."""
    out, offset, last = [], 0.0, 0.0
    for r in steps:
        t = float(r.get("time_s", np.nan))
        if t + offset < last:
            offset = last
        out.append(t + offset)
        last = out[-1]
    return out


def accuracy_points(run, key="test_accuracy"):
    """(steps, accuracies): the --eval-every evaluations and the final one;
    key "val_accuracy" for the validation part (data prepared with --val-fraction)."""
    points = {int(r["step"]): float(r[key]) for r in run["evals"] if _number(r.get(key))}
    final = run["final"]
    if final and _number(final.get("steps")) and _number(final.get(key)):
        points[int(final["steps"])] = float(final[key])
    return sorted(points), [points[s] for s in sorted(points)]


def staleness(run):
    """An async ps run's staleness: ("histogram", counts) when the final record
    holds the histogram, ("summary", mean, max) when only those, else None."""
    final = run["final"] or {}
    if final.get("mode") != "ps" or final.get("sync", True):
        return None
    hist = final.get("staleness_histogram")
    if isinstance(hist, list) and hist:
        return ("histogram", [int(c) for c in hist])
    if "staleness_mean" in final:
        return ("summary", final.get("staleness_mean"), final.get("staleness_max"))
    return None


def plot_runs(runs, path):
    """draw_runs, written to path as a PNG. Returns {"panel/label": (x, y)}."""
    fig, drawn = draw_runs(runs)
    _save(fig, path)
    return drawn


def is_text(run):
    """A language model's run: its step records count tokens/s (text data)."""
    return all(_number(r.get("tokens_per_s")) for r in run["steps"])


def loss_points(run):
    """(steps, held-out losses per token) of a text run: its validation loss
    where recorded (--eval-every, the final record), else its test loss."""
    key = "val_loss" if any(_number(r.get("val_loss")) for r in run["evals"] + [run["final"] or {}]) \
        else "test_loss"
    return accuracy_points(run, key)


def draw_runs(runs):
    """Loss, test accuracy and samples/s against steps, loss and samples/s
    against wall time, one line per run; the sixth panel: the staleness of
    async ps runs where one recorded its histogram, else where each run's
    time went. Language models' runs (every one text: draw_text_runs) draw
    the held-out loss, tokens/s and the learning rate instead. Returns
    (the figure, {"panel/label": (x, y)})."""
    if runs and all(is_text(run) for run in runs):
        return draw_text_runs(runs)
    fig, axes = _figure(RUN_SIZE, 2, 3, left=0.05, top=0.88, bottom=0.09)
    drawn = {}
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, color in zip(runs, colors):
        label, steps = run["label"], run["steps"]
        x = [r["step"] for r in steps]
        t = wall_times(steps)
        _line(drawn, f"loss/{label}", axes[0][0], x, [r["loss"] for r in steps], color=color, label=label)
        acc_x, acc_y = accuracy_points(run)
        if acc_x:
            _line(drawn, f"test_accuracy/{label}", axes[0][1], acc_x, acc_y, color=color, marker="o",
                  label=label)
        val_x, val_y = accuracy_points(run, "val_accuracy")
        if val_x:   # dashed, same colour: the validation part of the same run
            _line(drawn, f"val_accuracy/{label}", axes[0][1], val_x, val_y, color=color, marker="s",
                  linestyle="--")
        rate = [r.get("samples_per_s", np.nan) for r in steps]
        _line(drawn, f"samples_per_s/{label}", axes[0][2], x, rate, color=color, label=label)
        _line(drawn, f"loss_vs_time/{label}", axes[1][0], t, [r["loss"] for r in steps], color=color,
              label=label)
        _line(drawn, f"samples_per_s_vs_time/{label}", axes[1][1], t, rate, color=color, label=label)
    # samples/s in a record is the mean over the loop so far, not the rate of the last interval.
    rate_title = "samples/s (loop mean so far)"
    accuracy_title = "test accuracy" + (" (validation dashed)" if any(k.startswith("val_accuracy/") for k in drawn)
                                        else "")
    titles = [("loss", "step"), (accuracy_title, "step"), (rate_title, "step"),
              ("loss", "wall time (s)"), (rate_title, "wall time (s)")]
    for ax, (title, xlabel) in zip([axes[0][0], axes[0][1], axes[0][2], axes[1][0], axes[1][1]], titles):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    # One legend for the runs, above the panels: per-panel legends hide the lines.
    fig.legend(handles=axes[0][0].lines, loc="upper center", ncol=min(len(runs), 4), fontsize="small",
               frameon=False)
    if not axes[0][1].lines:
        _note(axes[0][1], "no test evaluations recorded")
    if any((staleness(run) or ("",))[0] == "histogram" for run in runs):
        _plot_staleness(drawn, axes[1][2], runs, colors)
    else:
        _plot_time_split(drawn, axes[1][2], runs, colors)
    return fig, drawn


def draw_text_runs(runs):
    """draw_runs for language models: the training loss with the held-out
    loss per token over it (markers: --eval-every's and the final one; the
    validation loss where recorded), the held-out loss alone, tokens/s
    against steps; the loss against wall time, the learning rate (the
    records' `lr`), and where the time went."""
    fig, axes = _figure(RUN_SIZE, 2, 3, left=0.05, top=0.88, bottom=0.09)
    drawn = {}
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, color in zip(runs, colors):
        label, steps = run["label"], run["steps"]
        x = [r["step"] for r in steps]
        _line(drawn, f"loss/{label}", axes[0][0], x, [r["loss"] for r in steps], color=color, label=label)
        held_x, held_y = loss_points(run)
        if held_x:
            axes[0][0].plot(held_x, held_y, color=color, marker="o", linestyle="none")
            _line(drawn, f"held_out_loss/{label}", axes[0][1], held_x, held_y, color=color, marker="o",
                  label=label)
        _line(drawn, f"tokens_per_s/{label}", axes[0][2], x, [r["tokens_per_s"] for r in steps], color=color,
              label=label)
        _line(drawn, f"loss_vs_time/{label}", axes[1][0], wall_times(steps), [r["loss"] for r in steps],
              color=color, label=label)
        lr = [(r["step"], r["lr"]) for r in steps if _number(r.get("lr"))]
        if lr:
            _line(drawn, f"lr/{label}", axes[1][1], *zip(*lr), color=color, label=label)
    titles = [("loss per token (training; markers: held out)", "step"), ("held-out loss per token", "step"),
              ("tokens/s (loop mean so far)", "step"), ("loss per token", "wall time (s)"),
              ("learning rate", "step")]
    for ax, (title, xlabel) in zip([axes[0][0], axes[0][1], axes[0][2], axes[1][0], axes[1][1]], titles):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    fig.legend(handles=[ln for ln in axes[0][0].lines if not ln.get_label().startswith("_")],   # not the markers
               loc="upper center", ncol=min(len(runs), 4), fontsize="small", frameon=False)
    if not axes[0][1].lines:
        _note(axes[0][1], "no held-out evaluations recorded")
    if not axes[1][1].lines:
        _note(axes[1][1], "no lr in the records (written before it was)")
    _plot_time_split(drawn, axes[1][2], runs, colors)
    return fig, drawn


TIME_PARTS = ("compute", "comm", "other")


def time_split(run):
    """(compute, communication, the rest of the wall time) in seconds from the
    final record, over every run of a resumed one (total_wall_s, ...: its
    wall_s, compute_s and comm_s are its last run's; a file from before
    them: those), or None (a run stopped before its end has none)."""
    final = run["final"] or {}
    keys = ("total_wall_s", "total_compute_s", "total_comm_s")
    if not all(_number(final.get(k)) for k in keys):
        keys = ("wall_s", "compute_s", "comm_s")
    if not all(_number(final.get(k)) for k in keys):
        return None
    wall, compute, comm = (float(final[k]) for k in keys)
    return compute, comm, max(wall - compute - comm, 0.0)


def _plot_time_split(drawn, ax, runs, colors):
    """One stacked bar per run, in its colour: its wall time as compute,
    communication and the rest (start-up, evaluation, checkpoints), from the
    final record, which every finished run writes."""
    from matplotlib.patches import Patch
    ax.set_title("where the time went (final record)")
    shades = dict(zip(TIME_PARTS, (1.0, 0.55, 0.2)))
    notes = []
    for i, (run, color) in enumerate(zip(runs, colors)):
        parts = time_split(run)
        if parts is None:
            notes.append(f"{run['label']}: no final record")
            continue
        bottoms = np.cumsum((0.0,) + parts[:-1])
        bars = [ax.bar(i, height, bottom=bottom, color=color, alpha=shades[part], width=0.6)[0]
                for part, height, bottom in zip(TIME_PARTS, parts, bottoms)]
        drawn[f"time/{run['label']}"] = (list(TIME_PARTS), np.array([b.get_height() for b in bars], float))
    # Older async ps files hold only a staleness summary: say it here.
    notes += [f"{run['label']}: staleness mean {s[1]}, max {s[2]}" for run in runs
              for s in [staleness(run)] if s and s[0] == "summary"]
    if len(notes) == len(runs) and not any(k.startswith("time/") for k in drawn):
        _note(ax, _fit(notes))
        return
    ax.set_xticks([])
    ax.set_xlim(-0.5, len(runs) - 0.5)
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3, axis="y")
    text = _fit(notes)
    # room above the bars for the legend and the notes under it
    ax.set_ylim(0, ax.get_ylim()[1] * (1.35 + 0.1 * (text.count("\n") + 1 if notes else 0)))
    ax.legend(handles=[Patch(color="0.3", alpha=shades[p], label=p) for p in TIME_PARTS],
              fontsize="small", loc="upper left", ncol=3)
    if notes:
        ax.text(0.03, 0.86, text, transform=ax.transAxes, ha="left", va="top", fontsize="small")


def _fit(lines, width=42):
    """Lines wrapped to a panel's width in the small font (a long run name spilled past the figure)."""
    return "\n".join(textwrap.fill(line, width, subsequent_indent="  ") for line in lines)


def _plot_staleness(drawn, ax, runs, colors):
    """Side-by-side bars per async run: updates applied at each staleness
    (the servers count 0..30, the last bin 31 and more); plot_runs draws
    this panel where at least one run recorded the histogram."""
    ax.set_title("async ps: staleness of applied updates")
    found = [(run, color, staleness(run)) for run, color in zip(runs, colors)]
    hists = [(run, color, s[1]) for run, color, s in found if s and s[0] == "histogram"]
    summaries = [(run, s) for run, _, s in found if s and s[0] == "summary"]
    width = 0.8 / len(hists)
    for i, (run, color, counts) in enumerate(hists):
        bins = np.arange(len(counts))
        final = run["final"]
        label = f"mean {final.get('staleness_mean', 0):.2f}, max {final.get('staleness_max', '?')}"
        _bars(drawn, f"staleness/{run['label']}", ax, bins - 0.4 + width * (i + 0.5), counts, bins,
              width=width, color=color, label=label)
    ax.set_xlabel("staleness (versions behind; last bin 31+)")
    ax.set_ylabel("updates")
    # Older files hold only the summary: say what there is instead of a histogram.
    text = _fit([f"{run['label']}: mean {s[1]}, max {s[2]} (no histogram recorded)" for run, s in summaries])
    rows = text.count("\n") + 1 if text else 0
    # room above the bars for the legend and the notes under it
    ax.set_ylim(0, max(max(c) for _, _, c in hists) * (1.3 + 0.12 * (len(hists) + rows)) or 1)
    ax.legend(fontsize="small", loc="upper right")
    ax.grid(alpha=0.3, axis="y")
    if text:
        ax.text(0.98, 0.9 - 0.08 * len(hists), text, transform=ax.transAxes, ha="right", va="top",
                fontsize="small")


def _note(ax, text):
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4", fontsize="small")
    ax.set_xticks([])
    ax.set_yticks([])


# ---------------------------------------------------------------------------
# benchmarks

def plot_allreduce(result, path):
    """`bench allreduce --json`'s object: busbw against message size (log
    scale) for each algorithm. Returns {"busbw/ALG": (bytes, GB/s)}."""
    fig, axes = _figure(ALLREDUCE_SIZE, left=0.1, bottom=0.12, top=0.9)
    ax, drawn = axes[0][0], {}
    rows = result["rows"]
    sizes = [r["bytes"] for r in rows]
    for alg in result["algorithms"]:
        k = alg.replace("-", "_")
        _line(drawn, f"busbw/{alg}", ax, sizes, [r[f"{k}_busbw"] for r in rows], marker="o", label=alg)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [size_text(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    nodes = result.get("nodes", 1)
    ax.set_title(f"allreduce, {result.get('ranks')} ranks on {nodes} node{'s' if nodes != 1 else ''}, "
                 f"{result.get('device', 'cpu')}")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)
    return drawn


STEP_PARTS = [("compute_ms", "compute"), ("comm_ms", "comm not hidden"),
              ("optimizer_ms", "optimizer not hidden"), ("other_wait_ms", "other wait")]


def step_split(row):
    """A train row's step in parts that stack: compute, then the wait after
    backprop as exposed communication, exposed optimizer and what is left."""
    parts = {k: row.get(k) or 0.0 for k, _ in STEP_PARTS[:3]}
    parts["other_wait_ms"] = max((row.get("wait_ms") or 0.0) - parts["comm_ms"] - parts["optimizer_ms"], 0.0)
    return parts


def _setting(row):
    return row.get("setting") or row.get("mode") or "hpctrain"


def plot_train(rows, path, title="train"):
    """`bench train` rows: samples/s against ranks (a line per setting, or per
    mode), and stacked bars of the median step split per rank count and
    setting. Returns {"samples_per_s/SETTING": (ranks, samples/s),
    "step/PART": (bar names, ms)}."""
    fig, axes = _figure(TRAIN_SIZE, 1, 2, top=0.85, bottom=0.15)
    left, right = axes[0]
    drawn = {}
    settings = list(dict.fromkeys(_setting(r) for r in rows))
    for s in settings:
        mine = [r for r in rows if _setting(r) == s]
        _line(drawn, f"samples_per_s/{s}", left, [r["ranks"] for r in mine], [r["samples_per_s"] for r in mine],
              marker="o", label=s)
    ranks = sorted({r["ranks"] for r in rows})
    left.set_xticks(ranks)
    left.set_xlabel("ranks")
    left.set_ylabel("samples/s (steady state)")
    left.set_title("throughput")
    left.grid(alpha=0.3)
    left.legend(fontsize="small")

    # --compare FLAG=V rows: the value alone under the rank count (the legend has FLAG=V).
    names = [f"{r['ranks']}" + (f"\n{r['setting'].split('=', 1)[-1]}" if "setting" in r else "") for r in rows]
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    splits = [step_split(r) for r in rows]
    for key, label in STEP_PARTS:
        heights = np.array([s[key] for s in splits])
        _bars(drawn, f"step/{label}", right, x, heights, names, bottom=bottom, label=label, width=0.6)
        bottom += heights
    right.set_xticks(x, names, fontsize="small")
    right.set_xlabel("ranks" + (f" / {rows[0]['setting'].split('=', 1)[0]}" if "setting" in rows[0] else ""))
    right.set_ylabel("median step (ms)")
    right.set_title("where a step goes")
    right.grid(alpha=0.3, axis="y")
    right.legend(fontsize="small")
    fig.suptitle(title)
    _save(fig, path)
    return drawn


# ---------------------------------------------------------------------------
# python -m hpctrain.plot

@one_line_errors   # its stop signals: one line (errors.stops_as_errors)
def main(argv=None, prog="python -m hpctrain.plot"):
    p = Parser(prog=prog,
                                description="Loss, test accuracy, samples/s (and async ps staleness) of "
                                            "--metrics files, overlaid, as one PNG.")
    p.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="--metrics files of hpctrain.mnist runs")
    p.add_argument("-o", "--output", required=True, metavar="PNG", help="the picture to write")
    p.add_argument("--label", action="append", default=None,
                   help="a run's name in the legend, once per file in order (default: the file name's stem)")
    try:
        args = p.parse_args(argv)
        if args.label is not None and len(args.label) != len(args.runs):
            raise HpctrainError(f"--label given {len(args.label)} times for {len(args.runs)} files: "
                                f"give one per file, or none")
        labels = args.label or [None] * len(args.runs)
        runs = [read_run(path, label) for path, label in zip(args.runs, labels)]
        check_output(args.output, "-o", inputs=args.runs)
        require()
        plot_runs(runs, args.output)
    except HpctrainError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
