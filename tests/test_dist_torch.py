"""hpctrain.dist for PyTorch (hpctrain/dist/torch.py, reached through
hpctrain.dist's own names, dispatch.py): the wrapped
optimizer averages as one process over every rank's samples would, the
optimizer state's broadcast carries Adam's step and the learning rate, and
nanoGPT's loop (examples/torch_nanogpt.py) follows PyTorch DDP's losses.

    mpirun -n 2 python -m mpi4py -m pytest -q --only-mpi tests/test_dist_torch.py   # on the ranks, in-process
    python -m pytest -q tests/test_dist_torch.py                                      # what needs one process

Each MPI test exchanges what it found before asserting, so that a failed
check on one rank does not leave the others in a collective.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi4py import MPI  # noqa: E402


def _hvd():
    import hpctrain.dist as hvd
    hvd.init()
    return hvd


def _tiny(seed=0):
    """A small MLP: two Linear layers (a matrix and a bias each)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model


def _batch(rank, n=4):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def _whole_batch(size):
    xs, ys = zip(*(_batch(r) for r in range(size)))
    return torch.cat(xs), torch.cat(ys)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().astype(np.float64)


def _agree(ok, why):
    """Every rank's verdict, so that all assert together."""
    verdicts = MPI.COMM_WORLD.allgather((bool(ok), why))
    bad = [(r, w) for r, (o, w) in enumerate(verdicts) if not o]
    assert not bad, bad


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("clip, compression", [(None, "none"), (0.05, "none"), (None, "fp16")])
def test_steps_equal_one_process_over_every_ranks_samples(clip, compression):
    """Three SGD steps on each rank's own batch, the gradients averaged by
    the hooks (clipped after synchronize() with skip_synchronize(), to a
    norm small enough to bind), equal one process's steps on all the
    batches at once (equal batches: the mean of the means); with fp16 on
    the wire, within its rounding, and not exactly (it did compress)."""
    hvd = _hvd()
    size = hvd.size()
    model, ref = _tiny(), _tiny()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   compression=getattr(hvd.Compression, compression))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x, y = _batch(hvd.rank())
    whole = _whole_batch(size)
    for _ in range(3):
        opt.zero_grad()
        _loss(model, x, y).backward()
        if clip:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        ref_opt.zero_grad()
        _loss(ref, *whole).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
    diff = float(np.abs(_flat(model) - _flat(ref)).max())
    ok = diff < 1e-6 if compression == "none" else 1e-6 < diff < 1e-3
    # zero_grad() (set_to_none) leaves each .grad its slot, zeroed (DDP's gradient_as_bucket_view),
    # and backward adds into it: the hooks copy nothing
    opt.zero_grad()
    slots = [v.data_ptr() for v in opt._views]
    zeroed = all(p.grad is not None and not p.grad.any() and p.grad.data_ptr() == s
                 for p, s in zip(model.parameters(), slots))
    _loss(model, x, y).backward()
    added = all(p.grad.data_ptr() == s and p.grad.any() for p, s in zip(model.parameters(), slots))
    opt.synchronize()
    _agree(ok and zeroed and added, f"largest difference from one process {diff:.2e}; zero_grad left the "
                                     f"slots zeroed {zeroed}, backward added into them {added}")


@pytest.mark.mpi(min_size=2)
def test_backward_passes_per_step_accumulates_before_averaging():
    """Two backward passes a step: the averaged gradient is the average of
    every rank's two-pass sum; an unused parameter's gradient is zeros."""
    hvd = _hvd()
    model = _tiny()
    extra = torch.nn.Parameter(torch.ones(5))   # in the optimizer, never in the loss
    named = list(model.named_parameters()) + [("extra", extra)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1), named_parameters=named,
                                   backward_passes_per_step=2)
    x, y = _batch(hvd.rank())
    _loss(model, x[:2], y[:2]).backward()
    _loss(model, x[2:], y[2:]).backward()
    opt.synchronize()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    ref = _tiny()
    mine = []
    for r in range(hvd.size()):
        ref.zero_grad()
        xr, yr = _batch(r)
        _loss(ref, xr[:2], yr[:2]).backward()
        _loss(ref, xr[2:], yr[2:]).backward()
        mine.append(torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).numpy())
    diff = float(np.abs(got - np.mean(mine, axis=0)).max())
    _agree(diff < 1e-6 and not extra.grad.any(), f"difference {diff:.2e}, extra {extra.grad}")


