"""A model is a spec, then buffers.

`ModelSpec(layers, input_shape, classes, loss=, input_kind=)` runs each
layer's `configure` on the shape before it (nn/layers.py: the layer
contract), has the loss (nn/losses.py; softmax cross-entropy over classes
by default) check the last layer's output, and lays every trainable
tensor, layer by layer, into one flat buffer. `input_kind` says what the
first layer takes (its `input_kind`, nn/layers.py), which the data's reader
must give (run/startup.py checks it against data.input_kind): "image"
(float pixels in [0, 1], data/reader.py) or "tokens" (integer ids, for the
embedding: data/tokens.py). Whoever needs the
model's size, identity, memory or layout asks the spec, without building
anything: rank agreement and checkpoints (`identity`, `num_params`), the
memory check (`memory_bytes`), ps placement (`tensor_ranges`), fusion
(`layer_ranges`), the pipeline's stage balance (`flops`), the optimizer's
weight decay (`decay_ranges`: where the layers' `decays` tensors lie).

`spec.build(xp, params=, grads=)` then returns the model (nn/sequential.py)
over buffers the caller owns (the ring's gradient buffer, the ps shared-memory
window) or fresh ones, through the plain parameter store (nn/store.py).

Layout: layers in order, layer 0 first; within a layer its tensors in
`param_shapes()` order. Backprop finishes the last layer first, so the
finished part of the gradient grows from the end of the buffer towards its
start, which is what bucket fusion relies on. A tied tensor (nn/tied.py)
lies once, in the layer that owns it (`ties`; a checkpoint records it once,
with its `aliases`). A tensor's name is its layer's path in the model and
its own, `PATH/tensor` (the GPT's `embedding/E`, `blocks.0/attn.Wqkv`,
`ln_f/gamma`: Layer.named, where the model is built), or `layer{k}/{tensor}`
for a layer without a path, k counting the layers that hold tensors (the
MLP's `layer0/W`, `layer0/b`, ...): the checkpoints' and `--save` files'
datasets. Files written before layers had paths are read through
`name_in_file`. Non-trainable state (batch-norm
statistics) is laid out the same way in a buffer of its own.

    python -m hpctrain.nn               # the MLP's layers, shapes and buffer layout
"""
import copy
import hashlib
import math
import os
import traceback

import numpy as np

from . import compiled
from .grad_slots import GradSlots
from .layers import LayerError, describe
from .layer_errors import LayerCodeError
from .losses import ClassCrossEntropy, Loss
from .sequential import Sequential
from .store import PlainStore
from ..base.precision import FLOAT32
from .tensor_parallel import local_layout
from .tensor_split import split_model
from .tied import declared, resolve


def _call(i, layer, what, fn, *args):
    """fn(*args), a layer's own method: a LayerError is its one line about
    the input; anything else it raises is its code's, named."""
    try:
        return fn(*args)
    except LayerCodeError:
        raise
    except LayerError as e:
        raise LayerError(f"layer {i} ({describe(layer)}): {e}") from None
    except (Exception, SystemExit) as e:
        did = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
        raise LayerCodeError(f"layer {i} ({describe(layer)}): {what} {did}", traceback.format_exc()) from None


def _call_loss(loss, what, fn, *args):
    """fn(*args), a method of the model's loss, like _call for a layer."""
    name = _loss_name(loss)
    try:
        return fn(*args)
    except LayerError:   # its one line about the last layer's output
        raise
    except (Exception, SystemExit) as e:
        did = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
        raise LayerCodeError(f"the loss ({name}): {what} {did}", traceback.format_exc()) from None


def _loss_name(loss):
    """loss.describe(), or its class name where a user's describe() fails."""
    try:
        text = loss.describe()
        return text if isinstance(text, str) else type(loss).__name__
    except Exception:
        return type(loss).__name__


def _dims(value, empty_ok):
    """value as a tuple of positive ints, or None when it is not one."""
    try:
        dims = tuple(value)
    except TypeError:
        return None
    if not dims and not empty_ok:
        return None
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) and d >= 1 for d in dims):
        return None
    return tuple(int(d) for d in dims)


