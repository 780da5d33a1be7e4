"""The data command line: prepare shards from IDX, CIFAR-10, image folders,
NumPy, HDF5 or CSV files, token shards from text, or download a dataset.

    python -m hpctrain.data prepare --source data/mnist-5k --out data/mnist --shards 8
    python -m hpctrain.data fetch --dataset mnist --out data/raw/mnist
    python -m hpctrain.data prepare --source data/raw/mnist --out data/mnist --force
    python -m hpctrain.data prepare --out data/mnist-val --val-fraction 0.1
    python -m hpctrain.data fetch --dataset emnist --split balanced --out data/raw/emnist
    python -m hpctrain.data fetch --dataset cifar-10 --out data/raw/cifar-10
    python -m hpctrain.data prepare --source photos --image-size 32,32 --out data/photos
    python -m hpctrain.data prepare --source mnist.npz --out data/mine --no-flip
    python -m hpctrain.data prepare --images x.npy --labels y.npy --out data/mine
    python -m hpctrain.data prepare --source set.h5 --images X --labels Y --out data/mine
    python -m hpctrain.data prepare --source mnist_train.csv --out data/mine
    python -m hpctrain.data prepare --source data/shakespeare/input.txt --out data/shakespeare-chars --text chars
    python -m hpctrain.data prepare --source corpus/ --out data/corpus-bpe --text bpe:4096 --val-fraction 0.05
    python -m hpctrain.data prepare --source corpus/ --out data/corpus-gpt2 --text tokenizer:gpt2/
    python -m hpctrain.data verify data/corpus-gpt2
    mpirun -n 4 python -m hpctrain.data verify data/corpus-gpt2   # the files dealt over the ranks

    mpirun -n 4 python -m hpctrain.data prepare --source owt/ --out data/owt --text tokenizer:gpt2/ --eot

Bad input is one line on stderr (`hpctrain: error: ...`) and exit 2; no
command prints the help and exits 2. MPI only for `verify` and `prepare --text` under mpirun
(the data package below never imports it: house rule).
"""

import os
import sys
import time

import numpy as np

from hpctrain.flags.arguments import Parser
from hpctrain.base.errors import HpctrainError, one_line_errors

from .fetch import EMNIST_SPLITS, MD5, fetch
from .manifest import bundled_sample_dir, default_data_dir
from .manifest import bundled_text_path
from .prepare import prepare
from .prepare_text import prepare_text
from .verify import check_file, listed_files


