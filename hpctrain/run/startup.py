"""A run's start-up, in the order its checks must come: every rank builds
the run's world (run/world.py: the roles, the device, the clock) and its
plan (run/plan.py: the model, the data, the settings), checking on the way
that every rank runs the same job (flags, data, model), that the flags fit
the world, the model the data, the step the memory and the data, and
(last, since it creates --checkpoint-dir) that the outputs can be written.
A problem on any rank is one line and a clean exit on every rank
(comm/agree.py), never a rank left waiting in a collective.

    mpirun -n 4 python -m hpctrain.mnist --steps 200
"""
import sys
import time
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from .. import data as data_mod
from ..base import device, vector_width
from ..flags.cli import validate
from ..flags.model_names import input_kind_of, is_model_file
from ..comm import allreduce_plan, ulfm
from ..comm.agree import agreed, check_consistency
from ..comm.records import allgather_bytes
from ..comm.waits import Waits
from ..data.augment import Augment
from ..data.blend import parse_blend
from ..data.fit import check_kind
from ..base.errors import HpctrainError
from ..nn import LayerError, blas, compiled, spec_for, threads
from ..nn.kernels_used import layers_line
from ..comm.tensor_group import TensorComm
from ..nn.tensor_parallel import TensorGroup
from ..nn.layer_errors import LayerCodeError
from ..nn.user import UserModelError
from ..pipeline.stages import cuts_for
from ..report import tensorboard
from ..report.report import tensorboard_view
from ..base.tuning import rounding
from . import cluster as cluster_mod
from . import identity, jobcheck, stop_signal
from .cluster import Cluster
from .inputs import Inputs, blend_identity, data_identity, ensure_data
from .memory_check import check_memory
from .mesh import Mesh
from .outputs import check_outputs, sweep_stale_temporaries
from .plan import data_plan, make_plan, schedule_plan, zero_stage
from .world import World