@pytest.mark.mpi(min_size=2)
def test_a_parameter_is_averaged_by_one_optimizer_at_a_time():
    """Wrapping twice, or a second optimizer over hooked parameters, is one
    line; remove() takes the hooks off (refused mid-step), after which the
    old optimizer steps no more and a new one averages alone: two steps of
    it each average once (the old hooks, left on, would count a second pass)."""
    hvd = _hvd()
    model = _tiny()
    first = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                     named_parameters=model.named_parameters())
    with pytest.raises(hvd.DistError, match="^DistributedOptimizer: the optimizer is a DistributedOptimizer already"):
        hvd.DistributedOptimizer(first)
    with pytest.raises(hvd.DistError, match="^DistributedOptimizer: 0.weight is averaged by another "
                                            r"DistributedOptimizer already .*: call the first one's remove\(\)$"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                 named_parameters=model.named_parameters())
    x, y = _batch(hvd.rank())
    _loss(model, x, y).backward()
    with pytest.raises(hvd.DistError, match=r"remove\(\) between backward\(\) and step\(\)"):
        first.remove()
    first.synchronize()
    first.remove()
    with pytest.raises(hvd.DistError, match=r"step\(\) after remove\(\)"):
        first.step()
    second = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                      named_parameters=model.named_parameters())
    for _ in range(2):
        second.zero_grad()
        _loss(model, x, y).backward()
        second.step()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    second.remove()
    ref, mine = _tiny(), []   # (lr 0: the model is still _tiny()'s)
    for r in range(hvd.size()):
        ref.zero_grad()
        _loss(ref, *_batch(r)).backward()
        mine.append(torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).numpy())
    diff = float(np.abs(got - np.mean(mine, axis=0)).max())
    _agree(diff < 1e-6, f"difference {diff:.2e}")


@pytest.mark.mpi(min_size=2)
def test_broadcast_optimizer_state_carries_adams_step_lr_and_betas():
    """The root trained two Adam steps at lr 0.01 under a scheduler; the
    others hold a fresh Adam (empty state) at lr 0.5 with other betas.
    After the broadcasts every rank holds the root's state: the step (a
    tensor), the moments, lr, betas (a tuple), the scheduler's initial_lr;
    and one more step leaves every rank's parameters the same bits."""
    hvd = _hvd()
    rank = hvd.rank()
    model = _tiny(seed=rank)   # different starting parameters: broadcast_parameters makes them one
    if rank == 0:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        torch.optim.lr_scheduler.StepLR(opt, step_size=10)
        for _ in range(2):
            opt.zero_grad()
            _loss(model, *_batch(0)).backward()
            opt.step()
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.5, betas=(0.5, 0.5))
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    group = opt.param_groups[0]
    state = opt.state[next(model.parameters())]
    seen = {"lr": group["lr"], "betas": group["betas"], "initial_lr": group.get("initial_lr"),
            "step": float(state["step"]) if "step" in state else None,
            "step_is_tensor": isinstance(state.get("step"), torch.Tensor),
            "moment": state["exp_avg"].sum().item() if "exp_avg" in state else None}
    opt.zero_grad()
    _loss(model, *_batch(rank)).backward()
    opt.step()
    every = MPI.COMM_WORLD.allgather((seen, _flat(model).tobytes()))
    root_seen = every[0][0]
    assert root_seen["step"] == 2.0 and root_seen["betas"] == (0.9, 0.999) and root_seen["initial_lr"] == 0.01
    for r, (s, params) in enumerate(every):
        assert s == root_seen, (r, s, root_seen)
        assert params == every[0][1], f"rank {r}'s parameters differ from rank 0's after the step"


def test_first_bucket_is_small_so_the_sum_starts_during_backward():
    """The torch optimizer's first bucket (the output end, ready first) is
    at most FIRST_BUCKET_MB (DDP's 1 MB), the rest fused under fusion_mb:
    five 257 KB layers (1.3 MB) are two buckets, not the one that 4 MB
    would make and that could only start after the last gradient."""
    import hpctrain.dist as hvd
    from hpctrain.dist.optimizer import FIRST_BUCKET_MB
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(5)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    try:
        buckets = opt._buckets.flats[0].buckets
        n = sum(p.numel() for p in model.parameters())
        assert len(buckets) == 2 and buckets[0][1] == n and buckets[1] == (0, buckets[0][0])
        assert 0.5 * FIRST_BUCKET_MB < (buckets[0][1] - buckets[0][0]) * 4 / (1 << 20) <= FIRST_BUCKET_MB
    finally:
        opt.remove()


def test_where_ranks_nap_the_buckets_are_the_programs_cut(monkeypatch):
    """Where the ranks nap (more ranks than cores) the buckets start together
    once backward is done, so the first bucket's smaller cut is not made:
    the same 1.3 MB of gradients is one bucket under the 4 MB fusion."""
    hvd = _hvd()
    from hpctrain.dist.runtime import runtime
    monkeypatch.setattr(runtime().waits, "nap", True)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(5)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    try:
        assert opt._buckets.flats[0].buckets == [(0, sum(p.numel() for p in model.parameters()))]
    finally:
        opt.remove()


