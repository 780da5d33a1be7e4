"""hpctrain.dist's optimizer lines for PyTorch (Horovod's `horovod.torch`):
a user's torch training loop made data-parallel over hpctrain's ring.

    import hpctrain.dist as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    mpirun -n 2 python -m mpi4py examples/torch_nanogpt.py    # the whole loop

hpctrain.dist's DistributedOptimizer and broadcast_optimizer_state hand a
torch.optim.Optimizer to this module (dispatch.py): one `import
hpctrain.dist as hvd` for NumPy and torch loops alike. torch is an optional
extra (`pip install 'hpctrain[torch]'`): this module imports it, nothing
else in hpctrain.dist does.

DistributedOptimizer wraps a torch.optim.Optimizer (it is one, so that LR
schedulers take it). Every parameter's gradient has a slot in one flat
buffer per dtype, in the order of `named_parameters` (the model's: backward
finishes its end first), and the NumPy DistributedOptimizer
(optimizer.py) sums those slots in place: its buckets (comm/fusion.
bucket_bounds, the program's cut: ending on tensor boundaries, about
`fusion_mb` each, from the end; the first, the output end, at most
`first_bucket_mb`, DDP's 1 MB first bucket, so that its sum starts while
backward still runs rather than after the last gradient), each started on
hpctrain.dist's communication thread as soon as every gradient in it is
done, in the same order on every rank, while backward goes on (where the
ranks nap, more ranks than cores, all of them once the last gradient is
done, with no first-bucket cut: optimizer.py says why). A hook per
parameter (register_post_accumulate_grad_hook) is its `ready(i)`: it
copies the finished gradient into its slot, or finds it there already:
after the first step each `.grad` is a view of its slot, and zero_grad()
zeroes the slots in place whether or not set_to_none (DDP's
gradient_as_bucket_view: a `.grad` is a zeroed tensor, not None, after
zero_grad()), so backward adds straight into the buffer, zero-copy.
`synchronize()` waits for the last bucket and leaves each
`.grad` the replicas' average (op=Average; Sum, ...); `step()` synchronizes
unless inside `skip_synchronize()` (for clipping the averaged gradient
first). With `backward_passes_per_step=k` the hooks hand a gradient over on
its k-th backward only (the passes accumulate locally first).

A parameter is averaged by one DistributedOptimizer at a time: wrapping a
DistributedOptimizer, or a second one over parameters the first still
hooks, would average each gradient twice (Horovod does not check: its hooks
on the gradient accumulators stay for the process's life). That is refused
in one line; `remove()` takes an optimizer's hooks off (then a new one may
take the parameters; the old one steps no more).

broadcast_optimizer_state sends the root's whole `state_dict()`: every
state tensor (Adam's `step` included, a tensor in torch 2), every
param_group's options (lr, betas as a tuple, weight_decay, a scheduler's
initial_lr, ...) as JSON-able values, and the other ranks load it with
`load_state_dict`, so a rank whose state is still empty gets the root's
whole state without taking a step (Horovod's zero-gradient step, which moved
weight-decayed parameters and counted a step, is not needed).
"""
import contextlib
import weakref

try:
    import torch
except ImportError:
    raise ImportError("hpctrain.dist.torch needs PyTorch: pip install 'hpctrain[torch]'") from None

from .collectives import Average, Compression
from .errors import DistError
from .objects import broadcast_object
from .optimizer import FIRST_BUCKET_MB, FUSION_MB, flat_like
from .optimizer import DistributedOptimizer as _Buckets
from .runtime import rank


