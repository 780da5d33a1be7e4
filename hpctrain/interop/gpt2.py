"""Hugging Face's GPT-2 (`GPT2LMHeadModel`) and hpctrain's GPT, one model
in two sets of names (docs/models.md has the table):

    hpctrain                    GPT-2 (transformers)
    embedding/E       (V, E)    transformer.wte.weight      (V, E)   the head (head/W) tied to it in both
    position/P        (T, E)    transformer.wpe.weight      (n_positions, E): its first T rows
    blocks.i/ln1.gamma, .beta   transformer.h.i.ln_1.weight, .bias
    blocks.i/attn.Wqkv (E, 3E)  transformer.h.i.attn.c_attn.weight (E, 3E)
    blocks.i/attn.bqkv, Wo, bo  ...attn.c_attn.bias, attn.c_proj.weight, .bias
    blocks.i/ln2.gamma, .beta   ...ln_2.weight, .bias
    blocks.i/fc.W, fc.b         ...mlp.c_fc.weight (E, 4E), .bias
    blocks.i/proj.W, proj.b     ...mlp.c_proj.weight (4E, E), .bias
    ln_f/gamma, beta            transformer.ln_f.weight, .bias

GPT-2's Conv1D stores its weight input x output and computes x W + b,
hpctrain's Linear the same: no transpose. Its fused qkv columns are q | k | v,
each heads side by side (split(n_embd), then view(heads, head width)), as
hpctrain's attention reads them (nn/attention.py `_heads`): no permutation
(tests/test_interop_hf.py holds the two models' losses within 1e-4).

- `names(spec)`: {hpctrain name: GPT-2 name} of a GPT spec; one line for a
  model that is not hpctrain's GPT;
- `config_of(spec, model)`: the config.json of an export; `model_of(config,
  where)`: the --model name (gpt:...) and sizes of a config.json, one line
  for another architecture or a GPT-2 variant hpctrain does not build;
- `tokenizer_files(vocab, block)`: tokenizer.json and tokenizer_config.json
  that `AutoTokenizer.from_pretrained` loads, its ids hpctrain's exactly.

    python -m pytest -q tests/test_interop_hf.py
"""
import json

from ..base.errors import HpctrainError
from ..flags.model_names import gpt_options

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
PICKLED = "pytorch_model.bin"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
EPS = 1e-5   # hpctrain's LayerNorm epsilon when the name gives none (nn/norm.py), GPT-2's too

# a block's tensors: hpctrain's inner name -> GPT-2's within transformer.h.i
BLOCK = {"ln1.gamma": "ln_1.weight", "ln1.beta": "ln_1.bias",
         "attn.Wqkv": "attn.c_attn.weight", "attn.bqkv": "attn.c_attn.bias",
         "attn.Wo": "attn.c_proj.weight", "attn.bo": "attn.c_proj.bias",
         "ln2.gamma": "ln_2.weight", "ln2.beta": "ln_2.bias",
         "fc.W": "mlp.c_fc.weight", "fc.b": "mlp.c_fc.bias",
         "proj.W": "mlp.c_proj.weight", "proj.b": "mlp.c_proj.bias"}
# GPT-2's activations hpctrain's GELU computes: its `approximate` (PyTorch's name) -> --model's act=
ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def names(spec):
    """{hpctrain name: GPT-2 name} of every tensor of a GPT spec (the whole
    model's, its layers named by nn/gpt.py: embedding, position, blocks.i,
    ln_f), in the spec's order; one line for another model."""
    tensors = [name for name, _, _, _ in spec.full.tensors]
    blocks = sum(1 for layer in spec.full.layer_names if layer.startswith("blocks."))
    out = {"embedding/E": "transformer.wte.weight", "position/P": "transformer.wpe.weight",
           "ln_f/gamma": "transformer.ln_f.weight", "ln_f/beta": "transformer.ln_f.bias"}
    for i in range(blocks):
        out.update({f"blocks.{i}/{inner}": f"transformer.h.{i}.{theirs}" for inner, theirs in BLOCK.items()})
    if not blocks or set(out) != set(tensors) or spec.state:
        raise HpctrainError(f"model {spec.name} is not hpctrain's GPT (--model gpt:...): only a GPT has GPT-2's "
                            f"tensors; export it as safetensors")
    return {name: out[name] for name in tensors}


def model_name(options):
    """The --model text of a GPT's options {layers, heads, width, dropout,
    act ("none"|"tanh"), eps}: gpt:layers=L,heads=H,width=E, then
    dropout=, act=gelu_tanh and eps= where not the defaults."""
    text = f"gpt:layers={options['layers']},heads={options['heads']},width={options['width']}"
    if options.get("dropout"):
        text += f",dropout={options['dropout']:g}"
    if options.get("act", "none") == "tanh":
        text += ",act=gelu_tanh"
    if float(options.get("eps", EPS)) != EPS:
        text += f",eps={float(options['eps']):g}"
    return text