def _tensors(i, layer, what, value, taken):
    """A layer's [(name, shape), ...] checked: names unique within the layer
    (params and state share its group in --save), shapes of positive ints."""
    where = f"layer {i} ({describe(layer)}): {what}"
    if not isinstance(value, (list, tuple)):
        raise LayerCodeError(f"{where} returned {type(value).__name__}, not a list of (name, shape)")
    out = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise LayerCodeError(f"{where} returned {item!r} in its list, not a (name, shape) pair")
        name, shape = item
        if not isinstance(name, str) or not name or "/" in name:
            raise LayerCodeError(f"{where}: tensor name {name!r} is not a non-empty string without '/'")
        if name in taken:
            raise LayerCodeError(f"{where}: tensor name {name!r} is used twice in the layer (each names one "
                                 f"dataset of --save)")
        dims = _dims(shape, empty_ok=True)
        if dims is None:
            raise LayerCodeError(f"{where}: tensor {name!r} has shape {shape!r}, not a tuple of positive whole "
                                 f"numbers")
        taken.add(name)
        out.append((name, dims))
    return out


def _decays(i, layer, names):
    """The names of layer i's tensors that weight decay applies to: its
    `decays` and its inner layers' (`inner`: (prefix, layer)) as
    prefix.name, each one of its tensors `names`."""
    def walk(layer):
        own = getattr(layer, "decays", ())
        if isinstance(own, str) or not all(isinstance(n, str) for n in own):
            raise LayerCodeError(f"layer {i} ({describe(layer)}): decays is {own!r}, not a tuple of tensor names")
        return [*own, *(f"{prefix}.{n}" for prefix, inner in getattr(layer, "inner", ()) for n in walk(inner))]
    decays = walk(layer)
    for name in decays:
        if name not in names:
            raise LayerCodeError(f"layer {i} ({describe(layer)}): decays names {name!r}, not one of its tensors "
                                 f"({', '.join(names) or 'none'})")
    return set(decays)


def _reused(layers):
    """Refuse a layer object that appears twice (a reused ReLU(), d = Dense(64)
    listed twice for tied weights): each place binds its own views, and one
    object would hold the last place's only."""
    seen = {}

    def walk(layer, where):
        first = seen.setdefault(id(layer), where)
        if first != where:
            raise LayerCodeError(f"{where} ({describe(layer)}) is the same object as {first}: every place in the "
                             f"list needs a layer of its own (make a new one, e.g. {type(layer).__name__}(...), "
                             f"for each); to share a tensor between layers, tie it: layer.tie(name, owner, tensor) "
                             f"(docs/models.md)")
        for prefix, inner in getattr(layer, "inner", ()):
            walk(inner, f"{where}.{prefix}")
    for i, layer in enumerate(layers):
        walk(layer, f"layer {i}")


def _layer_name(i, layer, k, holds):
    """Layer i's name: its path in the model (Layer.named, given where the
    model is built), else `layer{k}` (k counting the layers with tensors
    before it) where it holds tensors (`holds`), else `layers.{i}` (a tie's
    alias may name it); LayerCodeError (one line) for a path that is not a name."""
    path = getattr(layer, "model_path", None)
    if path is None:
        return f"layer{k}" if holds else f"layers.{i}"
    if not isinstance(path, str) or not path or "/" in path:
        raise LayerCodeError(f"layer {i} ({describe(layer)}): its path {path!r} is not a non-empty string "
                             f"without '/'")
    return path


# What a model's first layer may take (input_kind), each a kind of data a reader gives.
INPUT_KINDS = ("image", "tokens")