def build_parser(prog="python -m hpctrain.data"):
    p = Parser(
        prog=prog,
        description="Prepare HDF5 training shards from IDX or CIFAR-10 binary files, image folders, "
                    "NumPy, HDF5 or CSV files, token shards from text (--text), or download "
                    "MNIST, Fashion-MNIST, KMNIST, EMNIST or CIFAR-10.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    pp = sub.add_parser("prepare", help="IDX or CIFAR-10 files -> class-balanced HDF5 shards + "
                                        "manifest.json; --text: text -> token shards",
                        description="Write train-0000i-of-0000S.h5, test-00000-of-00001.h5 and "
                                    "manifest.json into --out, atomically; with --text, token shards of a "
                                    "text (its last --val-fraction held out).")
    pp.add_argument("--source", metavar="DIR|FILE", default=None,
                    help="directory with train-/t10k-*-idx?-ubyte[.gz] files (EMNIST's "
                         "emnist-SPLIT-train-/test- too), CIFAR-10's data_batch_1..5.bin + "
                         "test_batch.bin, or one *images*idx3* + *labels*idx1* pair; or a folder "
                         "of images, one subfolder per class (train/CLASS/*.png, optionally "
                         "test/CLASS/...; PNG, JPEG); or an .npz (x, y; or x_train, y_train, x_test, "
                         "y_test), .h5 or .csv (label, pixels...) file (default: the bundled 5k "
                         f"sample, {bundled_sample_dir()}); with --text, a text file or a folder of "
                         f".txt files (default: the bundled Shakespeare, {bundled_text_path()})")
    pp.add_argument("--text", metavar="chars|bytes|bpe:N|tokenizer:PATH", default=None,
                    help="prepare text as token shards instead of images: its characters as the "
                         "vocabulary, the 256 byte values, a byte-level BPE of N tokens trained on it "
                         "(saved as tokenizer.json beside the shards), or a Hugging Face tokenizer.json "
                         "(PATH: the file, or a folder holding it, such as GPT-2's; kept as bpe:N's is, its "
                         "size the model's vocabulary); the held-out split is the last "
                         "--val-fraction of the tokens")
    pp.add_argument("--text-field", metavar="NAME", default=None,
                    help="--text: the field of each JSON Lines record (the column of a Parquet file) that holds "
                         "its document (default: text)")
    pp.add_argument("--eot", action="store_true",
                    help="--text: end each document (a file, a record, a row) with the tokenizer's end-of-text "
                         "token, <|endoftext|> (bpe:N reserves it; a tokenizer:PATH must have it)")
    pp.add_argument("--skip-bad-records", action="store_true",
                    help="--text: skip a bad JSON Lines record or Parquet row (not JSON, no such field, not a "
                         "string, not UTF-8) and count it, instead of stopping at the first, named")
    pp.add_argument("--tokenizer-sample-mb", type=float, default=None, metavar="MB",
                    help=f"--text bpe:N: train the tokenizer on the corpus's first MB (default: "
                         f"{TEXT_SAMPLE_MB}); every token is then encoded with it")
    pp.add_argument("--shard-mb", type=float, default=None, metavar="MB",
                    help=f"--text: the input that makes one shard, a rank's unit of work (default: {TEXT_SHARD_MB:g}); "
                         f"a larger file is cut at line ends")
    pp.add_argument("--timeout", type=float, default=None, metavar="S",
                    help="--text under mpirun: how long a rank waits for the others at each meeting (the "
                         f"vocabulary, the token counts, the shards) once its own share is done (default: "
                         f"{TEXT_TIMEOUT:g})")
    pp.add_argument("--images", metavar="NAME|A.npy", default=None,
                    help="the images' array in an .npz or HDF5 --source; without --source, a .npy file")
    pp.add_argument("--labels", metavar="NAME|B.npy", default=None,
                    help="the labels' array in an .npz or HDF5 --source; without --source, a .npy file")
    pp.add_argument("--image-size", metavar="H,W", default=None,
                    help="image folders: resize every image to H x W (bilinear); flat rows (CSV, "
                         "(N, pixels) arrays): their shape; each side at least 4 (default: folders' images "
                         "must share one size, rows are square)")
    pp.add_argument("--grayscale", action="store_true",
                    help="image folders: convert to grayscale (default: grayscale only if every image is)")
    pp.add_argument("--no-flip", action="store_true",
                    help="record that flipping changes these images' classes (digits, letters): training "
                         "refuses --augment flip on them")
    pp.add_argument("--out", metavar="DIR", default=None,
                    help="output directory (default: data/mnist in the repository; --text: required)")
    pp.add_argument("--shards", type=int, default=None,
                    help="number of training shards; at least the number of workers reads "
                         f"whole shards (default: {IMAGE_DEFAULTS['shards']})")
    pp.add_argument("--test-fraction", type=float, default=None,
                    help="test share when splitting a single images/labels pair, stratified by "
                         f"class; ignored for train/t10k sources (default: {IMAGE_DEFAULTS['test_fraction']})")
    pp.add_argument("--val-fraction", type=float, default=None,
                    help="hold out this share of each training class as a validation part "
                         "(val-00000-of-00001.h5), used by training's --eval-every and "
                         f"--keep-best (default: {IMAGE_DEFAULTS['val_fraction']}: none); with --text, "
                         f"the last share of the tokens, the held-out split (default: {TEXT_VAL_FRACTION})")
    pp.add_argument("--seed", type=int, default=None,
                    help=f"seed of the split and the shuffles (default: {IMAGE_DEFAULTS['seed']})")
    pp.add_argument("--force", action="store_true",
                    help="replace --out if it holds a prepared dataset (its manifest.json); a folder of other "
                         "files is never replaced")

    pv = sub.add_parser("verify", help="recompute every shard's sha256 against manifest.json (a start checks "
                                       "sizes and headers only)",
                        description="Hash every file manifest.json lists (shards, tokenizer.json) and compare "
                                    "with the sha256 prepare recorded; each bad file is one line, exit 2 if any. "
                                    "Under mpirun the files are dealt over the ranks.")
    pv.add_argument("dir", metavar="DIR", help="a prepared directory (holding manifest.json)")
    pv.add_argument("--timeout", type=float, default=300.0, metavar="S",
                    help="under mpirun: how long rank 0 waits for the others' findings once its own share is "
                         "hashed, and they for its answer (default: %(default)s)")

    pf = sub.add_parser("fetch", help="download a dataset and verify its MD5 checksums",
                        description="Download the dataset's published files into --out (EMNIST, "
                                    "CIFAR-10: the archive, then its files taken out of it); "
                                    "files already there with the right checksum are kept.")
    pf.add_argument("--dataset", choices=sorted(MD5), default="mnist",
                    help="which dataset (default: %(default)s)")
    pf.add_argument("--out", metavar="DIR", required=True,
                    help="directory for the .gz files (then: prepare --source DIR)")
    pf.add_argument("--mirror", metavar="URL", default=None,
                    help="base URL holding the files (default: the dataset's public site)")
    pf.add_argument("--split", choices=EMNIST_SPLITS, default="balanced",
                    help="EMNIST only: which split to take out of the zip (default: "
                         "%(default)s, 47 classes)")
    pf.add_argument("--timeout", type=float, default=60.0,
                    help="seconds to wait for the network's next byte before giving up; a whole "
                         "file must also arrive at 32 KB/s on average (default: %(default)s)")
    return p