class DistributedOptimizer(torch.optim.Optimizer):
    """`optimizer` (any torch.optim.Optimizer) whose step() first averages
    the gradients over the ranks (see the module's docstring).
    named_parameters: the model's, in the model's order (default: the
    optimizer's parameters, named by position); every parameter the
    optimizer updates must be among them, each name once."""

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step=1, op=Average, fusion_mb=FUSION_MB, first_bucket_mb=FIRST_BUCKET_MB):
        # The wrapped optimizer keeps its own state and groups (properties
        # below): state_dict, load_state_dict and the user's reference to it
        # all see the same objects. Optimizer.__init__ is not called: it
        # would make groups of its own.
        if isinstance(optimizer, DistributedOptimizer):
            raise DistError("DistributedOptimizer: the optimizer is a DistributedOptimizer already (wrapping "
                            "twice would average every gradient twice): wrap the torch optimizer once")
        self._inner = optimizer
        if backward_passes_per_step < 1:
            raise DistError(f"DistributedOptimizer: backward_passes_per_step={backward_passes_per_step}, "
                            f"must be at least 1")
        self._passes = int(backward_passes_per_step)
        named = [(n, p) for n, p in _named(optimizer, named_parameters) if p.requires_grad]
        for name, p in named:
            if _owner(p) is not None:
                raise DistError(f"DistributedOptimizer: {name} is averaged by another DistributedOptimizer "
                                f"already (a second would average it twice): call the first one's remove()")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index = {p: i for i, p in enumerate(self._params)}
        self._slots = _slots(named)
        self._views = [torch.from_numpy(slot) for slot in self._slots]   # each slot as the .grad it becomes
        # the NumPy optimizer's buckets over the slots (in place: they are views of one buffer per dtype);
        # the passes are counted here, where autograd has already added them up in .grad
        self._buckets = _Buckets(self._slots, op=op, compression=compression, fusion_mb=fusion_mb,
                                 first_bucket_mb=first_bucket_mb)
        self._counts = [0] * len(self._params)   # backward passes since the last synchronize
        self._should_synchronize = True
        self._synchronized = True                # nothing new since the last synchronize()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._params]
        me = weakref.ref(self)
        for p in self._params:
            _HOOKED[id(p)] = (weakref.ref(p), me)

    def remove(self):
        """Take this optimizer's hooks off its parameters: their gradients
        are averaged no more, and another DistributedOptimizer may take them.
        Between backward() and step() it would drop gradients being
        averaged: refused. This optimizer steps no more (the wrapped one
        still does)."""
        if not self._synchronized:
            raise DistError("DistributedOptimizer: remove() between backward() and step() (or synchronize()) "
                            "would drop gradients still being averaged")
        for hook in self._hooks:
            hook.remove()
        for p in self._params:
            if _owner(p) is self:
                del _HOOKED[id(p)]
        self._hooks = None

    # the wrapped optimizer's own objects, so schedulers and checkpoints see one optimizer
    @property
    def param_groups(self):
        return self._inner.param_groups

    @property
    def state(self):
        return self._inner.state

    @property
    def defaults(self):
        return self._inner.defaults

    def __getattr__(self, name):   # what Optimizer.__init__ would have set: the inner one's
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state_dict):
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        raise DistError("DistributedOptimizer: add_param_group after wrapping is not supported "
                        "(wrap the optimizer once it has all its groups)")

    def zero_grad(self, set_to_none=True):
        if not self._synchronized:
            raise DistError("DistributedOptimizer: zero_grad() between backward() and step() (or "
                            "synchronize()) would drop gradients still being averaged")
        if not set_to_none or self._hooks is None:
            self._inner.zero_grad(set_to_none=set_to_none)
            return
        # DDP's gradient_as_bucket_view: a .grad that is its slot stays so, zeroed in place (the
        # slots' one buffer at once), and the next backward adds into it: the hook then copies
        # nothing. Dropping it (set_to_none) would have autograd make a new tensor for the hook
        # to copy, each step; the slots' memory is held either way.
        for flat in self._buckets.flats:
            flat.buf[...] = 0
        for group in self._inner.param_groups:
            for p in group["params"]:
                i = self._index.get(p)
                if p.grad is not None and (i is None or p.grad.data_ptr() != self._views[i].data_ptr()):
                    p.grad = None

    def __repr__(self):
        return f"DistributedOptimizer({self._inner!r})"

    # --- the averaging ----------------------------------------------------------------
    def _grad_ready(self, p):
        """A parameter's gradient is final for this backward pass: on its
        k-th pass it goes to its slot (unless it is the slot already) and
        the buckets it completes start."""
        i = self._index[p]
        self._counts[i] += 1
        self._synchronized = False
        if self._counts[i] < self._passes:
            return
        if self._counts[i] > self._passes:
            raise DistError(f"DistributedOptimizer: {self._names[i]}'s gradient was computed {self._counts[i]} "
                            f"times before step() or synchronize() (backward_passes_per_step={self._passes})")
        if p.grad.layout != torch.strided:
            raise DistError(f"DistributedOptimizer: {self._names[i]} has a {p.grad.layout} gradient "
                            f"(hpctrain.dist averages dense gradients)")
        view = self._views[i]
        if p.grad.data_ptr() != view.data_ptr():
            # into the slot here (the buckets then neither copy in nor back out); torch's copy
            # leaves the interpreter lock to the engine's thread, summing the buckets before
            view.copy_(p.grad.detach())
        self._buckets.ready(i)

    def synchronize(self):
        """Wait until every gradient is averaged; each `.grad` is then its
        average (a view of its slot). A parameter without a gradient this
        step (unused) counts as zeros on this rank. Once per backward: a
        second call (step() after synchronize()) finds nothing new to do."""
        if self._synchronized:
            return
        for i, count in enumerate(self._counts):
            if count < self._passes:
                self._slots[i][...] = 0   # its bucket has not started: it waits for this one
        self._buckets.synchronize()
        for p, view in zip(self._params, self._views):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view
        self._counts = [0] * len(self._params)
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() without synchronizing: for a loop that called
        synchronize() itself (then clipped the averaged gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._hooks is None:
            raise DistError("DistributedOptimizer: step() after remove(): step the wrapped optimizer, or wrap "
                            "it anew")
        if self._should_synchronize:
            self.synchronize()
        elif not self._synchronized:
            raise DistError("DistributedOptimizer: step() inside skip_synchronize() before synchronize(): "
                            "the gradients are still being averaged")
        return self._inner.step(closure)


# id(parameter) -> (its weak reference, the DistributedOptimizer whose hook it holds): one
# at a time. Weak both ways: the registry keeps neither alive (the hook keeps the optimizer).
_HOOKED = {}


def _owner(p):
    """The DistributedOptimizer that hooks parameter p, or None."""
    ref, owner = _HOOKED.get(id(p), (None, None))
    if ref is None or ref() is not p:   # (a freed tensor's id, reused)
        return None
    return owner()


def _named(optimizer, named_parameters):
    """[(name, parameter)] in the model's order, each parameter once, every
    one of the optimizer's among them; one line for what is not."""
    grouped = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = [(f"param.{i}", p) for i, p in enumerate(grouped)]
    else:
        named = list(named_parameters)
        if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in named):
            raise DistError("DistributedOptimizer: named_parameters must be (name, parameter) pairs, "
                            "as model.named_parameters() gives")
    names = [name for name, _ in named]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DistError(f"DistributedOptimizer: named_parameters names {twice[0]!r} more than once")
    seen, unique = set(), []
    for name, p in named:   # a tied tensor once (named_parameters() already does so)
        if id(p) not in seen:
            seen.add(id(p))
            unique.append((name, p))
    missing = [i for i, p in enumerate(grouped) if id(p) not in seen]
    if missing:
        raise DistError(f"DistributedOptimizer: {len(missing)} of the optimizer's parameters are not in "
                        f"named_parameters (the first is parameter {missing[0]} of its groups); pass "
                        f"model.named_parameters() of the model the optimizer trains")
    ours = {id(p) for p in grouped}
    return [(n, p) for n, p in unique if id(p) in ours]


