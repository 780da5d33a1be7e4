"""The data command line: prepare shards from IDX files, or download MNIST/Fashion-MNIST.

    python -m hpctrain.data prepare --source data/mnist-5k --out data/mnist --shards 8
    python -m hpctrain.data fetch --dataset mnist --out data/raw/mnist
    python -m hpctrain.data prepare --source data/raw/mnist --out data/mnist --force

Bad input is one line on stderr (`hpctrain: error: ...`) and exit 2; no
command prints the help and exits 2. No MPI here (house rule).
"""

import argparse
import sys

from hpctrain.errors import HpctrainError

from .fetch import MD5, fetch
from .manifest import bundled_sample_dir, default_data_dir
from .prepare import prepare


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m hpctrain.data",
        description="Prepare HDF5 training shards from IDX files, or download MNIST/Fashion-MNIST.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    pp = sub.add_parser("prepare", help="IDX files -> class-balanced HDF5 shards + manifest.json",
                        description="Write train-0000i-of-0000S.h5, test-00000-of-00001.h5 and "
                                    "manifest.json into --out, atomically.")
    pp.add_argument("--source", metavar="DIR", default=str(bundled_sample_dir()),
                    help="directory with train-/t10k-*-idx?-ubyte[.gz] files, or one "
                         "*images*idx3* + *labels*idx1* pair (default: the bundled 5k sample)")
    pp.add_argument("--out", metavar="DIR", default=str(default_data_dir()),
                    help="output directory (default: data/mnist in the repository)")
    pp.add_argument("--shards", type=int, default=8,
                    help="number of training shards; at least the number of workers reads "
                         "whole shards (default: %(default)s)")
    pp.add_argument("--test-fraction", type=float, default=0.1,
                    help="test share when splitting a single images/labels pair, stratified by "
                         "class; ignored for train/t10k sources (default: %(default)s)")
    pp.add_argument("--seed", type=int, default=0,
                    help="seed of the split and the shuffles (default: %(default)s)")
    pp.add_argument("--force", action="store_true",
                    help="replace --out if it already holds files")

    pf = sub.add_parser("fetch", help="download MNIST or Fashion-MNIST and verify MD5 checksums",
                        description="Download the four standard .gz files into --out; files "
                                    "already there with the right checksum are kept.")
    pf.add_argument("--dataset", choices=sorted(MD5), default="mnist",
                    help="which dataset (default: %(default)s)")
    pf.add_argument("--out", metavar="DIR", required=True,
                    help="directory for the .gz files (then: prepare --source DIR)")
    pf.add_argument("--mirror", metavar="URL", default=None,
                    help="base URL holding the four files (default: the dataset's public mirror)")
    pf.add_argument("--timeout", type=float, default=60.0,
                    help="seconds to wait for the network before giving up (default: %(default)s)")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.source, args.out, shards=args.shards, test_fraction=args.test_fraction,
                    seed=args.seed, force=args.force)
        elif args.command == "fetch":
            fetch(args.dataset, args.out, mirror=args.mirror, timeout=args.timeout)
        else:
            parser.print_help(sys.stderr)
            return 2
    except HpctrainError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
