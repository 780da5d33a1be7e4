"""The argument parser every hpctrain command line uses (train, data,
predict, evaluate, bench, plot, checkpoint, nn, pipeline).

    from hpctrain.flags.arguments import Parser
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
  whose full help is long (train's: `--help-all`);
- with_config_file: a `--config FILE` (TOML or JSON) of flags, turned into
  the words of a command line placed before the real one (train's, cli.parse).

Standard library only: training parses its flags before numpy, BLAS or MPI load.
"""
import argparse
import difflib
import math
import re
import sys

from ..base.errors import HpctrainError

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


def auto_or_positive_int(text):
    """'auto' (a value the program decides as it runs) or a whole number >= 1."""
    return "auto" if text.strip().lower() == "auto" else positive_int(text)


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


# --- --config FILE: a file of flags ----------------------------------------------------------

CONFIG_FLAG = "--config"


def with_config_file(parser, argv):
    """argv with the flags of its `--config FILE` (TOML or JSON) placed before
    it, so that the command line's own flags override the file's (argparse:
    the last one given wins) and every value is checked by the flag itself.

    The file's keys are the flags' names, with dashes or underscores
    (`batch_size = 3`, `"block-size": 64`); a value is what the flag takes
    (a list for a comma-separated one: `adam_betas = [0.9, 0.99]`), true or
    false for a switch (`recompute = true`, `sync = false`: --async), null
    for the flag's default. An unknown key, a value of the wrong kind or one
    the flag refuses is one line naming the key and the file (HpctrainError,
    exit 2). A file's choice of two alternatives (--steps or --epochs,
    --sync or --async) gives way to the command line's other one."""
    path = _config_path(argv)
    if path is None:
        return list(argv)
    settings = _read_config(path)
    actions = _config_actions(parser)
    given = {}   # dest -> the key that set it
    words = {}   # key -> its words
    for key, value in settings.items():
        action = actions.get(key) or actions.get(key.replace("-", "_"))
        if action is None:
            close = difflib.get_close_matches(key.replace("-", "_"), list(actions), n=1, cutoff=0.7)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise HpctrainError(f"{CONFIG_FLAG} {path}: unknown key {key!r} (no flag --{key.replace('_', '-')})"
                                f"{hint}")
        if action.dest in given:
            raise HpctrainError(f"{CONFIG_FLAG} {path}: keys {given[action.dest]!r} and {key!r} both set "
                                f"{_flag(action)}")
        given[action.dest] = key
        words[key] = _config_words(parser, path, key, action, value)
        _check(parser, words[key], f"{CONFIG_FLAG} {path}: key {key!r} ({_flag(action)})", alone=True)
    from_file = [w for ws in words.values() for w in ws]
    _check(parser, from_file, f"{CONFIG_FLAG} {path}")
    # The command line's flags win; of two alternatives the file's gives way to the command line's other.
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    named = {by_option[w.partition("=")[0]] for w in _flags_given(list(argv)) if w.partition("=")[0] in by_option}
    beaten = {a for g in parser._mutually_exclusive_groups if named & set(g._group_actions)
              for a in g._group_actions}
    kept = [w for w in from_file if by_option[w.partition("=")[0]] not in beaten]
    return kept + list(argv)


def _config_path(argv):
    """The FILE of argv's --config FILE (or --config=FILE), None without one;
    a --config without its FILE is argparse's to refuse."""
    words = list(argv)
    words = words[:words.index("--")] if "--" in words else words
    found = []
    for i, word in enumerate(words):
        word = str(word)
        if word == CONFIG_FLAG and i + 1 < len(words) and not str(words[i + 1]).startswith("-"):
            found.append(str(words[i + 1]))
        elif word.startswith(CONFIG_FLAG + "="):
            found.append(word.partition("=")[2])
    if len(found) > 1:
        raise HpctrainError(f"{CONFIG_FLAG} given {len(found)} times ({', '.join(found)}): one file, whose flags "
                            f"the command line's override")
    return found[0] if found and found[0].strip() else None