def _slots(named):
    """Each parameter's gradient slot, in order: views of one flat buffer
    per dtype (optimizer.flat_like), shaped as the parameter."""
    slots, by_dtype = [None] * len(named), {}
    for i, (name, p) in enumerate(named):
        try:
            dtype = torch.empty(0, dtype=p.dtype).numpy().dtype
        except TypeError:
            raise DistError(f"DistributedOptimizer: {name} is {p.dtype}, which NumPy has no type for; keep "
                            f"the parameters float32 (autocast computes in lower precision)") from None
        by_dtype.setdefault(dtype, []).append(i)
    for dtype, members in by_dtype.items():
        _, views = flat_like([tuple(named[i][1].shape) for i in members], dtype)
        for i, view in zip(members, views):
            slots[i] = view
    return slots


# --- broadcasts ---------------------------------------------------------------------------

def broadcast_optimizer_state(optimizer, root_rank=0):
    """The root's whole optimizer state (state tensors, step counts, every
    group's options: lr, betas, ...) into every rank's optimizer: its
    state_dict() through broadcast_object (arrays and JSON, no pickle),
    loaded by the others with load_state_dict()."""
    inner = optimizer._inner if isinstance(optimizer, DistributedOptimizer) else optimizer
    state = broadcast_object(inner.state_dict(), root_rank, name="optimizer state")
    if rank() == root_rank:
        return
    try:
        inner.load_state_dict(state)
    except (ValueError, KeyError) as e:
        raise DistError(f"broadcast_optimizer_state: rank {root_rank}'s optimizer state does not fit rank "
                        f"{rank()}'s optimizer ({e})") from None