# The image options' defaults; None in the parser, so that --text can refuse them when given.
IMAGE_DEFAULTS = {"shards": 8, "test_fraction": 0.1, "val_fraction": 0.0, "seed": 0}
IMAGE_ONLY = ("images", "labels", "image_size", "grayscale", "no_flip", "shards", "test_fraction", "seed")
TEXT_VAL_FRACTION = 0.1
TEXT_SAMPLE_MB = 256
TEXT_SHARD_MB = 64
TEXT_TIMEOUT = 600.0
TEXT_ONLY = ("text_field", "eot", "skip_bad_records", "tokenizer_sample_mb", "shard_mb", "timeout")


def _prepare_text(args):
    given = [f"--{name.replace('_', '-')}" for name in IMAGE_ONLY if getattr(args, name) not in (None, False)]
    if given:
        raise HpctrainError(f"{', '.join(given)}: for images, not --text")
    if args.out is None:
        raise HpctrainError("--text needs --out DIR (where the token shards go)")
    rank, size, comm = _world()
    timeout = TEXT_TIMEOUT if args.timeout is None else args.timeout
    meet = None if comm is None else (lambda found: _meet(comm, found, timeout, "prepare"))
    try:
        prepare_text(args.source if args.source is not None else bundled_text_path(), args.out, text=args.text,
                     val_fraction=TEXT_VAL_FRACTION if args.val_fraction is None else args.val_fraction,
                     force=args.force, text_field=args.text_field or "text", eot=args.eot,
                     skip_bad_records=args.skip_bad_records, rank=rank, size=size, meet=meet,
                     tokenizer_sample_mb=TEXT_SAMPLE_MB if args.tokenizer_sample_mb is None
                     else args.tokenizer_sample_mb,
                     shard_mb=TEXT_SHARD_MB if args.shard_mb is None else args.shard_mb,
                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    except HpctrainError as e:
        if e.report:
            raise
        return e.exit_code   # another rank says what stopped the job
    return 0


def _prepare_images(args):
    given = [f"--{name.replace('_', '-')}" for name in TEXT_ONLY if getattr(args, name) not in (None, False)]
    if given:
        raise HpctrainError(f"{', '.join(given)}: for --text, not images")
    options = {name: IMAGE_DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)
               for name in IMAGE_DEFAULTS}
    out = default_data_dir() if args.out is None else args.out
    prepare(args.source, out, force=args.force, images=args.images, labels=args.labels,
            image_size=args.image_size, grayscale=args.grayscale, no_flip=args.no_flip, **options)


def _attach_dashed_values(argv, flags=("--image-size",)):
    """`--image-size -5,5` as `--image-size=-5,5`: argparse takes a value that
    starts with '-' (and is no plain negative number) for a flag, and would
    answer 'expected one argument' instead of our line about the size."""
    out = []
    for arg in argv:
        if out and out[-1] in flags and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _world():
    """(rank, size, comm): COMM_WORLD under a launcher, else (0, 1, None);
    MPI is started only when the launcher says this is a job of ranks."""
    from hpctrain.base.launcher import in_mpi_job
    if not in_mpi_job():
        return 0, 1, None
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    return comm.Get_rank(), comm.Get_size(), comm


def _size(data_dir, name):
    try:
        return os.path.getsize(os.path.join(data_dir, name))
    except OSError:
        return 0   # missing: check_file names it