def start(args, process_note, watchdog, stop, on_roles=None, survival=None, comm=None):
    """(World, Plan, Inputs) of this run, the same on every rank. watchdog:
    started before MPI_Init (train.train), aborting through MPI now; every
    start-up collective below waits under it. stop: the StopSignal made
    before it. on_roles: called with the chief's world rank as soon as the
    roles are known (train.py's Ctrl-C line must not call MPI to learn it).
    survival: --on-failure shrink's run/survival.Survival. comm: the
    survivors' communicator when the run is built again after a lost rank
    (run/survival.py): the same checks, quietly (the job's lines were said),
    the outputs already checked."""
    watchdog.also_watch(lambda: stop_signal.stopped_outside_training(stop, args.checkpoint_dir, watchdog))
    # Overflow to inf/nan is caught by the loops (one line, exit 4), not by
    # NumPy's warnings on every rank.
    np.seterr(over="ignore", invalid="ignore", divide="ignore")
    # The cores this rank gets, as compute threads (nn/threads.py); on a GPU
    # the layers run as CuPy kernels and never split.
    compute_threads = threads.configure(args.threads or cluster_mod.threads_per_rank())
    rebuilt = comm is not None
    comm = MPI.COMM_WORLD if comm is None else comm
    with watchdog.waiting("start-up (communicators)", peer=None):
        cluster = Cluster(comm, args.mode, args.num_ps, args.ps_ranks)
    if on_roles is not None:
        on_roles(cluster.chief_rank)

    def say(text):
        if cluster.is_chief and not rebuilt:
            print(text, flush=True)

    def agree(fn, *fn_args, what=None):
        return agreed(comm, fn, *fn_args, watchdog=watchdog, what=what)
    # The same job everywhere, outputs included (identity.py). First,
    # before the roles are used: ranks that disagree on --num-ps or
    # --ps-ranks disagree on who the chief is (the rank map's root).
    with watchdog.waiting("start-up (same job on every rank)", peer=None):
        agree(check_consistency, comm, identity.same_on_every_rank(args))
    if not rebuilt:   # (the launcher's size is the job's first, not the survivors')
        with watchdog.waiting("start-up (rank map)", peer=None):
            jobcheck.check_world(cluster, say)
    t_start = time.perf_counter()
    agree(validate, args, cluster.size)
    agree(ulfm.check, args.on_failure)   # --on-failure shrink: refused where the MPI cannot survive a lost rank
    agree(check_shrink_layout, args)
    if args.init_from:   # the model (and a --block-size that fits it) from the pretrained model's files
        from ..interop.pretrained import init_args
        args = agree(init_args, args, what="reading --init-from")

    # --- the device and the world ---------------------------------------------
    with watchdog.waiting("start-up (GPU binding)", peer=None):
        gpu_note = cluster.confirm_gpu_binding(args.device)  # MPI's node-local rank has the last word
    xp, device_name, device_note = agree(device.select, args.device)
    allreduce = agree(allreduce_plan, args.allreduce, xp, args.mode, args.cuda_aware)
    # How this rank waits (comm/waits.py): napping where its node's ranks outnumber its cores
    waits = Waits(args.wait_mode == "nap" or
                  (args.wait_mode == "auto" and cluster_mod.oversubscribed(cluster.local_size)))
    device_note = "; ".join(filter(None, [device_note, gpu_note if device.is_gpu(xp) else "", allreduce,
                                          f"compute threads per rank: {compute_threads}"
                                          if compute_threads > 1 and not device.is_gpu(xp) else "",
                                          "waiting ranks nap" if waits.nap else ""]))
    server_xp = agree(server_array_module, args)
    thread_multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
    if not thread_multiple:
        device_note += "; MPI gives less than MPI_THREAD_MULTIPLE: no communication thread (--overlap off)"
    world = World(comm=comm, cluster=cluster, watchdog=watchdog, stop=stop, xp=xp, device_name=device_name,
                  server_xp=server_xp, thread_multiple=thread_multiple, waits=waits, t_start=t_start,
                  survival=survival)
    workers = workers_said(args, cluster.size, cluster.num_workers)
    say(f"hpctrain: {args.mode} mode, world size {cluster.size} "
        f"({f'{cluster.num_ps} ps + {workers}' if cluster.num_ps else workers}), "
        f"{zero_text(args, cluster, xp)}device {device_name} "
        f"({device_note})" + (f"; {process_note}" if process_note else ""))
    if cluster.num_ps:
        say(cluster.servers_line())

    # --- the data: the same everywhere (its manifest's content, not its path) --
    # --data A:0.7,B:0.3: a blend (data/blend.py); its first set gives the held-out split and the vocabulary
    blend = agree(parse_blend, args.data) if args.data else None
    data_dir = ensure_data(str(blend[0][0]) if blend else args.data, cluster, watchdog)
    # (the digest is also what checkpoints record of the data: checkpoints/resume.py)
    digest, model_shape, manifest = agree(data_identity, data_dir, args.block_size)
    if blend:
        digest, mix = agree(blend_identity, blend, args.block_size)
        say(mix)
    with watchdog.waiting("start-up (same data on every rank)", peer=None):
        agree(check_consistency, comm, {"data (manifest digest)": digest})
    if args.init_from:   # the data's vocabulary the pretrained model's
        from ..interop.pretrained import check_init_data
        agree(check_init_data, args.init_from, model_shape[1], data_dir)
    # An image model on text, or a GPT on images, in plain words before
    # anything is built from the data's shapes (a user's file: once built, below).
    agree(check_input_kind, args, input_kind_of(args.model), manifest, data_dir)
    has_val = data_mod.has_val(data_dir)
    agree(check_val, args, has_val, data_dir)
    agree(check_eval_tokens, args, manifest, data_dir)
    # --augment flip on --no-flip data, crop=P past the image: refused; a wide crop: a warning
    augment_warning = agree(data_mod.check_augment, args.augment, data_dir)
    if augment_warning and cluster.is_chief:
        print(f"hpctrain: warning: {augment_warning}", file=sys.stderr, flush=True)
    agree(tensorboard.check, args)   # tensorboardX installed, DIR writable
    agree(check_single_pass, args, xp)   # --single-pass on: numba there (NumPy)
    data = data_plan(args, cluster, data_dir, digest, manifest, has_val, blend)
    sampled = eval_tokens_line(args, manifest, data) if data.eval_tokens else None
    if sampled:
        say(sampled)
    # --epochs count its training samples (the same on every rank: the
    # manifest's digest was compared above); the last step is decided with
    # the resume point (Plan.last_step).
    schedule = schedule_plan(args, data)
    if args.epochs is not None:
        say(f"steps: {counted(args.epochs, 'epoch')} of {data.train_samples} samples at {data.per_update_line()} = "
            f"{schedule.total_steps} steps")
    if args.lr_schedule != "constant":   # constant: today's output, unchanged
        say(schedule.line())
    if args.augment:
        say(augment_line(args.augment, manifest["image_shape"], args.seed))
    if args.tensorboard:
        say(f"tensorboard: the --metrics records as scalars in {args.tensorboard} "
            f"({tensorboard_view(args.tensorboard)})")
    # Before any layer is bound; every rank the same way (auto: only where
    # every rank has numba), so no two ranks mix compiled and NumPy layers.
    # (The compiled kernels' sum order still depends on the CPU: ranks on
    # different CPU models may round differently; nn/compiled.py.)
    wanted = np.array([agree(compiled_layers, args, xp, schedule.total_steps)], np.int64)
    with watchdog.waiting("start-up (compiled layers on every rank)", peer=None):
        comm.Allreduce(MPI.IN_PLACE, wanted, op=MPI.MIN)
    compiled.use(bool(wanted[0]))
    layers_key = "NumPy"   # what checkpoints record of how the layers round (the chief's)
    if compiled.on():
        with watchdog.waiting("start-up (compiled layers' CPU tuning on every rank)", peer=None):
            layers_key, note = agree(check_tuning, comm, cluster, args.pipeline_stages)
        if note:
            say(note)
    if agree(use_blas, args.blas, xp) == "mkl":   # (every rank the same: a job flag, compared above)
        layers_key = f"{layers_key}, MKL's products"
        say(blas.line())

    # --- the model, shaped by the data's manifest --------------------------------
    spec = agree(_model_spec, args, model_shape, watchdog, what="building the model")
    agree(check_input_kind, args, spec.input_kind, manifest, data_dir)
    if args.init_from:   # every tensor there, of its shape, before anything trains
        from ..interop.pretrained import open_source

        def check_tensors():
            with open_source(args.init_from) as source:
                source.check(spec)
        agree(check_tensors, what="reading --init-from")
    with watchdog.waiting("start-up (same model on every rank)", peer=None):
        # a user's file may differ between nodes: its code, layers and tensors are compared
        agree(check_consistency, comm, {"model (layers, tensors and their shapes)": spec.fingerprint,
                                        "model code (the file and the modules it imports beside it)":
                                            spec.code or "-"})
    if args.model != "mlp":
        say("\n".join(spec.summary()))
        if xp is np:
            say(layers_line(spec))
    # --pipeline-stages: where the layers are cut (None without), or the one line refusing the flags
    cuts = agree(cuts_for, args, cluster.size, spec)
    world = with_mesh(world, args)
    if args.tensor_parallel > 1:   # this rank's slice of the model (nn/tensor_parallel.py)
        spec = agree(tensor_slice, args, spec, world)
        say(tensor_line(spec, world.mesh))
        apart = groups_across_nodes(world.mesh.size("tensor"), cluster.hosts)
        if apart and cluster.is_chief:   # allowed, but every layer's allreduces then cross the slow links
            print(f"hpctrain: warning: {across_nodes_line(args.tensor_parallel, apart, cluster.size)}",
                  file=sys.stderr, flush=True)
    replicas = world.mesh.size("data") if world.mesh else cluster.num_workers
    sharded = zero_stage(args, replicas, xp) if replicas > 1 else 0
    need = agree(check_memory, args, cluster.local_size, spec, cuts, replicas, sharded, schedule.total_steps)
    if need:   # what the end line's peak memory will be, foreseen (issue 54 N3: the console said neither)
        at = f" at ZeRO stage {sharded}" if args.mode == "ring" else ""
        say(f"memory: at least {need / 2**20:,.0f} MB a rank expected{at} (the interpreter, parameters, gradients, "
            f"optimizer state and a step's activations{', the heaviest pipeline stage' if cuts else ''}); the result "
            f"line gives the peak")
    agree(check_step_size, args, data.workers, manifest, data_dir)
    # Last before training, so a refusal above leaves nothing behind (this
    # creates --checkpoint-dir): a result that cannot be written would be lost.
    agree(check_outputs if cluster.is_chief and not rebuilt else _nothing, args, data_dir)
    if rebuilt and cluster.is_chief:
        # after a lost rank: a checkpoint's temporary folder the lost chief was writing is gone with it
        sweep_stale_temporaries(args, started=time.time())
    plan = make_plan(args, world, spec, data, schedule, cuts, layers_key)
    return world, plan, Inputs(world, data, plan.precision.compute)


