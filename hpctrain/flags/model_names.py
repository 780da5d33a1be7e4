"""The names `--model` takes, with no numpy imported (the flags are parsed
before numpy, BLAS and MPI start: cli.py): the zoo's (nn/zoo.py), nanoGPT's
`gpt:layers=L,heads=H,width=E[,dropout=P][,act=A][,eps=X]` (nn/gpt.py) and a user's
`FILE.py:FUNCTION` (nn/user.py); what ranks compare, checkpoints record
and trained.py rebuilds from.

    python -c "from hpctrain.flags.model_names import gpt_options; print(gpt_options('gpt:layers=4,heads=4,width=128'))"
"""

# The zoo's names (hpctrain/nn/zoo.py MODELS; this module imports no numpy).
MODELS = ("mlp", "lenet", "cnn", "resnet", "small_cnn")


# --model gpt:KEY=VALUE,...: nanoGPT's model (nn/gpt.py); each key's type, and whether it must be given.
GPT_KEYS = {"layers": (int, True), "heads": (int, True), "width": (int, True), "dropout": (float, False),
            "act": (str, False), "eps": (float, False)}
# act=: the MLP's GELU, exact (nanoGPT's, the default) or GPT-2's tanh form (transformers' gelu_new);
# eps=: every LayerNorm's epsilon (PyTorch's default, nanoGPT's and GPT-2's, unless given).
ACTS = ("gelu", "gelu_tanh")
DEFAULT_ACT, DEFAULT_EPS = "gelu", 1e-5


def is_model_file(name):
    """--model FILE.py:FUNCTION, a user's own model (nn/user.py)."""
    path, _, function = name.rpartition(":")
    return path.endswith(".py") and function.isidentifier()


def gpt_options(name):
    """--model gpt:layers=L,heads=H,width=E[,dropout=P][,act=A][,eps=X] ->
    {"layers": L, ..., "dropout": P (0 when not given), "act": A ("gelu"),
    "eps": X (1e-5)}; None for a name that is not gpt:;
    ValueError naming the problem for one that is and does not parse."""
    kind, colon, options = name.partition(":")
    if kind != "gpt" or not colon:
        return None
    given = {}
    for item in options.split(","):
        key, eq, value = item.strip().partition("=")
        if key not in GPT_KEYS or not eq:
            raise ValueError(f"{item.strip()!r} is not one of {', '.join(k + '=' for k in GPT_KEYS)}")
        if key in given:
            raise ValueError(f"{key}= is given twice")
        kind_of = GPT_KEYS[key][0]
        try:
            given[key] = kind_of(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a{'' if kind_of is int else ' real'} number") from None
    missing = [k for k, (_, needed) in GPT_KEYS.items() if needed and k not in given]
    if missing:
        raise ValueError(f"{', '.join(k + '=' for k in missing)} missing")
    if any(given[k] < 1 for k in ("layers", "heads", "width")):
        raise ValueError("layers, heads and width must be at least 1 each")
    if given["width"] % given["heads"]:
        raise ValueError(f"the width {given['width']} is not a multiple of the heads ({given['heads']})")
    if not 0 <= given.setdefault("dropout", 0.0) < 1:
        raise ValueError(f"dropout={given['dropout']:g} is not in [0, 1)")
    if given.setdefault("act", DEFAULT_ACT) not in ACTS:
        raise ValueError(f"act={given['act']!r} is not one of {', '.join(ACTS)}")
    if not 0 < given.setdefault("eps", DEFAULT_EPS) < 1:   # NaN and inf too
        raise ValueError(f"eps={given['eps']!r} is not in (0, 1)")
    return given


def gpt_name(options):
    """The canonical --model text of gpt_options' dict (what ranks compare and files record)."""
    text = f"gpt:layers={options['layers']},heads={options['heads']},width={options['width']}"
    text += f",dropout={options['dropout']:g}" if options["dropout"] else ""
    text += f",act={options['act']}" if options.get("act", DEFAULT_ACT) != DEFAULT_ACT else ""
    return text + (f",eps={options['eps']!r}" if options.get("eps", DEFAULT_EPS) != DEFAULT_EPS else "")


def input_kind_of(name):
    """What a --model name's first layer takes, known before it is built
    (nn/spec.INPUT_KINDS): "tokens" for a GPT, "image" for the zoo's other
    models, None for a user's file (known once built) or a name that does
    not parse (refused where it is built)."""
    if name in MODELS:
        return "image"
    try:
        return "tokens" if gpt_options(name) is not None else None
    except ValueError:
        return None