def _gelu_and_eps(spec):
    """(approximate, eps) of a GPT spec's layers: its blocks' GELU's form and LayerNorms' epsilon."""
    blocks = [layer for layer in spec.full.layers if hasattr(layer, "mlp_path")]
    gelu = blocks[0].mlp_path[2]
    eps = {float(getattr(b.attn_path[0], "eps", EPS)) for b in blocks} | \
        {float(getattr(b.mlp_path[0], "eps", EPS)) for b in blocks} | {float(getattr(spec.full.layers[-2], "eps", EPS))}
    if len(eps) != 1:
        raise HpctrainError(f"model {spec.name}: LayerNorms of several epsilons ({sorted(eps)}); GPT-2 has one")
    return getattr(gelu, "approximate", "none"), eps.pop()


def config_of(spec):
    """config.json of the GPT `spec` as a GPT2LMHeadModel (transformers)."""
    options = gpt_options(spec.name) or {}
    approximate, eps = _gelu_and_eps(spec)
    dropout = float(options.get("dropout", 0.0))
    blocks = [layer for layer in spec.full.layers if hasattr(layer, "mlp_path")]
    width = spec.full.tensors[0][1][1]
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": int(spec.classes), "n_positions": int(spec.input_shape[0]), "n_embd": int(width),
            "n_layer": len(blocks), "n_head": int(blocks[0].attn_path[1].heads), "n_inner": None,
            "activation_function": "gelu_new" if approximate == "tanh" else "gelu",
            "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout,
            "layer_norm_epsilon": eps, "initializer_range": 0.02, "tie_word_embeddings": True,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            # no special tokens: hpctrain's vocabularies have none (GPT-2's 50256 would lie past this one)
            "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}


def read_config(folder):
    """A folder's config.json as a dict; one line where it is missing or not JSON."""
    path = f"{folder}/{CONFIG}"
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise HpctrainError(f"{folder}: no {CONFIG} (a Hugging Face model folder has one)") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise HpctrainError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(config, dict):
        raise HpctrainError(f"{path}: not a JSON object")
    return config


def model_of(config, where):
    """(--model name, vocabulary size, n_positions) of a GPT-2 config.json
    (where: its path, for the lines); one line for another architecture or
    what hpctrain's GPT does not compute."""
    kind = config.get("model_type")
    if kind != "gpt2":
        raise HpctrainError(f"{where}: a {kind or 'unnamed'} model (model_type); hpctrain's GPT imports GPT-2 "
                            f"(model_type gpt2) only")

    def whole(key, default=None):
        value = config.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise HpctrainError(f"{where}: {key} is {value!r}, not a positive whole number")
        return value
    layers, heads, width = whole("n_layer"), whole("n_head"), whole("n_embd")
    vocab, positions = whole("vocab_size"), whole("n_positions")
    act = config.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise HpctrainError(f"{where}: activation_function {act!r}; hpctrain's GPT computes "
                            f"{', '.join(ACTIVATIONS)} (exact or tanh GELU)")
    inner = config.get("n_inner")
    if inner not in (None, 4 * width):
        raise HpctrainError(f"{where}: n_inner {inner}; hpctrain's GPT has an MLP of 4 x n_embd ({4 * width})")
    if config.get("tie_word_embeddings", True) is not True:
        raise HpctrainError(f"{where}: tie_word_embeddings is false; hpctrain's GPT ties its head to wte")
    for key, plain in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
        if config.get(key, plain) != plain:
            raise HpctrainError(f"{where}: {key} {config[key]!r}; hpctrain's attention has {plain}")
    eps = config.get("layer_norm_epsilon", EPS)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise HpctrainError(f"{where}: layer_norm_epsilon is {eps!r}, not a positive number")
    if width % heads:
        raise HpctrainError(f"{where}: n_embd {width} is not a multiple of n_head {heads}")
    name = model_name({"layers": layers, "heads": heads, "width": width, "act": ACTIVATIONS[act], "eps": eps})
    return name, vocab, positions


# --- the tokenizer beside an export -----------------------------------------------


def tokenizer_json(vocab):
    """tokenizer.json (a `tokenizers` Tokenizer's JSON) whose ids are the
    vocabulary's (data/vocab.py): a BPE's own; for `chars` a BPE without
    merges over the characters (each character its id); for `bytes` GPT-2's
    byte-level alphabet without merges (byte b: id b)."""
    from ..data.vocab import _tokenizers
    if vocab.kind == "bpe":
        return vocab.tokenizer.to_str()
    tk = _tokenizers()
    if vocab.kind == "chars":
        tokenizer = tk.Tokenizer(tk.models.BPE({c: i for i, c in enumerate(vocab.vocabulary)}, []))
        tokenizer.decoder = tk.decoders.Fuse()
    else:
        # ByteLevel maps each byte to a printable character (GPT-2's table); without its regex the
        # text stays one piece, cut into bytes, each byte's character its id
        alphabet = _byte_alphabet()
        tokenizer = tk.Tokenizer(tk.models.BPE({alphabet[b]: b for b in range(256)}, []))
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
    return tokenizer.to_str()


def _byte_alphabet():
    """GPT-2's bytes_to_unicode: byte b -> the printable character ByteLevel writes for it."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def tokenizer_config(block):
    """tokenizer_config.json: the fast tokenizer its tokenizer.json makes, the context length."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(block),
            "clean_up_tokenization_spaces": False}