def check_shrink_layout(args):
    """--on-failure shrink where the in-memory commit is not built yet: one
    line. Data parallelism holds every tensor on every replica, or (ZeRO) a
    shard on its owner and a copy on the previous rank; a tensor slice is
    held by every replica of its tensor position (run/survival.py;
    --sequence-parallel rides on the same groups); the pipeline's and
    compression's commits are not built yet (issue 58)."""
    if args.on_failure != "shrink":
        return
    if args.mode != "ring" or args.pipeline_stages > 1 or args.compression != "none":
        raise HpctrainError("--on-failure shrink runs data and tensor parallelism so far: --mode ring (any "
                            "--zero, --tensor-parallel), no --pipeline-stages or --compression (their "
                            "in-memory commits are not built yet)")
    if args.allreduce == "hier":
        # A rank lost on another node leaves hier's survivors waiting in their node's
        # communicator, which holds no failed rank and so is never revoked (seen on 2 nodes).
        raise HpctrainError("--on-failure shrink with --allreduce hier: a survivor would wait in its node's "
                            "communicator for one gone to recover; use --allreduce ring (auto is ring with shrink)")


def augment_line(text, image_shape, seed):
    """The start-up line saying that --augment is on, and what it does."""
    augment = Augment(text, image_shape, seed)
    h, w = augment.shape[:2]
    kinds = ([f"random {h}x{w} crops of the image padded by {augment.pad} px"] if augment.crop else []) + \
        (["left-right flips of half the images"] if augment.flip else [])
    return f"augment: {', '.join(kinds)}; training batches only (test and val sets as they are)"


