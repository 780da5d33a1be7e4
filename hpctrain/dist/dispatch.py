"""The two optimizer names of hpctrain.dist that take either a NumPy loop's
gradients and state or a PyTorch optimizer: `DistributedOptimizer` and
`broadcast_optimizer_state` hand a torch.optim.Optimizer on to torch.py
(imported only then: hpctrain.dist imports without torch), anything else to
optimizer.py. Horovod has a module per framework; here one `import
hpctrain.dist as hvd` serves both.

    python -c "import hpctrain.dist as hvd; print(hvd.DistributedOptimizer.__mro__[1])"
"""
from . import optimizer
from .errors import DistError


def is_torch_optimizer(x):
    """A torch.optim.Optimizer, found without importing torch (a loop that passed one has)."""
    return any(c.__module__.startswith("torch.optim") and c.__name__ == "Optimizer" for c in type(x).__mro__)


class DistributedOptimizer(optimizer.DistributedOptimizer):
    __doc__ = optimizer.DistributedOptimizer.__doc__ + """

    Given a torch.optim.Optimizer instead: torch.py's DistributedOptimizer
    (Horovod's `DistributedOptimizer(optimizer, named_parameters=...)`)."""

    def __new__(cls, grads, *args, **kwargs):
        if is_torch_optimizer(grads):
            from .torch import DistributedOptimizer as TorchOptimizer
            return _refused_in_the_world(TorchOptimizer, grads, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        _refused_in_the_world(super().__init__, *args, **kwargs)


def _refused_in_the_world(make, *args, **kwargs):
    """make(...), whose DistError (a wrong argument: every rank makes the
    same, as a rule) goes to the world's next call check (collectives.
    refuse; Horovod's recipe calls broadcast_parameters next): one line for
    the job, not one per rank, and no rank left waiting in that call."""
    from .collectives import refuse
    from .runtime import is_initialized
    try:
        return make(*args, **kwargs)
    except DistError as e:
        if e.collective or not is_initialized():
            raise
        refuse(e, "DistributedOptimizer")


def broadcast_optimizer_state(state, root_rank=0, process_set=None):
    """optimizer.broadcast_optimizer_state for a NumPy loop's state; a
    torch.optim.Optimizer's whole state_dict through torch.py's."""
    if is_torch_optimizer(state):
        if process_set is not None:
            raise DistError("broadcast_optimizer_state: a torch optimizer's state goes to the whole world "
                            "(process_set is for NumPy state)")
        from .torch import broadcast_optimizer_state as torch_state
        return torch_state(state, root_rank)
    return optimizer.broadcast_optimizer_state(state, root_rank, process_set)