def _read_config(path):
    """The file's settings, {key: value}: TOML (Python 3.11's tomllib) or JSON, by its suffix."""
    import os
    kind = os.path.splitext(path)[1].lower()
    if kind in (".yaml", ".yml"):
        raise HpctrainError(f"{CONFIG_FLAG} {path}: YAML is not read (PyYAML is no dependency of hpctrain); "
                            f"write the same keys as TOML (FILE.toml) or JSON (FILE.json)")
    if kind not in (".toml", ".json"):
        raise HpctrainError(f"{CONFIG_FLAG} {path}: expected FILE.toml or FILE.json (keys: the flags' names)")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise HpctrainError(f"{CONFIG_FLAG} {path}: cannot read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
        if kind == ".json":
            import json
            settings = json.loads(text)
        else:
            settings = _toml().loads(text)
    except UnicodeDecodeError as e:
        raise HpctrainError(f"{CONFIG_FLAG} {path}: not UTF-8 text (byte {e.start})") from None
    except ValueError as e:   # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
        raise HpctrainError(f"{CONFIG_FLAG} {path}: not valid {kind[1:].upper()}: {e}") from None
    if not isinstance(settings, dict):
        raise HpctrainError(f"{CONFIG_FLAG} {path}: expected an object of settings (keys: the flags' names), "
                            f"got a JSON {type(settings).__name__}")
    return settings


def _toml():
    try:
        import tomllib   # Python 3.11+
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            raise HpctrainError(f"{CONFIG_FLAG} FILE.toml needs Python 3.11 (tomllib) or `pip install tomli`; "
                                f"or write the file as JSON") from None
    return tomllib


def _config_actions(parser):
    """{name: action}: each flag by its dest and by its option's name, with
    underscores (dashes are turned into them before the look-up); --help,
    --help-all and --config itself are no settings."""
    found = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, ShortHelp)) \
                or CONFIG_FLAG in action.option_strings:
            continue
        found.setdefault(action.dest, action)
        for option in action.option_strings:
            if option.startswith("--"):
                found.setdefault(option[2:].replace("-", "_"), action)
    return found


def _flag(action):
    return next(o for o in action.option_strings if o.startswith("--"))


def _config_words(parser, path, key, action, value):
    """The command-line words that say what `key = value` says."""
    where = f"{CONFIG_FLAG} {path}: key {key!r} ({_flag(action)})"
    if action.nargs == 0:   # a switch: --recompute, --sync / --async
        if not isinstance(value, bool):
            raise HpctrainError(f"{where}: expected true or false, got {value!r}")
        wanted = value if action.const else not value   # the dest's value (`async = true`: sync False)
        for other in parser._actions:
            if other.dest == action.dest and other.nargs == 0 and other.const == wanted:
                return [_flag(other)]
        return []   # its default: no flag says it
    if value is None:
        return []   # null: the flag's default
    if isinstance(value, list):
        if not all(_scalar(v) for v in value):
            raise HpctrainError(f"{where}: expected a list of numbers or strings, got {value!r}")
        return [f"{_flag(action)}={','.join(map(_word, value))}"]
    if not _scalar(value):
        what = str(value).lower() if isinstance(value, bool) else "a table" if isinstance(value, dict) else \
            type(value).__name__
        raise HpctrainError(f"{where}: expected a number or a string, got {what}")
    return [f"{_flag(action)}={_word(value)}"]


def _scalar(value):
    return isinstance(value, (int, float, str)) and not isinstance(value, bool)


def _word(value):
    return repr(value) if isinstance(value, float) else str(value)


def _check(parser, words, where, alone=False):
    """Parse `words` alone with the parser: its refusal as one line saying
    `where` (alone: one flag's words, which `where` names already)."""
    try:
        parser.parse_args(words)
    except HpctrainError as e:
        message = str(e).removesuffix(" (see --help)")
        message = re.sub(r"^argument [^:]+: ", "", message) if alone else message.removeprefix("argument ")
        raise HpctrainError(f"{where}: {message}") from None