ZERO_SHARDS = ("nothing sharded", "the optimizer state sharded", "the optimizer state and gradients sharded",
               "the optimizer state, gradients and parameters sharded")


def zero_text(args, cluster, xp):
    """The start line's ZeRO stage (ring mode; ps mode's servers hold the
    shards): --zero, or its default's rule (plan.zero_stage) over the replicas
    that average the gradient (world / (stages x tensor ranks)); with one
    replica nothing is sharded (comm/data_parallel.py), whatever --zero says."""
    if args.mode != "ring":
        return ""
    replicas = cluster.num_workers // (args.pipeline_stages * args.tensor_parallel)
    stage = zero_stage(args, replicas, xp)
    if replicas == 1 and stage < 3:   # (a --zero 3 store of one shard still holds the parameters its way)
        stage = 0
    over = f" over {replicas} replicas" if stage else ""
    return f"ZeRO stage {stage} ({ZERO_SHARDS[stage]}{over}{'' if args.zero is not None else ', the default'}), "


def counted(n, noun):
    """ "1 worker", "2 workers", "0.5 epochs" (n a number of them)."""
    return f"{n:g} {noun}" + ("" if n == 1 else "s")


def workers_said(args, size, num_workers):
    """The start line's workers: those the data is dealt over, "2 workers
    x --tensor-parallel 2" where --pipeline-stages or --tensor-parallel
    split the model over several ranks of each (issue 54, 10: it said 4)."""
    model_ranks = args.tensor_parallel * args.pipeline_stages if args.mode == "ring" else 1
    if model_ranks == 1 or size % model_ranks:   # (cuts_for refuses a split that does not divide the world)
        return counted(num_workers, "worker")
    return " x ".join([counted(size // model_ranks, "worker")]
                      + [f"{flag} {n}" for flag, n in (("--pipeline-stages", args.pipeline_stages),
                                                       ("--tensor-parallel", args.tensor_parallel)) if n > 1])


def with_mesh(world, args):
    """The world with its mesh of process groups (run/mesh.py), ring and
    pipeline modes, made once the plan's cut is known (cuts_for refused a
    stage count that does not divide the world); from here on the watchdog
    names a rank by its coordinates. ps mode: the world as it is (servers
    are not on a mesh; its lines keep plain rank numbers)."""
    if args.mode == "ps":
        return world
    with world.watchdog.waiting("start-up (mesh communicators)", peer=None):
        mesh = Mesh(world.comm, pipeline=args.pipeline_stages, tensor=args.tensor_parallel)
    world.watchdog.name_roles(mesh.describe)
    return replace(world, mesh=mesh)


def tensor_slice(args, spec, world):
    """--tensor-parallel T: the spec of this rank's slice of the model (its
    mesh coordinate on the tensor axis), its layers' collectives on the
    mesh's tensor axis under the watchdog; or the one line saying why the
    model does not split."""
    mesh = world.mesh
    group = TensorGroup(mesh.size("tensor"), mesh.coords.tensor, sequence=args.sequence_parallel,
                        comm=TensorComm(mesh.comm("tensor"), world.watchdog, world.xp))
    if spec.num_state:
        raise HpctrainError(f"--tensor-parallel {group.size}: --model {args.model} has non-trainable state (batch "
                            f"norm's statistics): not split yet")
    try:
        return spec.split_tensor(group)
    except LayerError as e:
        raise HpctrainError(f"--tensor-parallel {group.size}: --model {args.model}: {e}") from None


def groups_across_nodes(size, hosts):
    """The tensor groups (`size` consecutive ranks of the world, `hosts`
    each rank's host) whose ranks lie on more than one host: [(ranks, hosts)]."""
    out = []
    for first in range(0, len(hosts), size):
        ranks = list(range(first, first + size))
        names = sorted({hosts[r] for r in ranks})
        if len(names) > 1:
            out.append((ranks, names))
    return out


def across_nodes_line(size, apart, world):
    """The warning for tensor groups that span nodes (groups_across_nodes)."""
    ranks, names = apart[0]
    return (f"--tensor-parallel {size}: {len(apart)} of {world // size} tensor groups span nodes (ranks "
            f"{ranks[0]}-{ranks[-1]} on {', '.join(names)}{', ...' if len(apart) > 1 else ''}): their allreduces "
            f"cross the nodes' links in every layer; place {size} consecutive ranks on each node (the launcher's "
            f"fill-by-node order) to keep each group inside one")


def tensor_line(spec, mesh):
    """The start-up line of a tensor-parallel run: the groups, and how the vocabulary is cut."""
    t, r = mesh.size("tensor"), mesh.size("data")
    line = (f"tensor parallelism: each layer split over {t} consecutive ranks (a tensor group), "
            f"{r} replica{'s' if r > 1 else ''} of the split model averaging the gradient; "
            f"{len(spec.split_layers)} of {len(spec.layers)} layers split" +
            (", the others on 1/T of the positions each (--sequence-parallel)" if spec.tensor.sequence else ""))
    vocab = [layer.tensor_cuts()["E"] for i, layer in enumerate(spec.layers)
             if i in spec.split_layers and layer.role == "vocab" and "E" in layer.tensor_cuts()]
    if vocab:
        sizes = [b - a for a, b in zip(vocab[0].bounds, vocab[0].bounds[1:])]
        line += f"; the vocabulary's {vocab[0].block} rows cut {' + '.join(map(str, sizes))} (not padded)"
    return line


def _model_spec(args, model_shape, watchdog):
    """model_spec, a user's code under a deadline of its own: a model file
    that does not return (its import, its function, a layer under the
    checks) is named as this rank's own work, not a peer's."""
    if not is_model_file(args.model):
        return model_spec(args, model_shape)
    with watchdog.waiting(f"--model {args.model}: its import, its function and the layer checks",
                          peer="its own model code", own=True):
        return model_spec(args, model_shape)


def server_array_module(args):
    """ps mode: where servers keep their slice (--ps-device). numpy, or cupy
    when asked for and a GPU is there (else one clear error on every rank)."""
    if args.mode != "ps" or args.ps_device != "gpu":
        return np
    try:
        xp, _, _ = device.select("gpu")
    except HpctrainError as exc:
        raise HpctrainError(str(exc).replace("--device gpu", "--ps-device gpu")) from None
    return xp


def check_val(args, has_val, data_dir):
    """--keep-best chooses by validation accuracy: the data must have a val part."""
    if args.keep_best and not has_val:
        raise HpctrainError(f"--keep-best needs a validation part, and {data_dir} has none; prepare "
                            f"it with: python -m hpctrain.data prepare --val-fraction F --out DIR")


def eval_tokens_line(args, manifest, data):
    """The start-up line of a text run whose evaluations score a sample of the
    held-out windows (--eval-tokens, or its default cap); None where they score all."""
    from ..data.splits import held_out_tokens
    used = held_out_tokens(manifest, data.block_size, data.eval_tokens)
    whole = held_out_tokens(manifest, data.block_size)
    if used >= whole:
        return None
    given = f"--eval-tokens {args.eval_tokens:,}" if args.eval_tokens else \
        f"the default --eval-tokens {data.eval_tokens:,}; all: every one"
    return (f"evaluations: {used:,} of the {whole:,} held-out tokens, {used // data.block_size:,} windows evenly "
            f"spaced over them, the same at every evaluation ({given})")


def check_eval_tokens(args, manifest, data_dir):
    """--eval-tokens samples text's held-out windows; images are evaluated whole."""
    if args.eval_tokens is not None and manifest.get("kind") != "tokens":
        raise HpctrainError(f"--eval-tokens samples the held-out windows of text data (prepare --text); "
                            f"{data_dir} holds images, whose test set is evaluated whole")


def _nothing(*args):
    return None


def check_input_kind(args, kind, manifest, data_dir):
    """The model takes what the data's reader gives (kind: nn/spec.py
    input_kind, None where not known yet; data.input_kind): image pixels,
    or token ids; otherwise data/fit.py's line, every command's."""
    if kind is not None:
        check_kind(f"--model {args.model}", kind, data_mod.input_kind(manifest), f"--data {data_dir}",
                   verb="train on")


def model_spec(args, model_shape):
    """The spec of this run's model for its data (nn/zoo.py); a model that
    does not fit the data, or a user's model file or layer that fails, is
    one line (and above it, from the rank that says it, the traceback of the
    user's own code)."""
    try:
        spec = spec_for(args, *model_shape)
    except LayerCodeError as e:
        raise HpctrainError(f"--model {args.model}: {e}", detail=e.traceback) from None
    except LayerError as e:
        raise HpctrainError(f"--model {args.model} does not fit the data "
                            f"({'x'.join(map(str, model_shape[0]))}, {model_shape[1]} classes): {e}") from None
    except UserModelError as e:
        raise HpctrainError(str(e), detail=e.traceback) from None
    if args.batch_size < spec.min_batch:
        # BatchNorm1d over one sample normalises every feature to 0: it would train a constant
        raise HpctrainError(f"--model {args.model} needs at least {spec.min_batch} samples per rank and step "
                            f"(batch norm over a flat input of one sample is 0 everywhere), not --batch-size "
                            f"{args.batch_size}")
    if args.recompute:
        try:   # a flag that would save nothing is a mistake, not a no-op
            spec.use_recompute()
        except LayerError as e:
            raise HpctrainError(f"--recompute: --model {args.model}: {e}") from None
    return spec


# --compiled-layers auto takes nn/compiled.py's kernels from this many
# steps: numba's start-up (about 1 s, the kernels loaded from its disk
# cache; a first run on a machine compiles them, about 0.5 s each) against
# the milliseconds a convolutional step saves (bench layers --compiled-layers).
COMPILED_FROM = 200


def compiled_layers(args, xp, steps):
    """Whether this run's layers run nn/compiled.py's kernels: --compiled-layers
    on or off, or for auto, on NumPy where numba is installed and the run is
    long enough to pay for it; on where they cannot run is refused."""
    if xp is not np:
        if args.compiled_layers == "on":
            raise HpctrainError("--compiled-layers on: the compiled layers are the CPU's; on a GPU the layers run "
                                "CuPy's kernels (use --compiled-layers auto or off, or --device cpu)")
        return False
    if args.compiled_layers == "on" and not compiled.available():
        raise HpctrainError("--compiled-layers on: numba is not installed (pip install 'hpctrain[fast]'), "
                            "or use --compiled-layers auto") from None
    if args.compiled_layers == "auto":
        return steps >= COMPILED_FROM and compiled.available()
    return args.compiled_layers == "on"


def use_blas(name, xp):
    """--blas: the layers' products from NumPy's BLAS or MKL's (nn/blas.py),
    before any layer is bound; mkl where it cannot run is refused."""
    if name == "mkl" and xp is not np:
        raise HpctrainError("--blas mkl: MKL computes on the CPU; on a GPU the products are CuPy's "
                            "(use --blas numpy, or --device cpu)")
    return blas.configure(name)


TUNING_BYTES = 128   # an "isa/vendor: key" of nn/compiled.py's tuning_key, with room


def check_tuning(comm, cluster, stages):
    """Collective: every worker's compiled-layer tuning key (nn/compiled.py
    tuning_key; hpctrain/base/tuning.py), compared. Returns (the chief's key,
    a note for the log or None); raises where the keys differ in a
    pipeline (tuning_verdict)."""
    key = compiled.tuning_key() if cluster.is_worker else ""   # servers run no layers (nor load numba)
    everyone = allgather_bytes(comm, key, TUNING_BYTES)
    keys = {r: everyone[r] for r in cluster.worker_ranks}
    return keys[cluster.chief_rank], tuning_verdict(keys, cluster.hosts, stages)


def tuning_verdict(keys, hosts, stages):
    """keys: {worker rank: its tuning label, "isa/vendor: key"}; hosts: each
    rank's host name. Compared by their keys (tuning.rounding): the part
    that decides the bits.
    Where the ranks' CPUs take rows of hpctrain/base/tuning.py that round apart
    (another sum order, another set of layers run direct):
    - data-parallel replicas (ring, ps, a stage's replicas) still hold the
      same parameters: each rank's gradient is only ever summed with the
      others' and every rank applies the sum. The run goes on, with a note
      that its bits are not those of a run on one CPU type;
    - a pipeline (stages > 1) promises the bits of one process taking the
      same micro-batches in turn (--accumulate-steps): each sample's
      forward and backward cross its stages' ranks, so with keys apart it
      computes what no single CPU would. Refused, in one line."""
    first = rounding(keys[min(keys)])
    odd = [r for r in sorted(keys) if rounding(keys[r]) != first]
    if not odd:
        return None

    def who(r):
        return f"rank {r} ({hosts[r]}): {keys[r]}"
    ranks = f"{who(min(keys))}; " + "; ".join(who(r) for r in odd[:3]) + (" ..." if len(odd) > 3 else "")
    if stages > 1:
        raise HpctrainError(f"--pipeline-stages {stages} with compiled layers on CPUs whose kernels round apart "
                            f"({ranks}): a pipeline promises the bits of --accumulate-steps on one CPU; "
                            f"use --compiled-layers off, or nodes of one CPU type")
    return (f"compiled layers: the ranks' CPUs round apart ({ranks}); the replicas stay identical (their "
            f"gradients are summed), but the bits are not those of a run on one CPU type")


def check_single_pass(args, xp):
    """--single-pass on where the pass cannot run is refused, not ignored:
    on NumPy it is numba's."""
    if args.single_pass != "on" or xp is not np:
        return
    try:
        vector_width.load()
    except ImportError:
        raise HpctrainError("--single-pass on: numba is not installed (pip install 'hpctrain[fast]'), "
                            "or use --single-pass auto") from None


def check_step_size(args, workers, manifest, data_dir):
    """A step takes no more samples than an epoch holds: beyond it the step
    would deal the same samples twice (in silence, for minutes: --accumulate-steps
    1000000 --steps 1 was 7,111 epochs in one step)."""
    train = data_mod.train_samples(manifest, args.block_size)
    per_step = workers * args.batch_size * args.accumulate_steps * args.micro_batches
    if per_step > train:
        parts = [f"{workers} worker{'s' if workers > 1 else ''}", f"--batch-size {args.batch_size}"]
        flags = ["--batch-size"]
        for flag, value in (("--accumulate-steps", args.accumulate_steps), ("--micro-batches", args.micro_batches)):
            if value > 1:
                parts.append(f"{flag} {value}")
                flags.append(flag)
        what = "training samples"
        if manifest.get("kind") == "tokens":   # a text's samples are its windows (data/tokens.py)
            what = f"training windows of --block-size {args.block_size} + 1 tokens"
            flags.insert(0, "--block-size")
        raise HpctrainError(f"{data_dir}: {train:,} {what}, fewer than one step takes "
                            f"({' x '.join(parts)} = {per_step:,}); use a smaller {', '.join(flags)} or fewer workers")