class ModelSpec:
    def __init__(self, layers, input_shape, classes, name="custom", code=None, loss=None, input_kind=None,
                 tensor=None, full=None):
        """code: a digest of the code that made the layers (a user's model
        file and what it imports beside it, nn/user.py), which ranks compare.
        loss: a nn/losses.Loss (None: softmax cross-entropy over classes).
        input_kind: what the model takes (INPUT_KINDS; None: its first layer's).
        tensor: a nn/tensor_parallel.TensorGroup: this rank's slice of the
        model split over it (made by `split_tensor`); full: then the whole
        model's spec."""
        self.layers, self.name, self.code = list(layers), name, code
        self.tensor, self.full = tensor, self if full is None else full
        # --recompute: the runner recomputes each recompute unit's activations in
        # backward (nn/sequential.LayerRange); the same bits, less memory
        self.recompute = False
        self._counted = {}   # memory_bytes' counts per layer, summed (_range_counts)
        self.input_shape, self.classes = tuple(int(d) for d in input_shape), int(classes)
        self.loss = ClassCrossEntropy() if loss is None else loss
        if not isinstance(self.loss, Loss):
            raise LayerCodeError(f"the model's loss is a {type(self.loss).__name__}, not a loss "
                                 f"(subclass hpctrain.nn.Loss)")
        if input_kind is None and self.layers:
            input_kind = getattr(self.layers[0], "input_kind", "image")
        if input_kind not in INPUT_KINDS:
            raise LayerCodeError(f"the model's input kind {input_kind!r} (its first layer's input_kind) is none of "
                                 f"{', '.join(INPUT_KINDS)}")
        self.input_kind = input_kind
        _reused(self.layers)
        # --tensor-parallel: which layers split, decided before they are configured
        self.split_layers = split_model(self.layers, self.loss, tensor) if tensor is not None else []
        shape = self.input_shape
        self.shapes = []   # each layer's output shape
        for i, layer in enumerate(self.layers):
            given = _call(i, layer, "configure", layer.configure, shape)
            shape = _dims(given, empty_ok=False)
            if shape is None:
                raise LayerCodeError(f"layer {i} ({describe(layer)}): configure returned {given!r}, not an "
                                     f"output shape (a tuple of positive whole numbers)")
            self.shapes.append(shape)
        _call_loss(self.loss, "check", self.loss.check, shape, self.classes)
        self.layer_tensors, self.layer_state = [], []   # per layer: [(name, shape, lo, hi)]
        self.tensors, self.state = [], []
        self.param_layers = []   # indices of the layers with parameters (of their own, laid out)
        self.ties = []   # nn/tied.Tie: a layer's tensor that is an earlier layer's
        decayed = []     # (lo, hi) of the tensors weight decay applies to (a tied one: at its owner)
        ties = declared(self.layers)
        self.layer_names = []   # each layer's path (`blocks.0`, its builder's), else `layer{k}` (_layer_name)
        self.positional = {}    # {tensor name: its positional name, `layer{k}/W`} where they differ (name_in_file)
        n = s = k = 0
        for i, layer in enumerate(self.layers):
            taken = set()
            params = _tensors(i, layer, "param_shapes()", _call(i, layer, "param_shapes", layer.param_shapes), taken)
            decays = _decays(i, layer, [name for name, _ in params])
            if i in ties:   # a tied tensor takes no room: it is its owner's
                params, mine = resolve(i, layer, params, ties[i], lambda j: self.layer_tensors[j])
                self.ties.extend(mine)
            state = _tensors(i, layer, "state_shapes()", _call(i, layer, "state_shapes", layer.state_shapes), taken)
            self.layer_names.append(_layer_name(i, layer, k, bool(params or state)))
            if self.layer_names[i] in self.layer_names[:i]:
                raise LayerCodeError(f"layer {i} ({describe(layer)}): its name {self.layer_names[i]!r} is layer "
                                     f"{self.layer_names.index(self.layer_names[i])}'s too (each layer's tensors are "
                                     f"named NAME/tensor)")
            n = self._lay(params, self.layer_names[i], k, n, self.layer_tensors, self.tensors)
            s = self._lay(state, self.layer_names[i], k, s, self.layer_state, self.state)
            decayed += [(lo, hi) for name, _, lo, hi in self.layer_tensors[i] if name.split("/", 1)[1] in decays]
            if params:
                self.param_layers.append(i)
            k += bool(params or state)
        self.num_params, self.num_state = n, s
        self.decay_ranges = tuple(decayed)   # in buffer order: sorted, disjoint
        # (lo, hi) of each layer with parameters, in buffer order
        self.layer_ranges = [(self.layer_tensors[i][0][2], self.layer_tensors[i][-1][3]) for i in self.param_layers]
        # {tensor name: nn/tensor_parallel.Cut} of the split layers' own tensors (none without --tensor-parallel)
        self.cuts = {full: cut for i in self.split_layers for full, _, _, _ in self.layer_tensors[i]
                     for name, cut in self.layers[i].tensor_cuts().items() if full.split("/", 1)[1] == name}

    def split_tensor(self, group):
        """This model as tensor rank `group.rank` of `group.size` holds it
        (nn/tensor_parallel.py): a spec of fresh copies of the layers, split;
        its `full` is this spec (identity, fingerprint, the files' layout),
        its buffers this rank's slices. LayerError (one line) where the
        model does not split over `group`."""
        if group.size == 1:
            return self
        local = ModelSpec(copy.deepcopy(self.layers), self.input_shape, self.classes, name=self.name,
                          code=self.code, loss=copy.deepcopy(self.loss), input_kind=self.input_kind, tensor=group,
                          full=self)
        layout = local_layout(self, local.cuts, group.rank)
        if [(name, shape) for name, _, _, shape, _, _ in layout] != [(n, s) for n, s, _, _ in local.tensors]:
            raise LayerCodeError("the split model's tensors are not the whole model's cut (a layer's "
                                 "tensor_cuts do not match its param_shapes)")
        return local

    def init_split(self, i, rng, views, dtype):
        """Split layer i's initial slices into `views`: the whole layer's
        draw (the full spec's layer, from the same stream), cut, so every
        --tensor-parallel starts from the parameters of one process."""
        whole = self.full.layers[i]
        full = {name: np.zeros(shape, dtype) for name, shape in whole.param_shapes()}
        whole.init(rng, full, dtype)
        cuts, t = self.layers[i].tensor_cuts(), self.tensor.rank
        for name, view in views.items():
            view[...] = cuts[name].take(full[name], t) if name in cuts else full[name]

    def _lay(self, shapes, prefix, k, offset, per_layer, flat):
        mine = []
        for tensor, shape in shapes:
            size = math.prod(shape)
            mine.append((f"{prefix}/{tensor}", tuple(shape), offset, offset + size))
            if prefix != f"layer{k}":
                self.positional[f"{prefix}/{tensor}"] = f"layer{k}/{tensor}"
            offset += size
        per_layer.append(mine)
        flat.extend(mine)
        return offset

    # --- what others ask ------------------------------------------------------
    def aliases(self):
        """{tensor name: [{"name": the alias, "transpose": bool}]} of the tied
        tensors (nn/tied.py): what a checkpoint's index records of a tie
        (the GPT's head/W, its embedding/E read transposed)."""
        full = self.full
        owners = {(lo, hi): name for name, _, lo, hi in full.tensors}
        out = {}
        for t in full.ties:
            out.setdefault(owners[(t.lo, t.hi)], []).append({"name": f"{full.layer_names[t.user]}/{t.name}",
                                                             "transpose": t.transposed})
        return out

    def name_in_file(self, held):
        """name -> its name in a file (a checkpoint, a --save file, an export)
        that holds the tensors `held`: the model's own names, or, where the
        file was written before the model's layers had paths (it holds
        `layer{k}/W` for `blocks.0/W`), the positional ones, k counting the
        layers with tensors; an optimizer's state by the same names
        (`adam.m/blocks.0/W` as `adam.m/layer2/W`). Every reader of such a
        file asks through it."""
        old = self.full.positional
        if not old or any(name in held for name in old):
            return lambda name: name

        def positional(name):
            head, _, rest = name.partition("/")
            return old[name] if name in old else f"{head}/{old[rest]}" if rest in old else name
        return positional

    def tensor_ranges(self):
        """(name, lo, hi) of each parameter tensor in the flat buffer."""
        return [(name, lo, hi) for name, _, lo, hi in self.tensors]

    def views(self, buffer, i, of="params", base=0):
        """Layer i's tensors as views of `buffer`, keyed by the layer's own
        names; base: the model's offset where `buffer` starts (a slice)."""
        return {name.split("/", 1)[1]: buffer[lo - base:hi - base].reshape(shape)
                for name, shape, lo, hi in (self.layer_tensors if of == "params" else self.layer_state)[i]}

    @property
    def identity(self):
        """What rank agreement, checkpoints and resume compare: the zoo's name,
        and for anything but the MLP (whose --hidden and parameter count pin it
        down) a digest of every layer and its shapes (the whole model's: a
        tensor-parallel slice has the identity of the model it is cut from)."""
        if self.full is not self:
            return self.full.identity
        if self.name == "mlp":
            return "mlp"
        text = ";".join(f"{describe(layer)}:{shape}" for layer, shape in zip(self.layers, self.shapes))
        text += "".join(f";tie {t.user}.{t.name}={t.owner}.{t.tensor}{'T' if t.transposed else ''}" for t in self.ties)
        digest = hashlib.sha256(f"{self.input_shape};{text}".encode()).hexdigest()[:12]
        name = self.name.replace(os.sep, "/").rsplit("/", 1)[-1]   # a user's FILE.py:FUNCTION, without its folder
        # the whole name (issue 54, 9: its last 40 characters were kept, "pt:layers=2,..." in every listing);
        # ranks compare a hash of it (fingerprint), not it
        return f"{name} {digest}"

    @property
    def fingerprint(self):
        """What ranks compare at start-up (run/startup.py), beyond the identity
        checkpoints record: every tensor's name and shape, the state's too,
        so two copies of a user's file that differ where describe() does not
        look (a constant, a parameter shape) are not one model."""
        if self.full is not self:
            return self.full.fingerprint
        text = ";".join(f"{name}{shape}" for name, shape, _, _ in self.tensors + self.state)
        # the loss's class by name alone: a user's module is named per process (nn/user.py)
        text += f";loss {type(self.loss).__qualname__} {_loss_name(self.loss)};input {self.input_kind}"
        return hashlib.sha256(f"{self.identity};{text}".encode()).hexdigest()[:16]

    @property
    def min_batch(self):
        """The smallest per-rank batch every layer can train on (BatchNorm1d: 2)."""
        return max((int(getattr(layer, "min_batch", 1)) for layer in self.layers), default=1)

    @property
    def draws_noise(self):
        """Whether training needs `noise` (a Dropout, inside a container too):
        the loops pass the batch's sample ids only then."""
        def draws(layer):
            return layer.draws_noise or any(draws(inner) for _, inner in getattr(layer, "inner", ()))
        return any(draws(layer) for layer in self.layers)

    def flops(self):
        """Forward multiply-adds per sample, layer by layer."""
        return [layer.flops() for layer in self.layers]

    def train_flops(self):
        """Forward + backward multiply-adds per sample, layer by layer: a
        layer's backward computes its weights' gradient and its input's, each
        about its forward's work, except the model's first layer with
        parameters, whose input gradient nobody needs (backprop stops there)."""
        first = self.param_layers[0] if self.param_layers else None
        return [f * (2 if i == first else 3) for i, f in enumerate(self.flops())]

    def memory_bytes(self, batch, optimizer_states, itemsize=4, a=0, b=None, copies=1, buffers=2, threads=1):
        """Bytes one rank needs for training layers [a, b) (all of them by
        default) at least: `buffers` flat buffers of their parameters
        (parameters and gradients: 2; a pipeline stage keeps 3, a
        micro-batch's gradient beside the step's sum) and `optimizer_states`
        more (Adam: 2), their non-trainable state, their input (the batch:
        float32 and its uint8 copy; a later stage: the activations it
        receives), `copies` sets of every layer's activations and input
        gradients (a pipeline stage's slots: the schedule's micro-batches in
        flight, each a context per layer; with --recompute, less:
        activation_floats) and each of the rank's `threads` compute threads' scratch
        (nn/threads.py: a convolution's blocks). An estimate from below."""
        b = len(self.layers) if b is None else b
        params, state, acts, once, scratch = self._range_counts(a, b)
        given = batch * math.prod(self.input_shape) * 5 if a == 0 else \
            itemsize * batch * math.prod(self.shapes[a - 1]) * copies
        return (itemsize * params * (buffers + optimizer_states) + itemsize * state + given
                + itemsize * batch * (acts * copies + once) + itemsize * threads * scratch)

    def _range_counts(self, a, b):
        """(parameters, state, activation floats a slot and once, scratch
        floats) of layers [a, b): what memory_bytes scales (activation_floats'
        count), from per-layer counts made once (a memory refusal asks for
        many ranges at many batch, state and rank counts: 1.5 s a time for
        100,000 layers)."""
        key = (self.recompute, compiled.on())   # a convolution's scratch depends on its kernels
        if key not in self._counted:   # per layer, as prefix sums: a range's sums in O(1)
            units = set(self.recompute_units()) if self.recompute else set()
            per_layer = [(sum(hi - lo for _, _, lo, hi in self.layer_tensors[i]),
                          sum(hi - lo for _, _, lo, hi in self.layer_state[i]),
                          math.prod(self.shapes[i]) if i in units else layer.train_floats(),
                          layer.scratch_floats()) for i, layer in enumerate(self.layers)]
            sums = [(0, 0, 0, 0)]
            for counts in per_layer:
                sums.append(tuple(x + y for x, y in zip(sums[-1], counts)))
            once = [layer.train_floats() if i in units else 0 for i, layer in enumerate(self.layers)]
            self._counted[key] = (sums, once, units)
        sums, once, units = self._counted[key]
        params, state, acts, scratch = (y - x for x, y in zip(sums[a], sums[b]))
        acts += math.prod(self.layers[a].in_shape) if a in units else 0   # a range's first input (activation_floats)
        return params, state, acts, max(once[a:b], default=0), scratch

    def use_recompute(self):
        """--recompute: the runner recomputes each recompute unit's
        activations in backward (nn/sequential.LayerRange); LayerError (one
        line) where the model has no such layer: the flag would save nothing."""
        if not self.recompute_units():
            raise LayerError("it has no layer to recompute (a transformer Block, or a layer that declares "
                             "recompute_unit = True)")
        self.recompute = True

    def recompute_units(self, a=0, b=None):
        """Indices of layers [a, b) that --recompute recomputes (nn/layers.py recompute_unit)."""
        b = len(self.layers) if b is None else b
        return [i for i in range(a, b) if self.layers[i].recompute_unit]

    def activation_floats(self, a=0, b=None):
        """(floats per sample a slot of layers [a, b) keeps for training, and
        those the range needs once whatever its slots): every layer's
        train_floats (attention's grow with T^2) in a slot; with
        --recompute a unit keeps only its output (and the range's first its
        input) in a slot, and the range one unit's train_floats, the largest,
        for the unit being recomputed (nn/sequential.LayerRange). The memory
        check's count (_range_counts)."""
        _, _, acts, once, _ = self._range_counts(a, len(self.layers) if b is None else b)
        return acts, once

    def summary(self):
        """The model, one line per layer (output shape, parameters), and the total."""
        tokens = self.input_kind == "tokens"
        lines = [f"model {self.name}: input {'x'.join(map(str, self.input_shape))} ({self.input_kind}), "
                 f"{f'a vocabulary of {self.classes}' if tokens else f'{self.classes} classes'}, "
                 f"loss {_loss_name(self.loss)}"]
        for i, (layer, shape) in enumerate(zip(self.layers, self.shapes)):
            count = sum(hi - lo for _, _, lo, hi in self.layer_tensors[i])
            lines.append(f"  {i:>3} {layer.describe():<28} -> {'x'.join(map(str, shape)):<14} {count:>12,}")
            lines.extend(f"        {t.name} is layer {t.owner}'s {t.tensor}{' transposed' if t.transposed else ''} "
                         f"(tied)" for t in self.ties if t.user == i)
        lines.append(f"  {self.num_params:,} parameters ({self.num_params * 4:,} bytes)"
                     + (f", {self.num_state:,} non-trainable" if self.num_state else ""))
        if tokens:   # a language model's cost, as its papers give it: per token, a multiply-add 2 FLOPs
            per_token = 2 * sum(self.flops()) / self.input_shape[0]
            lines.append(f"  {per_token / 1e6:,.2f} MFLOPs per token forward, "
                         f"{2 * sum(self.train_flops()) / self.input_shape[0] / 1e6:,.2f} training")
        return lines

    # --- buffers --------------------------------------------------------------
    def build(self, xp=np, params=None, grads=None, state=None, dtype=FLOAT32.params):
        """The model over these flat buffers (each `num_params` long, contiguous,
        of `dtype`, the run's precision.params (hpctrain/base/precision.py); fresh
        zeros where not given; grads may be nn/grad_slots.GradSlots). Each
        build has its own copy of the layers: two models of one spec share
        nothing."""
        dtype = np.dtype(dtype)
        params = xp.zeros(self.num_params, dtype) if params is None else params
        grads = xp.zeros(self.num_params, dtype) if grads is None else grads
        state = xp.zeros(self.num_state, dtype) if state is None else state
        for what, buf, size in (("params", params, self.num_params), ("grads", grads, self.num_params),
                                ("state", state, self.num_state)):
            if isinstance(buf, GradSlots) and buf.size == size and buf.dtype == dtype:
                continue   # --zero 2: the gradient in its buckets' slots (nn/grad_slots.py)
            if buf.shape != (size,) or buf.dtype != dtype or not buf.flags.c_contiguous:
                raise ValueError(f"build's {what} must be one contiguous {dtype} buffer of {size} elements, "
                                 f"got shape {buf.shape}, {buf.dtype}" + ("" if buf.flags.c_contiguous else
                                                                          ", not contiguous"))
        return Sequential(self, xp, PlainStore(self, params, grads, state), dtype)

    def build_on(self, store, xp=np, dtype=FLOAT32.params):
        """The model over a parameter store of the caller's (nn/store.py's
        contract: --zero 3's nn/sharded_store.ShardedStore)."""
        return Sequential(self, xp, store, np.dtype(dtype))