@pytest.mark.parametrize("kind", ["AdamW", "SGD", "Adagrad", "RMSprop"])
def test_optimizer_state_dict_crosses_the_wire_whole(kind):
    """What broadcast_optimizer_state sends (broadcast_object's bytes, no
    pickle) gives back the state_dict that went in: int keys, betas as a
    tuple, 0-d step tensors, floats to the last bit, SGD's None buffer;
    and an optimizer of another lr loads it."""
    from hpctrain.dist.objects import decode, encode
    model = _tiny()
    options = {"AdamW": dict(lr=1 / 3, betas=(0.9, 0.99)), "SGD": dict(lr=0.1, momentum=0.9),
               "Adagrad": {}, "RMSprop": dict(momentum=0.5)}[kind]
    opt = getattr(torch.optim, kind)(model.parameters(), **options)
    _loss(model, *_batch(0)).backward()
    opt.step()
    sd = opt.state_dict()
    back = decode(encode(sd))
    assert back["param_groups"] == sd["param_groups"]
    assert set(back["state"]) == set(sd["state"])
    for k, v in sd["state"].items():
        for name, t in v.items():
            same = (torch.equal(back["state"][k][name], t) and back["state"][k][name].shape == t.shape
                    if isinstance(t, torch.Tensor) else back["state"][k][name] == t)
            assert same, (k, name, back["state"][k][name], t)
    other = getattr(torch.optim, kind)(model.parameters(), lr=5.0)
    other.load_state_dict(back)
    assert other.param_groups[0]["lr"] == sd["param_groups"][0]["lr"]


STEPS = 8


@pytest.mark.mpi(min_size=2)
def test_nanogpt_losses_follow_ddp():
    """examples/torch_nanogpt.py, nanoGPT's CPU recipe (block 64, batch 12,
    4 layers, 4 heads, width 128, AdamW, clipping through synchronize() and
    skip_synchronize()), run in these ranks over hpctrain.dist and then
    over PyTorch DDP (gloo): every rank's loss at every step within 1e-4,
    and it learns. At 2 and 3 ranks (4 ranks on the suite's machine cost
    twice as much; the report runs 50 steps at 2 and 4)."""
    if MPI.COMM_WORLD.size > 3:
        pytest.skip("run at 2 and 3 ranks")
    example = _example("torch_nanogpt")
    flags = ["--max-iters", str(STEPS), "--threads", "1"]
    ours = example.main(flags)
    theirs = example.main(flags + ["--ddp"])
    diff = max(abs(a - b) for a, b in zip(ours, theirs))
    _agree(len(ours) == len(theirs) == STEPS and diff < 1e-4 and ours[-1] < ours[0] - 0.3,
           f"largest loss difference {diff:.2e}; hpctrain.dist {ours}, DDP {theirs}")
    # --alone (the bench's ceiling): the same start and batches, but nothing averaged, so the
    # losses part from the step after the first
    alone = example.main(flags + ["--alone"])
    apart = max(abs(a - b) for a, b in zip(ours[1:], alone[1:]))
    _agree(len(alone) == STEPS and alone[0] == ours[0] and apart > 1e-3,
           f"--alone's first loss {alone[0]} (hpctrain.dist's {ours[0]}), then at most {apart:.2e} apart")


def _example(name):
    import importlib.util
    from conftest import REPO
    spec = importlib.util.spec_from_file_location(name, f"{REPO}/examples/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.mpi(min_size=2)
def test_cupy_loop_with_numpy_standing_in_averages_and_learns():
    """examples/cupy_loop.py's loop (no GPU here: NumPy stands in for CuPy):
    every rank ends with the same parameters, bit for bit, and the
    averaged loss falls."""
    _hvd()
    params, losses = _example("cupy_loop").train(np, steps=30, log=None)
    blob = b"".join(p.tobytes() for p in params)
    every = MPI.COMM_WORLD.allgather(blob)
    _agree(all(b == every[0] for b in every) and losses[-1] < 0.6 * losses[0],
           f"same parameters: {[b == every[0] for b in every]}; losses {losses[0]:.3f} -> {losses[-1]:.3f}")


def test_cupy_loop_without_a_gpu_is_one_line(capsys):
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        pytest.skip("CuPy and a GPU are here")
    except Exception:
        pass
    assert _example("cupy_loop").main(["--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hpctrain: error: examples/cupy_loop.py needs CuPy and a GPU"), err


def test_bench_torch_without_the_example_is_one_line(tmp_path, monkeypatch, capsys):
    """`python -m hpctrain.bench torch` runs the repository's example: an
    installed hpctrain without it says so in one line, exit 2, before any job."""
    from hpctrain.bench import __main__ as bench, torch_dist
    monkeypatch.setattr(torch_dist, "repo_root", lambda: tmp_path)
    assert bench.main(["torch", "--ranks", "2", "--steps", "3", "--repeats", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "examples/torch_nanogpt.py of the repository, not found" in err[0], err
