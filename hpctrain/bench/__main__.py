"""python -m hpctrain.bench allreduce|train|compare|torch|model|layers|pipeline --help  (--plot PNG: allreduce, train)

A bad argument is one line (`hpctrain: error: ...`), exit 2, before anything runs."""
import argparse
import math
import os
import sys
from contextlib import nullcontext

from ..flags.arguments import Parser
from ..base.errors import HpctrainError
from .common import RANKS_PER_CORE, check_ranks, is_rank, parse_size, stopping_on_signals


def _number(kind, low, high=None, low_ok=False):
    """An argparse type: a finite kind(text) in (low, high], or [low, high] with low_ok."""
    def parse(text):
        value = kind(text)
        if not (math.isfinite(value) and (low <= value if low_ok else low < value)
                and (high is None or value <= high)):
            interval = f"{'[' if low_ok else '('}{low:g}, {'inf)' if high is None else f'{high:g}]'}"
            raise argparse.ArgumentTypeError(f"{text}: must be in {interval}")
        return value
    parse.__name__ = kind.__name__   # argparse's "invalid float value: 'x'"
    return parse


def _counts(text):
    """--ranks 1,2,4 -> [1, 2, 4] (which counts this machine runs: check_ranks)."""
    try:
        return [int(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want comma-separated whole numbers, e.g. 1,2,4") from None


def _shape(text):
    """--shape 32,32,3 -> (32, 32, 3)."""
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want comma-separated whole numbers, e.g. 32,32,3") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every dimension must be at least 1")
    return shape


def _sizes(text):
    try:
        sizes = [parse_size(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want comma-separated byte counts, e.g. 4K,1M,16M") from None
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be at least 1 byte")
    return text


_POSITIVE = _number(int, 1, low_ok=True)
_RATE = _number(float, 0)
OVERSUBSCRIBE = ("--oversubscribe-ok", dict(action="store_true", help=f"run more than {RANKS_PER_CORE} ranks per "
                                            "core here (ranks spread over several hosts by HPCTRAIN_MPIRUN_ARGS)"))


def main(argv=None, prog="python -m hpctrain.bench"):
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = Parser(prog=prog, description=__doc__)
    _subcommands(p.add_subparsers(dest="what", required=True))
    try:
        args = p.parse_args(argv)
        args.argv = argv
        # A rank keeps the default handlers: its launcher's SIGTERM must end
        # it even while it waits inside MPI, where no Python handler runs.
        launcher = args.what in ("train", "compare", "torch", "pipeline") or not is_rank()
        with stopping_on_signals() if launcher else nullcontext():
            return _run(args, extra)
    except HpctrainError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return e.exit_code


def _subcommands(sub):
    a = sub.add_parser("allreduce", help="allreduce algorithms side by side (ring, ring-rank, hier, mpi), 4 KiB to 64 MiB")
    a.add_argument("--ranks", type=int, default=2, help="ranks to launch when not already under mpirun (default: %(default)s)")
    a.add_argument("--sizes", type=_sizes, default="4K,16K,64K,256K,1M,4M,16M,64M", help="comma-separated sizes in bytes (K, M suffixes)")
    a.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="buffers in host memory or CuPy device memory")
    a.add_argument("--algorithms", default="ring,mpi",
                   help="comma-separated: ring (hpctrain's, node order), ring-rank (rank order), hier, mpi "
                        "(default: %(default)s); ratios against the first")
    a.add_argument("--link-gbit", type=_RATE, default=None,
                   help="link rate between nodes: also measure bytes per node link and link efficiency")
    a.add_argument(OVERSUBSCRIBE[0], **OVERSUBSCRIBE[1])
    a.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    a.add_argument("--plot", metavar="PNG", default=None,
                   help="also draw busbw against size per algorithm (needs matplotlib: pip install 'hpctrain[plot]')")

    t = sub.add_parser("train", help="training throughput for several rank counts (flags after -- go to hpctrain.mnist)")
    t.add_argument("--mode", choices=["ring", "ps"], default="ring")
    t.add_argument("--ranks", type=_counts, default="1,2,4", help="comma-separated rank counts (default: %(default)s)")
    t.add_argument("--steps", type=_POSITIVE, default=1000, help="steps per run (default: %(default)s)")
    t.add_argument("--repeats", type=_POSITIVE, default=3, help="runs per configuration; the median is reported")
    t.add_argument("--compare", metavar="FLAG=V1,V2", default=None,
                   help="run every rank count with each value of one hpctrain flag, repeats interleaved, "
                        "e.g. shard-optimizer=off,on; ratios against the first value")
    t.add_argument("--versus-ring", action="store_true",
                   help="ps only: for each rank count N, interleave ring with N - num_ps ranks, ps --sync and "
                        "ps --async with N ranks; medians, ratios to the ring, the servers' time per update; "
                        "with --compare, ps sync and async with each value")
    t.add_argument("--against", metavar="COMMIT", default=None,
                   help="also run that git commit's hpctrain/ (taken from this repository's history), each "
                        "repeat the commit's code then this code; medians per code, samples/s this/commit")
    t.add_argument(OVERSUBSCRIBE[0], **OVERSUBSCRIBE[1])
    t.add_argument("--json", action="store_true")
    t.add_argument("--plot", metavar="PNG", default=None,
                   help="also draw samples/s against ranks and the step split "
                        "(needs matplotlib: pip install 'hpctrain[plot]')")

    c = sub.add_parser("compare", help="hpctrain ring vs a plain NumPy loop and PyTorch DDP, in one run "
                                       "(--model NAME or gpt:...: the model against its PyTorch twin)")
    c.add_argument("--model", default="mlp", help="mlp (the 784-500-500-10 MLP, default), a zoo model: "
                                                  "lenet, cnn, resnet, small_cnn, or nanoGPT's: "
                                                  "gpt:layers=L,heads=H,width=E (tokens/s; needs torch)")
    c.add_argument("--block-size", type=_POSITIVE, default=None, metavar="T",
                   help="--model gpt:...: the context length (default: 64)")
    c.add_argument("--batch-size", type=_POSITIVE, default=None,
                   help="--model NAME or gpt:...: samples per rank and step (default: 32; the GPT 12)")
    c.add_argument("--ranks", type=_counts, default="1,2,4", help="comma-separated rank counts (default: %(default)s)")
    c.add_argument("--steps", type=_POSITIVE, default=1000, help="steps per run (default: %(default)s)")
    c.add_argument("--repeats", type=_POSITIVE, default=3, help="hpctrain runs per configuration (median)")
    c.add_argument("--compiled-layers", choices=["auto", "on", "off"], default="auto",
                   help="--model NAME: hpctrain's --compiled-layers (auto: on from 200 steps where numba is installed)")
    c.add_argument("--thread-split", choices=["ops", "samples"], default="ops",
                   help="hpctrain's --thread-split where a rank has more than one thread (one rank on several "
                        "cores); a row of one thread a rank runs without it (default: %(default)s, training's)")
    c.add_argument("--blas", choices=["numpy", "mkl"], default="numpy",
                   help="--model NAME or gpt:...: hpctrain's --blas, the library of its products (mkl: Intel MKL's, "
                        "as PyTorch's are) (default: %(default)s, training's)")
    c.add_argument(OVERSUBSCRIBE[0], **OVERSUBSCRIBE[1])
    c.add_argument("--json", action="store_true")

    o = sub.add_parser("torch", help="nanoGPT's PyTorch loop over hpctrain.dist against PyTorch DDP, repeats "
                                     "interleaved (tokens/s; flags after -- go to examples/torch_nanogpt.py)")
    o.add_argument("--ranks", type=_counts, default="2,4", help="comma-separated rank counts (default: %(default)s)")
    o.add_argument("--steps", type=_POSITIVE, default=50, help="iterations per run (default: %(default)s)")
    o.add_argument("--repeats", type=_POSITIVE, default=3, help="runs of each per rank count (medians)")
    o.add_argument(OVERSUBSCRIBE[0], **OVERSUBSCRIBE[1])
    o.add_argument("--json", action="store_true")

    m = sub.add_parser("model", help="fit alpha-beta models here, predict 8-256 GPUs")
    m.add_argument("--ranks", type=int, default=4, help="ranks for the measurements (default: %(default)s)")
    m.add_argument("--sizes", type=_sizes, default="4K,64K,1M,4M,16M", help="message sizes measured for the fit")
    m.add_argument("--link-gbit", type=_RATE, default=25.0, help="link bandwidth to predict for (default: %(default)s)")
    m.add_argument("--link-efficiency", type=_number(float, 0, 1), default=0.85,
                   help="fraction of the link rate an allreduce gets (default: %(default)s, measured across "
                        "simulated nodes: docs/clusters.md)")
    m.add_argument("--alpha-us", type=_number(float, 0, low_ok=True), default=None,
                   help="per-step latency to predict with (default: the one fitted here, hpctrain's software overhead)")
    m.add_argument("--compute-ms", type=_RATE, default=50.0, help="compute time per step per GPU (default: %(default)s)")
    m.add_argument("--model-mb", type=_RATE, default=100.0, help="gradient size in MB (default: %(default)s, about ResNet-50)")
    m.add_argument("--overlap", type=_number(float, 0, 1, low_ok=True), default=0.0, help="fraction of communication hidden behind backprop (0-1)")
    m.add_argument("--ps-ratio", type=_RATE, default=1.0, help="parameter servers per worker (default: %(default)s)")
    m.add_argument(OVERSUBSCRIBE[0], **OVERSUBSCRIBE[1])
    m.add_argument("--json", action="store_true")

    y = sub.add_parser("layers", help="a model's layers: forward+backward ms and GFLOP/s each, beside SGEMM; images/s "
                                      "(gpt:...: a step's parts by kind, beside PyTorch's)")
    y.add_argument("--model", default="small_cnn", help="a name from hpctrain.nn.MODELS, or gpt:layers=L,heads=H,"
                                                        "width=E (default: %(default)s)")
    for flag, default, what in (("--block-size", 64, "tokens a sample"),
                                ("--vocab", 65, "tokens in the vocabulary (65: Shakespeare's characters)"),
                                ("--steps", 50, "steps timed, each side")):
        y.add_argument(flag, type=_POSITIVE, default=None, help=f"gpt:...: {what} (default: {default})")
    y.add_argument("--blas", choices=["numpy", "mkl"], default=None,
                   help="gpt:...: hpctrain's --blas, the library of its products (default: numpy)")
    y.add_argument("--shape", type=_shape, default=(32, 32, 3), help="image shape (default: 32,32,3)")
    y.add_argument("--classes", type=_POSITIVE, default=10)
    y.add_argument("--batch", type=_POSITIVE, default=32, help="batch size (default: %(default)s)")
    y.add_argument("--threads", type=_POSITIVE, default=1,
                   help="compute threads, as a rank with that many cores trains (BLAS at one thread each; "
                        "torch at as many); above 1, wall time (default: %(default)s, one rank's share)")
    y.add_argument("--compiled-layers", choices=["on", "off"], default=None,
                   help="hpctrain's layers as training's --compiled-layers (numba's kernels) "
                        "(default: on where numba is installed)")
    y.add_argument("--seconds", type=_RATE, default=2.0, help="measuring time for the whole step (default: %(default)s)")
    y.add_argument("--json", action="store_true")

    q = sub.add_parser("pipeline", help="pipeline stages: measured bubble, activation and parameter memory per "
                                        "stage against the schedule's bounds (flags after -- go to hpctrain.train)")
    q.add_argument("--stages", type=_POSITIVE, default=2, help="pipeline stages P, one rank each (default: %(default)s)")
    q.add_argument("--micro-batches", type=_counts, default=None, help="comma-separated M (default: 4,8)")
    q.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated, of gpipe, 1f1b, interleaved "
                                                             "(default: %(default)s)")
    q.add_argument("--virtual-stages", type=_POSITIVE, default=2, metavar="V",
                   help="chunks a stage of the interleaved schedule (default: %(default)s)")
    q.add_argument("--hidden", default=None, help="the MLP's widths (default: 512,512: both stages the same "
                                                  "forward + backward work)")
    q.add_argument("--batch-size", type=_POSITIVE, default=None, help="samples per micro-batch (default: 64)")
    q.add_argument("--steps", type=_POSITIVE, default=None, help="steps per run (default: 30)")
    q.add_argument("--quick", action="store_true", help="M = 2, 4 steps, --hidden 32,32, micro-batch 8 where "
                                                        "not given: seconds, for a smoke test")
    q.add_argument(OVERSUBSCRIBE[0], **OVERSUBSCRIBE[1])
    q.add_argument("--json", action="store_true")


def _run(args, extra):
    if args.what == "layers":
        return _layers(args)
    if args.what == "pipeline":
        if args.stages < 2:
            raise HpctrainError(f"--stages {args.stages}: a pipeline has at least 2 stages")
        check_ranks([args.stages], args.oversubscribe_ok)
        from .pipeline import main as run
        return run(args, extra)
    counts = args.ranks if isinstance(args.ranks, list) else [args.ranks]
    if args.what == "model":
        check_ranks(counts, args.oversubscribe_ok, least=2, why=" (the fit needs a ring, and a server with a worker)")
    else:
        check_ranks(counts, args.oversubscribe_ok)
    if getattr(args, "plot", None):
        # Before the benchmark: a missing matplotlib or output folder is
        # found out now, not after minutes of measuring.
        from ..plot import check_output, require
        require()
        check_output(args.plot, "--plot")
    if args.what == "allreduce":
        from .allreduce import main as run
        return run(args)
    if args.what == "train":
        if args.against:
            from .against import against
            return against(args, extra)
        if args.versus_ring:
            from .train import versus_ring
            return versus_ring(args, extra)
        if args.compare:
            from .train import compare_settings
            return compare_settings(args, extra)
        from .train import main as run
        return run(args, extra)
    if args.what == "torch":
        from .torch_dist import main as run
        return run(args, extra)
    if args.what == "compare":
        _compare_flags(args)
        from .train import compare
        return compare(args)
    from .model import main as run
    return run(args)


def _compare_flags(args):
    """compare's --model and the flags that go with it, checked before
    anything runs; --block-size's default for the GPT."""
    from ..flags.model_names import gpt_options
    from ..nn import MODELS
    try:
        gpt = gpt_options(args.model)
    except ValueError as e:
        raise HpctrainError(f"--model {args.model}: {e}") from None
    if gpt is None and args.model not in MODELS:
        raise HpctrainError(f"--model {args.model}: not one of {', '.join(MODELS)}, or gpt:layers=L,heads=H,width=E")
    if gpt is None and args.block_size is not None:
        raise HpctrainError(f"--block-size is for --model gpt:..., not {args.model}")
    if args.model == "mlp" and args.batch_size is not None:
        raise HpctrainError("--batch-size is for --model NAME or gpt:... (the MLP comparison is at batch 32)")
    for flag, value, default in (("--thread-split", args.thread_split, "ops"), ("--blas", args.blas, "numpy")):
        if args.model == "mlp" and value != default:
            raise HpctrainError(f"{flag} is for --model NAME or gpt:... (the MLP comparison runs training's "
                                f"defaults)")
    if gpt is not None and args.block_size is None:
        args.block_size = 64


def _layers(args):
    # BLAS reads its thread count once, when numpy loads: set it first. At
    # one thread, as a training rank's with compute threads (nn/threads.py).
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    from ..flags.model_names import gpt_options
    from ..nn import MODELS, LayerError, blas, compiled, gpt, threads
    # every flag checked before anything process-wide is switched (compiled layers, threads, MKL)
    try:
        options = gpt_options(args.model)
    except ValueError as e:
        raise HpctrainError(f"--model {args.model}: {e}") from None
    if options is None:
        for flag in ("block_size", "vocab", "steps", "blas"):
            if getattr(args, flag) is not None:
                raise HpctrainError(f"--{flag.replace('_', '-')} is for --model gpt:..., not {args.model}")
        if args.model not in MODELS:
            raise HpctrainError(f"--model {args.model}: not one of {', '.join(MODELS)}, or "
                                f"gpt:layers=L,heads=H,width=E")
    else:   # the GPT's parts: one thread's step (the threads' split is not timed by parts)
        if args.threads != 1:
            raise HpctrainError(f"--threads {args.threads}: --model gpt:... times one thread's step, by parts")
        args.block_size, args.vocab = args.block_size or 64, args.vocab or 65
        args.steps, args.blas = args.steps or 50, args.blas or "numpy"
        try:
            gpt(args.vocab, args.block_size, **options)
        except (LayerError, ValueError) as e:
            raise HpctrainError(f"--model {args.model} at --block-size {args.block_size}: {e}") from None
    if args.compiled_layers == "on" and not compiled.available():
        raise HpctrainError("--compiled-layers on: numba is not installed (pip install 'hpctrain[fast]')")
    if args.compiled_layers is None:
        args.compiled_layers = "on" if compiled.available() else "off"
    compiled.use(args.compiled_layers == "on")
    if threads.configure(args.threads) != args.threads:
        raise HpctrainError(f"--threads {args.threads}: this NumPy's BLAS cannot be held to one thread per "
                            f"compute thread (needs OpenBLAS 0.3.27 or later)")
    if options is not None:
        blas.configure(args.blas)   # HpctrainError where MKL does not load
        from .gpt_parts import main as run
        return run(args, options)
    try:
        spec = MODELS[args.model](args.shape, args.classes)
    except LayerError as e:
        raise HpctrainError(f"--model {args.model} on {'x'.join(map(str, args.shape))}: {e}") from None
    from ..data.arrays import memory_available
    need, have = spec.memory_bytes(args.batch, 2), memory_available()
    if have is not None and need > have:   # the step's arrays, refused before they are made
        raise HpctrainError(f"--model {args.model} at --batch {args.batch} needs at least {need / 2**30:.1f} GiB "
                            f"(parameters, gradients, optimizer state, activations); this node has "
                            f"{have / 2**30:.1f} GiB available")
    from .layers import main as run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
