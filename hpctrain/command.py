"""The `hpctrain` command (pyproject's [project.scripts]): one name on the
PATH for what `python -m hpctrain.*` runs, as torchrun and horovodrun are.

    hpctrain train --steps 500                 # = python -m hpctrain.train --steps 500
    mpirun -n 4 hpctrain train --model small_cnn --data data/photos
    hpctrain data prepare --source photos --image-size 32,32 --out data/photos
    hpctrain predict --params model.h5 cat.png
    hpctrain evaluate --params model.h5 --data data/photos
    hpctrain generate --params gpt.h5 --prompt "ROMEO:" --tokens 200
    hpctrain bench allreduce | hpctrain plot m.jsonl -o run.png | hpctrain checkpoint ckpt/
    hpctrain export --params gpt.h5 --format hf --to gpt-hf/
    python -m hpctrain ...                     # the same, without the script

Each subcommand is its module's main(), given the arguments after its name;
nothing else is imported first (train configures BLAS and MPI before numpy
loads: train.py; the one-process commands get BLAS's threads here, before
their module loads numpy: ONE_PROCESS) but errors.py, whose stop signals
make a Ctrl-C while a command loads one line, as in its main().
`python -m hpctrain.X` keeps working.
"""
import importlib
import inspect
import sys

from .base.errors import HpctrainError, stops_as_errors

# subcommand -> (module whose main() runs it, what it does)
COMMANDS = {
    "train": ("hpctrain.train", "train a model across MPI ranks (run under mpirun/srun)"),
    "data": ("hpctrain.data.__main__", "prepare shards (IDX, CIFAR-10, image folders, NumPy, HDF5, CSV; text as tokens) or fetch a dataset"),
    "predict": ("hpctrain.predict", "classify images with a trained model"),
    "evaluate": ("hpctrain.evaluate", "accuracy, loss, per-class accuracy and confusion matrix on a test set; a GPT's perplexity"),
    "generate": ("hpctrain.generate", "sample text from a trained GPT"),
    "bench": ("hpctrain.bench.__main__", "allreduce, training and layer benchmarks"),
    "plot": ("hpctrain.plot", "pictures of --metrics files"),
    "checkpoint": ("hpctrain.checkpoint", "list and verify a --checkpoint-dir's checkpoints"),
    "export": ("hpctrain.interop.export", "write a trained model as safetensors or a Hugging Face GPT-2 folder"),
}

# Commands that compute in one process: BLAS's threads pinned as training
# pins a rank alone on its node (run/cluster.py one_process), before their
# module imports numpy (OpenBLAS reads them once, when it loads).
ONE_PROCESS = ("generate", "evaluate", "predict", "export")


def usage():
    width = max(map(len, COMMANDS))
    lines = ["usage: hpctrain COMMAND [ARGS...]   (hpctrain COMMAND --help: its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__
        print(f"hpctrain {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"hpctrain: error: unknown command {name!r}; one of {', '.join(COMMANDS)} (hpctrain --help)",
              file=sys.stderr)
        return 2
    if name in ONE_PROCESS:
        from .run.cluster import one_process
        one_process()
    if name in ("train", "bench"):
        # Their own signals from their first line (train.py; bench's
        # launcher): a rank blocked in MPI must keep SIGTERM's default action.
        code = _run(name, rest)
    else:
        # A stop while the command's modules load (numpy: a second on a busy
        # machine), or between that and its main()'s own handling, is its
        # one line too (errors.stops_as_errors).
        try:
            with stops_as_errors(name):
                code = _run(name, rest)
        except HpctrainError as e:
            print(f"hpctrain: error: {e}", file=sys.stderr)
            return e.exit_code
    return code if isinstance(code, int) else 0


def _run(name, rest):
    """The subcommand's main(), given the arguments after its name."""
    entry = importlib.import_module(COMMANDS[name][0]).main
    kwargs = {"prog": f"hpctrain {name}"} if "prog" in inspect.signature(entry).parameters else {}
    return entry(rest, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
