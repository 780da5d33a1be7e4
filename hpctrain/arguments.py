"""The argument parser every hpctrain command line uses (train, data,
predict, evaluate, bench, plot, checkpoint, nn, pipeline).

    from hpctrain.arguments import Parser
    p = Parser(prog=prog, description=...)

What it changes from argparse's:
- a bad argument raises HpctrainError, printed by the command as one line
  `hpctrain: error: ... (see --help)`, exit 2, instead of argparse's usage
  block and exit; under MPI the ranks must first agree on it (a flag bad on
  one rank only, as in an MPMD launch, must still end every rank);
- no prefix matching (allow_abbrev=False): `--epoch 3` would silently be
  `--epochs 3`, and any unique prefix another flag; a misspelt flag is
  refused with the closest real one ("did you mean --epochs?");
- `quiet`: --help prints nothing (non-zero ranks: one copy per job);
- ShortHelp: a --help of a few common flags and the groups, for a parser
  whose full help is long (train's: `--help-all`).

Standard library only: training parses its flags before numpy, BLAS or MPI load.
"""
import argparse
import difflib
import math
import sys

from .errors import HpctrainError

_UNRECOGNIZED = "unrecognized arguments: "
_REQUIRED = ("the following arguments are required", "one of the arguments")   # argparse's words


class Parser(argparse.ArgumentParser):
    quiet = False

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)   # subcommands' parsers too (add_subparsers makes them with our class)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self._argv = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(args, namespace)

    def print_help(self, file=None):
        if not self.quiet:
            super().print_help(file)

    def error(self, message):
        known = self._known_flags()
        if message.startswith(_REQUIRED):
            # A misspelt flag is the mistake to name, not the "required" flag it was meant to be.
            unknown = [w for w in _flags_given(getattr(self, "_argv", [])) if w.partition("=")[0] not in known]
            if unknown:
                message = _UNRECOGNIZED + " ".join(unknown)
        if message.startswith(_UNRECOGNIZED):
            message += _did_you_mean(message[len(_UNRECOGNIZED):].split(" "), known)
        raise HpctrainError(f"{message} (see --help)")

    def _known_flags(self):
        """This parser's flags and those of the subcommands its arguments name
        (argparse reports a subcommand's unknown flag from the top parser)."""
        argv = getattr(self, "_argv", [])
        flags = []
        for action in self._actions:
            flags += action.option_strings
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if name in argv and isinstance(sub, Parser):
                        flags += sub._known_flags()
        return flags


def _flags_given(argv):
    """The --words of a command line, up to a lone "--" (after it, arguments are not flags)."""
    words = argv[:argv.index("--")] if "--" in argv else argv
    return [w for w in words if w.startswith("--")]


def _did_you_mean(words, flags):
    """'; did you mean --epochs?' for the first unknown --flag close to a real one, else ''."""
    for word in words:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.partition("=")[0], flags, n=1, cutoff=0.7)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


class ShortHelp(argparse.Action):
    """--help as the flags `common` names and the groups with their flag
    counts, a screenful; the parser's "--help-all" (action="help") prints all."""

    def __init__(self, option_strings, common, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)
        self.common = common

    def __call__(self, parser, namespace, values, option_string=None):
        if not parser.quiet:
            print(self.text(parser))
        parser.exit()

    def text(self, parser):
        formatter = parser._get_formatter()
        formatter.add_usage(f"{parser.prog} [FLAGS]   (--help-all: every flag)", None, [], prefix="usage: ")
        formatter.add_text(parser.description)
        by_flag = {o: a for a in parser._actions for o in a.option_strings}
        formatter.start_section("the flags most runs use")
        formatter.add_arguments([by_flag[flag] for flag in self.common])
        formatter.end_section()
        groups = [(g.title, sum(not isinstance(a, (argparse._HelpAction, ShortHelp)) for a in g._group_actions))
                  for g in parser._action_groups]
        listing = "\n".join(f"  {title} ({count} flags)" for title, count in groups if count)
        return f"{formatter.format_help().rstrip()}\n\ngroups (--help-all lists every flag of each):\n{listing}"


def positive_ints(text, what):
    """'64,32' -> (64, 32): whole numbers >= 1, comma-separated (empty items
    skipped), for a flag's type=; an ArgumentTypeError naming `what` otherwise."""
    try:
        numbers = tuple(int(d) for d in text.split(",") if d.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers for {what}, got {text!r}")
    if any(d < 1 for d in numbers):
        raise argparse.ArgumentTypeError(f"{what} must be >= 1 each, got {text!r}")
    return numbers


# Number types for flags (type=): one ArgumentTypeError line naming the rule.

def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def nonneg_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def finite_float(text):
    value = float(text)
    if not math.isfinite(value):   # inf and nan parse as floats; neither is a setting
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text):
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonneg_float(text):
    value = finite_float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