def _wait_all(requests, timeout):
    """Poll requests until all are done or timeout s pass; the indices of
    those still open (none: all done)."""
    from mpi4py import MPI
    deadline = time.monotonic() + timeout
    while not MPI.Request.Testall(requests):
        if time.monotonic() > deadline:
            return [i for i, r in enumerate(requests) if not r.Test()]
        time.sleep(0.01)
    return []


def _meet(comm, found, timeout, command="verify"):
    """The ranks' arrays met as their elementwise maximum (verify: one int8
    flag per file; prepare: counts, hashes, flags), every wait bounded:
    rank 0 collects each rank's array and sends back the maximum, naming the
    ranks not heard from within timeout s; another rank names rank 0 if no
    answer comes."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        theirs = [np.empty_like(found) for _ in range(1, size)]
        late = _wait_all([comm.Irecv(b, source=r, tag=7) for r, b in enumerate(theirs, 1)], timeout)
        if late:
            print(f"hpctrain: error: {command}: rank {', '.join(str(i + 1) for i in late)} sent no findings within "
                  f"--timeout {timeout:g} s of rank 0's own share; the job ends", file=sys.stderr, flush=True)
            comm.Abort(3)
            os._exit(3)   # MPI_Abort may return before the launcher ends this rank
        for b in theirs:
            np.maximum(found, b, out=found)
        _wait_all([comm.Isend(found, dest=r, tag=8) for r in range(1, size)], timeout)
        return found
    send = comm.Isend(found, dest=0, tag=7)
    answer = np.empty_like(found)
    # longer than rank 0 waits for a late rank, so that its line, naming that rank, comes first
    patience = 2 * timeout + 5
    if _wait_all([comm.Irecv(answer, source=0, tag=8), send], patience):
        print(f"hpctrain: error: {command}: rank {rank} had no answer from rank 0 within {patience:g} s; "
              f"the job ends", file=sys.stderr, flush=True)
        comm.Abort(3)
        os._exit(3)
    return answer


def _verify(data_dir, log=print, timeout=300.0):
    """`verify DIR`: this rank hashes files r, r + W, ...; rank 0 prints a
    progress line for its share, then each bad file (one line, stderr) or
    the summary. The ranks' findings meet as one flag per file (numpy
    buffers, not pickled objects: house rule), every wait bounded by
    --timeout and naming the rank it waited for (_meet)."""
    rank, size, comm = _world()
    try:
        files = listed_files(data_dir)
    except HpctrainError:
        if rank:   # every rank read the same manifest: rank 0 says why, once
            return 2
        raise
    found = np.zeros(len(files), np.int8)
    problems = {}
    mine = range(rank, len(files), size)
    sizes = {i: _size(data_dir, files[i][0]) for i in mine}   # a tokenizer's is not in the manifest
    total = sum(sizes.values())
    done = 0
    start = shown = time.monotonic()
    for i in mine:
        problem = check_file(data_dir, *files[i])
        if problem:
            found[i], problems[i] = 1, problem
        done += sizes[i]
        now = time.monotonic()
        if rank == 0 and (now - shown >= 1 or i == mine[-1]):
            shown, rate = now, done / max(now - start, 1e-9) / 1e6
            print(f"verify: rank 0 hashed {done / 1e6:.1f} of its {total / 1e6:.1f} MB ({rate:.0f} MB/s); "
                  f"{len(files)} files over {size} rank{'s' * (size > 1)}", file=sys.stderr, flush=True)
    if comm is not None:
        found = _meet(comm, found, timeout)
    # Each rank names the bad files it hashed (it knows why); every rank exits 2 if any is bad.
    for i, problem in sorted(problems.items()):
        print(f"hpctrain: error: {data_dir}/{files[i][0]}: corrupt ({problem}); prepare again with --force",
              file=sys.stderr, flush=True)
    bad = int(found.sum())
    if rank == 0 and not bad:
        log(f"verified {data_dir}: {len(files)} files match manifest.json's sha256")
    return 2 if bad else 0


@one_line_errors
def main(argv=None, prog="python -m hpctrain.data"):
    argv = _attach_dashed_values(sys.argv[1:] if argv is None else list(map(str, argv)))
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.command == "prepare" and args.text is not None:
        return _prepare_text(args)
    elif args.command == "prepare":
        _prepare_images(args)
    elif args.command == "verify":
        return _verify(args.dir, timeout=args.timeout)
    elif args.command == "fetch":
        fetch(args.dataset, args.out, mirror=args.mirror, timeout=args.timeout,
              split=args.split)
    else:
        parser.print_help(sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
