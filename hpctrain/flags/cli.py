"""The one argparse definition of hpctrain's flags, their defaults and checks.

Used by `python -m hpctrain.train` (and `hpctrain.mnist`, its MNIST name);
imports only the standard library so the
flags can be parsed before numpy, BLAS or MPI start (they read environment
variables that we set from the flags and the launcher).

    python -m hpctrain.train --help
"""
import argparse
import sys

from .arguments import (Parser, ShortHelp, auto_or_positive_int, finite_float, nonneg_float, nonneg_int,
                        positive_float, positive_int, positive_ints, with_config_file)
from .model_names import MODELS, gpt_name, gpt_options, is_model_file
from ..base.errors import HpctrainError
from .parallel_flags import check_tensor_parallel, check_thread_split, check_zero

DEFAULT_STEPS = 2000
# Flags a pretrained model decides when left out (--init-from: its model and
# its position table); given, they are checked against it. None in the parser
# so that a value typed equal to the default still counts as given.
PRETRAINED_DEFAULTS = {"model": "mlp", "block_size": 256}
# Past these a run cannot be meant: a million passes over the data (--steps
# says a long run plainly), or a trillion steps (116 days at 10 us a step).
MAX_EPOCHS = 1e6
MAX_STEPS = 10**12


def _steps(text):
    value = positive_int(text)
    if value > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_STEPS:,}, got {text}")
    return value


def _epochs(text):
    value = positive_float(text)
    if value > MAX_EPOCHS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_EPOCHS:,.0f} passes over the "
                                         f"data, got {text} (a long run: --steps N)")
    return value


def _path(text):
    if not text.strip():   # "" would silently mean "not given" (an unset shell variable)
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return text


def _betas(text):
    """--adam-betas B1,B2: two numbers, each in [0, 1)."""
    try:
        betas = tuple(float(t) for t in text.split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise argparse.ArgumentTypeError(f"expected B1,B2, each in [0, 1), got {text!r}")
    return betas


# --eval-tokens' default for text: the held-out tokens a GPT's evaluations
# score (an evenly spaced sample of the held-out windows past it,
# data/tokens.eval_windows). 2**17: the bundled plays' held-out tenth
# (103,616 tokens in windows of 64) is evaluated whole, as README's figures
# were, while a large corpus's (a 100 MB text's tenth: 10M tokens, about an
# hour for README's GPT on one CPU process) costs what 131,072 tokens cost
# (about 40 s); samples of 8,192 to 65,536 of the plays' tokens came within
# 0.01 nats of the whole split's loss (docs/usage.md, "The final evaluation").
DEFAULT_EVAL_TOKENS = 2**17
# --batch-size's default: also the batch `hpctrain evaluate` runs forward (a training step's memory)
DEFAULT_BATCH_SIZE = 32


def eval_tokens(text):
    """--eval-tokens N|all: a positive count of held-out tokens, or 0 for all of them."""
    if text == "all":
        return 0
    try:
        return positive_int(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected a positive number of tokens or all, got {text!r}") from None


def trained_flags(p, pretrained=False, products=True):
    """The flags of a command that reads a trained model (evaluate,
    predict, generate): --params or --checkpoint, one of them, and --model;
    pretrained: --params takes a Hugging Face folder or an exported
    .safetensors file too (interop/pretrained.load); products: --blas, for
    a command that runs the layers (evaluate, predict; generation's cached
    decoding has products of its own)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", metavar="FILE.h5|HF_DIR" if pretrained else "FILE.h5",
                     help="a --save (or --keep-best) file" + (", a Hugging Face GPT-2 folder (config.json + "
                     "model.safetensors) or a .safetensors file of hpctrain export" if pretrained else ""))
    src.add_argument("--checkpoint", metavar="DIR|FILE", help="a checkpoint file, or the newest valid one in DIR")
    p.add_argument("--model", metavar="NAME|FILE.py:FUNCTION", default=None,
                   help="rebuild the model with this instead of what the file records; a model trained from "
                        "a user's FILE.py is rebuilt only from the file named here, never from a path inside "
                        "the saved file")
    if products:
        p.add_argument("--blas", choices=["numpy", "mkl"], default="numpy",
                       help="the library of the layers' products, as training's --blas: a model trained with "
                            "--blas mkl scores as its final evaluation did with mkl (default: %(default)s)")


def _model(text):
    if text in MODELS or is_model_file(text):
        return text
    try:
        options = gpt_options(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--model gpt:layers=L,heads=H,width=E[,dropout=P]: {e}") from None
    if options is not None:
        return gpt_name(options)
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(MODELS)}, "
                                     f"gpt:layers=L,heads=H,width=E[,dropout=P] or FILE.py:FUNCTION, got {text!r}")


def _hidden(text):
    return list(positive_ints(text, "layer widths"))


def _augment(text):
    """--augment: crop, crop=P (pixels of padding), flip, comma-separated;
    kept as canonical text ("crop,flip"; "" or "none": off), the setting ranks
    compare and checkpoints record (data/augment.py applies it)."""
    found = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        if item == "none":
            continue
        if name not in ("crop", "flip") or (value and (name != "crop" or not value.isdigit() or int(value) < 1)):
            raise argparse.ArgumentTypeError(f"expected crop, crop=P (P >= 1 pixels) and/or flip, got {text!r}")
        found[name] = item
    return ",".join(found[k] for k in ("crop", "flip") if k in found)


# The flags most runs use, shown by --help (--help-all: every flag): the ten
# that README's and docs/'s training commands give most often, counted, with
# --num-ps and --compression (one mode's, listed under their groups) replaced
# by --batch-size and --save, which every run has a value for; and
# --block-size, which every GPT run sets, and --config, a run's flags in a file.
COMMON_FLAGS = ("--config", "--data", "--model", "--block-size", "--steps", "--epochs", "--batch-size", "--lr",
                "--mode", "--checkpoint-dir", "--save", "--metrics")


def build_parser(prog="python -m hpctrain.train"):
    p = Parser(
        prog=prog, add_help=False,
        description="Train a model data-parallel across MPI ranks on prepared HDF5 shards (default: "
                    "the bundled MNIST sample; run under mpirun/srun; one process trains alone).")
    p.add_argument("-h", "--help", action=ShortHelp, common=COMMON_FLAGS, help="the flags most runs use, and the groups")
    p.add_argument("--help-all", action="help", help="every flag, group by group")
    _training_flags(p)
    _ring_flags(p.add_argument_group("ring mode"))
    _compression_flags(p.add_argument_group("gradient compression (ring mode and a pipeline's replicas; "
                                            "docs/ring.md)"))
    _ps_flags(p.add_argument_group("ps mode"))
    _pipeline_flags(p.add_argument_group("pipeline (model parallelism, ring mode)"))
    _output_flags(p.add_argument_group("checkpoints and output"))
    return p


def _training_flags(p):
    g = p.add_argument_group("training")
    g.add_argument("--config", metavar="FILE.toml|FILE.json", type=_path, default=None,
      help="a run's flags from a file, keys the flags' names (block_size = 64), the command line's "
           "overriding it (examples/shakespeare_char.toml; docs/usage.md)")
    g.add_argument("--mode", choices=["ring", "ps"], default="ring",
      help="ring: every rank a peer, gradients averaged by ring allreduce; "
           "ps: parameter servers + workers (default: %(default)s)")
    g.add_argument("--data", metavar="DIR", type=_path, default=None,
      help="directory of prepared HDF5 shards (default: data/mnist, prepared from "
           "the bundled 5k sample on first use); or a blend of prepared text sets, "
           "DIR_A:0.7,DIR_B:0.3, each drawn at its weight (the held-out split: the first set's)")
    g.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE, help="samples per worker per step (default: %(default)s)")
    length = g.add_mutually_exclusive_group()
    length.add_argument("--steps", type=_steps, default=None,
                        help=f"global training steps (default: {DEFAULT_STEPS})")
    length.add_argument("--epochs", type=_epochs, default=None, metavar="E",
                        help="train for E passes over the training set instead: steps = ceil(E * train samples "
                             "/ (workers * --batch-size)), from the data's manifest at start-up")
    g.add_argument("--lr", type=positive_float, default=1e-4, help="learning rate (default: %(default)s)")
    g.add_argument("--accumulate-steps", type=positive_int, default=1, metavar="K",
                   help="K micro-batches of --batch-size per optimizer step, one gradient exchange per step "
                        "(Horovod's backward_passes_per_step, DDP's no_sync): a global batch of workers x K x "
                        "batch size in the memory of one batch (default: %(default)s)")
    g.add_argument("--optimizer", choices=["adam", "sgd", "momentum"], default="adam", help="(default: %(default)s)")
    g.add_argument("--single-pass", choices=["auto", "on", "off"], default="auto",
                   help="the optimizer's update as one compiled pass over each range (numba on NumPy, one kernel "
                        "on CuPy) or NumPy's blocks: the same bits; auto: on a GPU, and on NumPy where numba "
                        "(pip install 'hpctrain[fast]') pays back its ~1 s and ~110 MB start-up within the run: "
                        "from 131,072 parameters and 3.6e8 parameter-steps, or from the first with compiled "
                        "layers (default: %(default)s)")
    g.add_argument("--momentum", type=nonneg_float, default=0.9, help="momentum coefficient for --optimizer momentum (default: %(default)s)")
    g.add_argument("--adam-betas", type=_betas, default=(0.9, 0.999), metavar="B1,B2",
                   help="--optimizer adam's decay rates of the gradient's first and second moments, each in "
                        "[0, 1) (nanoGPT: 0.9,0.99) (default: 0.9,0.999)")
    g.add_argument("--model", type=_model, default=None, metavar="NAME|FILE.py:FUNCTION",
                   help=f"the network: {', '.join(MODELS)}, gpt:layers=L,heads=H,width=E[,dropout=P][,act=A]"
                        f"[,eps=X] (nanoGPT's, on text data; act=gelu_tanh: GPT-2's GELU; eps: the LayerNorms' "
                        f"epsilon, default 1e-5) (docs/models.md), or FUNCTION(input_shape, classes) "
                        f"of your own FILE.py returning a list of layers (default: %(default)s)")
    g.add_argument("--block-size", type=positive_int, default=None, metavar="T",
                   help="text data (prepare --text): the tokens a sample holds, the model's context length "
                        f"(default: {PRETRAINED_DEFAULTS['block_size']}, or with --init-from the pretrained model's "
                        f"positions where they are fewer)")
    g.add_argument("--recompute", action="store_true",
                   help="drop each transformer block's activations after its forward and recompute them in its "
                        "backward (Megatron's full recomputation, one block the grain): the same parameters bit "
                        "for bit, a rank keeping the blocks' inputs and one block's activations instead of "
                        "every block's (docs/models.md)")
    g.add_argument("--hidden", type=_hidden, default=[500, 500], metavar="W1,W2,...",
                   help="--model mlp's hidden layer widths (default: 500,500)")
    g.add_argument("--seed", type=nonneg_int, default=0, help="random seed: the initial parameters (rank 0's, broadcast) and each worker's "
                        "each epoch's data shuffle, a function of (seed, epoch) (default: %(default)s)")
    g.add_argument("--scale-lr", action="store_true",
                   help="multiply --lr by the number of workers (linear scaling rule, Goyal et al.)")
    g.add_argument("--warmup-steps", type=nonneg_int, default=0,
                   help="ramp the learning rate up linearly over the first K steps (default: %(default)s)")
    g.add_argument("--lr-schedule", choices=["constant", "step", "cosine"], default="constant",
                   help="constant: --lr throughout; step: times --lr-decay every --lr-decay-steps steps; "
                        "cosine: from --lr after the warm-up down to --lr-min at the last step (default: %(default)s)")
    g.add_argument("--lr-decay", type=positive_float, default=0.1,
                   help="--lr-schedule step: the factor applied every --lr-decay-steps steps (default: %(default)s)")
    g.add_argument("--lr-decay-steps", type=nonneg_int, default=0,
                   help="--lr-schedule step: decay every N steps (required, > 0)")
    g.add_argument("--lr-min", type=nonneg_float, default=0.0,
                   help="--lr-schedule cosine: the lr at the last step (default: %(default)s)")
    g.add_argument("--weight-decay", type=nonneg_float, default=0.0, metavar="WD",
                   help="decoupled weight decay (AdamW): p -= lr * WD * p every step, for every --optimizer, "
                        "on the tensors --weight-decay-on names (default: %(default)s)")
    g.add_argument("--weight-decay-on", choices=["matrices", "all"], default="matrices",
                   help="matrices: what multiplies (Dense/Linear/Conv2d weights, attention's projections, the "
                        "token Embedding), not biases, norms' gains and shifts or the PositionEmbedding table "
                        "(a layer's `decays`, docs/models.md); all: every parameter (default: %(default)s)")
    g.add_argument("--clip-norm", type=positive_float, default=None, metavar="C",
                   help="clip the averaged gradient to global 2-norm C: g *= min(1, C / (||g|| + 1e-6)), "
                        "the same factor on every rank (ring: the per-bucket updates then wait for the last "
                        "bucket; sync ps: on the servers' aggregate; async ps: each worker's own gradient) "
                        "(default: off)")
    g.add_argument("--augment", type=_augment, default="", metavar="crop,flip",
                   help="augment training images per sample, from (seed, epoch, sample id): crop (zero padding of "
                        "1/8 of the side, crop=P for P pixels, then a random crop back to size), flip (left-right, "
                        "half the time); refused for data prepared with --no-flip (default: off)")
    g.add_argument("--device", choices=["cpu", "gpu", "auto"], default="auto",
                   help="where arrays live: cpu (NumPy), gpu (CuPy), auto (gpu if CuPy sees one) (default: %(default)s)")
    g.add_argument("--compiled-layers", choices=["auto", "on", "off"], default="auto",
                   help="on the CPU, layer kernels compiled by numba (pip install 'hpctrain[fast]'): direct "
                        "convolutions with 16, 32 or 64 output channels (the others im2col), batch norm's "
                        "passes, max pooling and ReLU's gradient; off: NumPy and BLAS alone (im2col); auto: on "
                        "where numba is installed, from 200 steps (default: %(default)s)")
    g.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="compute threads per rank on the CPU: convolutions and batch norm split their images "
                        "over them, each thread's BLAS at one thread (the same bits on any N); 1: none "
                        "(default: the cores this rank gets, as for BLAS's threads: one rank on 2 cores, 2)")
    g.add_argument("--blas", choices=["numpy", "mkl"], default="numpy",
                   help="the library of the layers' matrix products on the CPU: numpy (NumPy's own BLAS, OpenBLAS "
                        "in its wheels) or mkl (Intel MKL's SGEMM, pip install 'hpctrain[mkl]': faster on Intel "
                        "CPUs, its own bits; nn/blas.py) (default: %(default)s)")
    g.add_argument("--thread-split", choices=["ops", "samples"], default="ops",
                   help="how --threads share a training step: ops (each operation's rows over the threads, the "
                        "bits of one thread) or samples (the batch cut into --thread-slices slices, each run "
                        "through whole layers by one thread, their gradients summed in slice order: the same bits "
                        "on any --threads, other bits than ops; ring mode, --zero 0 or 1, no batch norm) "
                        "(default: %(default)s)")
    g.add_argument("--thread-slices", type=positive_int, default=2, metavar="S",
                   help="--thread-split samples: slices a batch (or micro-batch) is cut into, whatever the "
                        "thread count; at most S threads have work (default: %(default)s)")
    g.add_argument("--wait-mode", choices=["auto", "nap", "spin"], default="auto",
                   help="how a rank waits for the others in a pipeline's transfers, its loss-and-stop sum and a "
                        "ps round: spin (MPI's blocking calls: the lowest latency, for a core per rank), nap (poll, "
                        "then sleep 20-160 us between polls: a waiting rank leaves shared cores to the ranks that "
                        "compute), auto: nap where this node's ranks outnumber its cores. The ring's exchanges "
                        "always spin (default: %(default)s)")


def _ring_flags(g):
    g.add_argument("--allreduce", choices=["auto", "ring", "hier", "mpi", "nccl"], default="auto",
                   help="ring: hpctrain's ring allreduce; hier: reduce-scatter inside each node, ring allreduce "
                        "across nodes, allgather inside each node (equal ranks per node, else the ring); "
                        "auto: ring on one node, hier on several with equal ranks per node, ring otherwise; "
                        "mpi: MPI_Allreduce; nccl: NCCL through CuPy (default: %(default)s)")
    g.add_argument("--ring-order", choices=["node", "rank"], default="node",
                   help="order of the ring's ranks: node (ranks of one node adjacent, whatever the launcher's "
                        "placement: each node boundary crossed once per direction) or rank (the launcher's "
                        "order); the same on one node (default: %(default)s)")
    # 4 MiB, not 1: the MLP as one bucket (one ring a step, not three) trained
    # 1.07x faster at 2 ranks, 1.14x at 4 on 2 cores (docs/ring.md); DDP's are 25 MB.
    g.add_argument("--fusion-mb", type=nonneg_float, default=4.0,
                   help="bucket size in MiB for fused, overlapped gradient allreduce; 0 = one allreduce after backprop (default: %(default)s)")
    g.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                   help="run bucket allreduces on a communication thread during backprop: on, off, or auto "
                        "(on for GPUs and when each rank has a spare core; off when ranks share cores, "
                        "where the thread only steals CPU from backprop)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                   help="ZeRO stage of ring mode: 0 every rank holds everything; 1 each rank updates only its share "
                        "of every bucket after the reduce-scatter and the allgather carries parameters (optimizer state "
                        "and work 1/N); 2 the gradient sharded too (each rank keeps its 1/N of the summed gradient and "
                        "one or two buckets in flight, no full-length gradient); 3 the parameters sharded too (each bucket "
                        "gathered just before its layers run, forward and backward; one bucket ahead with --overlap on). The "
                        "same parameters bit for bit at every stage. Default: 1 with 2 or more workers on CPUs with "
                        "--allreduce auto|ring|hier, where it measured faster, else 0")
    g.add_argument("--shard-optimizer", choices=["auto", "on", "off"], default="auto",
                   help="the old name of --zero 1 (on) and --zero 0 (off); auto: --zero's default (default: %(default)s)")
    g.add_argument("--cuda-aware", choices=["auto", "yes", "no"], default="auto",
                   help="pass GPU buffers straight to MPI (yes), stage through host memory (no), or ask the MPI library (auto)")


def _on_off(text):
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text


def _rate(text):
    value = finite_float(text)
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (a compression rate), got {text}")
    return value


def _compression_flags(g):
    g.add_argument("--compression", choices=["none", "fp16", "bf16", "powersgd"], default="none",
                   help="what each rank sends of its gradient: none: float32 (the bits of a run without the "
                        "flag); fp16, bf16: every bucket as 16-bit floats, half the bytes, summed in float32 at "
                        "each hop (fp16 divides by the number of ranks before the sum against its 65504 ceiling; "
                        "bf16 keeps float32's range with 8 bits of mantissa); powersgd: each weight matrix as two "
                        "rank-R factors with error feedback (Vogels et al. 2019, DDP's powerSGD_hook), 1-D tensors "
                        "and small matrices as float32 (default: %(default)s)")
    g.add_argument("--powersgd-rank", type=positive_int, default=4, metavar="R",
                   help="PowerSGD's rank: a rows x cols matrix goes as (rows + cols) x R floats. Vogels et al. "
                        "needed 2 for ResNet-18 on CIFAR-10 and 4 for an LSTM to match full accuracy; DDP's "
                        "default 1 loses accuracy on harder models (default: %(default)s)")
    g.add_argument("--powersgd-start", type=nonneg_int, default=100, metavar="K",
                   help="the first K steps exchange float32 gradients (DDP's start_powerSGD_iter): early in "
                        "training the gradient changes fast and the warm-started Q has not found its subspace, "
                        "and compressing from step 0 costs accuracy; DDP suggests about 10%% of training "
                        "(default: %(default)s)")
    g.add_argument("--powersgd-min-rate", type=_rate, default=2.0, metavar="RATE",
                   help="compress a matrix only if rows x cols > RATE x (rows + cols) x R (DDP's "
                        "min_compression_rate): below that the two factors and four thin matrix products cost "
                        "more than the bytes they save; such matrices go as float32 (default: %(default)s)")
    g.add_argument("--powersgd-warm-start", type=_on_off, default="on", metavar="on|off",
                   help="carry each matrix's Q from step to step (Vogels et al.'s warm start: each step one "
                        "more power iteration on a slowly changing gradient); off: a fresh random Q every step, "
                        "a worse approximation for the same bytes (default: %(default)s)")
    g.add_argument("--powersgd-epsilon", type=nonneg_float, default=0.0, metavar="EPS",
                   help="added to each column's norm when P is orthogonalised (DDP's orthogonalization_epsilon). "
                        "0 keeps P orthonormal at any scale (with a warm start P grows with the gradient's "
                        "square, so a fixed EPS distorts small gradients); a zero column stays zero, never NaN "
                        "(default: %(default)s)")
    g.add_argument("--powersgd-error-feedback", type=_on_off, default="on", metavar="on|off",
                   help="add what a rank did not send to its next step's gradient (DDP's use_error_feedback); "
                        "off drops it, for comparison only: PowerSGD without it converges worse "
                        "(default: %(default)s)")


def _cut_points(text):
    """--pipeline-split: layer indices, comma-separated; kept as the text (a
    setting ranks compare and checkpoints record), checked against the model
    once it is known (pipeline/stages.py); "" (the default) balances the stages."""
    if not text:
        return ""
    try:
        cuts = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices like 2,5, got {text!r}") from None
    return ",".join(map(str, cuts))


def _pipeline_flags(g):
    g.add_argument("--pipeline-stages", type=positive_int, default=1, metavar="P",
                   help="cut the model's layers into P stages on P x R ranks (R = world size / P replicas of each "
                        "stage, averaging its gradient); 1 = no pipeline (default: %(default)s)")
    g.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="T",
                   help="split each transformer block (attention by heads, the MLP by columns then rows), the "
                        "vocabulary and Dense pairs over T consecutive ranks (Megatron-LM's tensor parallelism, "
                        "docs/parallelism.md); the world is T x R ranks, R replicas averaging the gradient; "
                        "1 = no split (default: %(default)s)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tensor-parallel T on a GPT: the norms, dropouts and residual sums between the split "
                        "layers on 1/T of the positions each (Megatron-LM's sequence parallelism): each allreduce "
                        "a reduce-scatter and an allgather, the same bytes; those activations T times smaller")
    g.add_argument("--micro-batches", type=positive_int, default=1, metavar="M",
                   help="with --pipeline-stages: M micro-batches of --batch-size per replica and step, pipelined "
                        "through the stages (the samples of --accumulate-steps M) (default: %(default)s)")
    g.add_argument("--pipeline-schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b",
                   help="gpipe: every forward, then every backward; 1f1b: one forward, one backward, holding "
                        "fewer activations; interleaved: 1F1B over --virtual-stages V chunks per stage "
                        "(Megatron's), the bubble V times smaller for V times the messages; needs M a multiple "
                        "of P (default: %(default)s)")
    g.add_argument("--virtual-stages", type=positive_int, default=None, metavar="V",
                   help="with --pipeline-schedule interleaved: the layers cut into P x V chunks, stage s holding "
                        "chunks s, s + P, ... (default: 2 with interleaved)")
    g.add_argument("--pipeline-split", type=_cut_points, default="", metavar="I,J,...",
                   help="the P - 1 layer indices where stages begin (interleaved: the P x V - 1 where chunks "
                        "begin; python -m hpctrain.nn lists the layers); default: balance the layers' forward "
                        "and backward multiply-adds")


def _ps_flags(g):
    g.add_argument("--num-ps", type=positive_int, default=1,
                   help="N ranks are parameter servers, which ones: --ps-ranks (default: %(default)s)")
    g.add_argument("--ps-ranks", choices=["spread", "first"], default="spread",
                   help="which ranks are the servers: spread: server k on node k mod (nodes), the lowest rank "
                        "there not taken yet, so no one node's link carries every push and pull; first: "
                        "ranks 0..N-1. On one node both are ranks 0..N-1 (default: %(default)s)")
    sync = g.add_mutually_exclusive_group()
    sync.add_argument("--sync", dest="sync", action="store_true", default=True,
                      help="synchronous updates: one per version from distinct workers (default)")
    sync.add_argument("--async", dest="sync", action="store_false",
                      help="asynchronous updates: each gradient applied on arrival")
    g.add_argument("--replicas-to-aggregate", type=positive_int, default=None,
                   help="sync: gradients (from distinct workers) per update (default: all workers minus --backup-workers)")
    g.add_argument("--backup-workers", type=nonneg_int, default=0,
                   help="sync: aggregate the first W-B workers' gradients and drop the rest (default: %(default)s)")
    g.add_argument("--max-staleness", type=nonneg_int, default=None,
                   help="async: a worker more than S versions behind pulls again instead of pushing (default: unbounded)")
    g.add_argument("--dc-lambda", type=nonneg_float, default=0.0,
                   help="async: DC-ASGD delay compensation strength (0 = plain async) (default: %(default)s)")
    g.add_argument("--placement", choices=["round-robin", "greedy", "even"], default="even",
                   help="how parameters are split over servers (default: %(default)s)")
    g.add_argument("--ps-device", choices=["cpu", "gpu"], default="cpu",
                   help="where servers keep their parameter slice and optimizer state (default: %(default)s)")
    g.add_argument("--ps-exchange", choices=["auto", "mpi"], default="auto",
                   help="auto: on each node, workers and servers exchange gradients and parameters through an MPI "
                        "shared-memory window (only headers are messages; NumPy workers; between nodes, messages); "
                        "mpi: MPI messages only (default: %(default)s)")


def _output_flags(g):
    g.add_argument("--checkpoint-dir", metavar="DIR", type=_path, default=None, help="write checkpoints here (each rank its own parts, the chief the index)")
    g.add_argument("--checkpoint-every", type=nonneg_int, default=0,
                   help="checkpoint every N steps (0: only on SIGTERM/SIGUSR1/SIGHUP and at the end) (default: %(default)s)")
    g.add_argument("--keep-checkpoints", type=positive_int, default=3, help="keep the newest K checkpoints (default: %(default)s)")
    g.add_argument("--resume", choices=["auto", "yes", "no"], default="auto",
                   help="auto: resume from the newest valid checkpoint if there is one; yes: require one; no: start fresh")
    g.add_argument("--resume-other-data", action="store_true", default=False,
                   help="resume from a checkpoint trained on other data than --data (fine-tuning): the data "
                        "starts at its first epoch; without it such a resume is refused (default: off)")
    g.add_argument("--init-from", metavar="PATH", type=_path, default=None,
                   help="start from a pretrained model's parameters (the optimizer fresh), the architecture "
                        "its: a Hugging Face GPT-2 folder (config.json + model.safetensors), a .safetensors file of "
                        "hpctrain export, or a --save file; a resumable checkpoint in --checkpoint-dir comes first")
    g.add_argument("--save", metavar="FILE.h5", type=_path, default=None, help="write the final parameters to this HDF5 file")
    g.add_argument("--metrics", metavar="FILE.jsonl", type=_path, default=None, help="write metrics as JSON Lines (chief only)")
    g.add_argument("--tensorboard", metavar="DIR", type=_path, default=None,
                   help="write the loss, lr, samples/s, gradient norm and evaluations as TensorBoard scalars into "
                        "DIR (chief only; needs tensorboardX: pip install 'hpctrain[tensorboard]')")
    g.add_argument("--log-every", type=positive_int, default=100, help="print a progress line every N steps (default: %(default)s)")
    g.add_argument("--eval-every", type=nonneg_int, default=0,
                   help="evaluate on the test set (and the validation part, if the data has one) every N steps "
                        "(0: only at the end) (default: %(default)s)")
    g.add_argument("--eval-tokens", type=eval_tokens, default=None, metavar="N|all",
                   help="text data: score N held-out tokens in every evaluation (periodic, --keep-best, final), "
                        "an evenly spaced sample of the held-out windows, the same at every evaluation and on any "
                        "number of ranks (nanoGPT's eval_iters x batch size); all: every window "
                        f"(default: {DEFAULT_EVAL_TOKENS:,}, docs/usage.md)")
    g.add_argument("--final-eval", choices=["on", "off"], default="on",
                   help="off: no evaluation after the last step (the final record's test_loss and test_accuracy "
                        "are null, final_eval \"off\"); --eval-every's evaluations still run (default: %(default)s)")
    g.add_argument("--keep-best", metavar="FILE.h5", type=_path, default=None,
                   help="write the parameters of the best validation accuracy so far to this HDF5 file "
                        "(text data: the lowest validation loss) (needs --eval-every and data prepared with "
                        "--val-fraction)")
    g.add_argument("--timeline", metavar="FILE.json", type=_path, default=None, help="write a Chrome trace of the chief's steps")
    g.add_argument("--timeline-steps", type=nonneg_int, default=100, metavar="N",
                   help="--timeline records the first N steps of the run (a pipeline's every rank: about 3 KB a "
                        "step; a trace viewer slows down past a few hundred thousand spans); 0: every step "
                        "(default: %(default)s)")
    g.add_argument("--memory-budget", type=positive_float, default=None, metavar="GIB",
                   help="memory one rank may use, in GiB, as SLURM's --mem-per-cpu gives it (default: this node's "
                        "available memory shared among its ranks); a model or batch that does not fit it is "
                        "refused at start-up, naming the pipeline (--pipeline-stages) that would fit")
    g.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds any rank waits for a peer before it names the peer and aborts the job (default: %(default)s)")
    g.add_argument("--on-failure", choices=["exit", "shrink"], default="exit",
                   help="a rank that dies: exit (the others name it within --timeout and end the job; a requeue "
                        "resumes from the last checkpoint) or shrink (the survivors go on without it from the "
                        "last in-memory commit; needs Open MPI's ULFM: mpirun --with-ft ulfm; docs/faults.md) "
                        "(default: %(default)s)")
    g.add_argument("--commit-every", type=auto_or_positive_int, default="auto", metavar="K|auto",
                   help="--on-failure shrink: hold in memory what a resume needs every K steps; a lost rank costs "
                        "the steps since. auto: as often as keeps the commits within 2%% of the run's time, "
                        "timed as it runs (the first 10 steps after a start, then every 1 to 200 steps, the "
                        "same on every rank; docs/faults.md) (default: %(default)s)")


def validate(args, world_size):
    """Checks that need the world size. Raises HpctrainError (same on every rank)."""
    if args.mode == "ps":
        if args.num_ps >= world_size:
            raise HpctrainError(
                f"--mode ps with --num-ps {args.num_ps} needs more than {args.num_ps} ranks "
                f"(got {world_size}): no rank would be a worker")
        workers = world_size - args.num_ps
        if args.backup_workers >= workers:
            raise HpctrainError(f"--backup-workers {args.backup_workers} must be less than the {workers} workers")
        if args.replicas_to_aggregate is not None and args.replicas_to_aggregate > workers:
            raise HpctrainError(f"--replicas-to-aggregate {args.replicas_to_aggregate} is more than the {workers} workers")
    if args.allreduce == "nccl" and args.device == "cpu":
        raise HpctrainError("--allreduce nccl needs --device gpu (or auto on a GPU node)")
    check_zero(args)
    check_tensor_parallel(args, world_size)
    check_thread_split(args)
    if args.compression != "none":
        _check_compression(args)
    if args.lr_schedule == "step" and not args.lr_decay_steps:
        raise HpctrainError("--lr-schedule step needs --lr-decay-steps N (N > 0)")
    if args.lr_schedule == "cosine" and args.lr_min > args.lr:
        raise HpctrainError(f"--lr-min {args.lr_min:g} is above --lr {args.lr:g}: a cosine schedule decays")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise HpctrainError("--checkpoint-every needs --checkpoint-dir")
    if args.resume == "yes" and not args.checkpoint_dir:
        raise HpctrainError("--resume yes needs --checkpoint-dir")
    if args.keep_best and not args.eval_every:
        # Best of what? Only the periodic validations (and the final one) choose.
        raise HpctrainError("--keep-best needs --eval-every N (N > 0)")


def _check_compression(args):
    """--compression where it cannot work: one line each, the reason in it."""
    kind = args.compression
    if args.mode == "ps":
        raise HpctrainError(f"--compression {kind} is for --mode ring (and a pipeline's replicas): in ps mode each "
                            f"worker pushes its gradient to the servers point to point, and PowerSGD's two sums "
                            f"per step (P, then Q) have no place in a ps round; use --mode ring")
    if kind in ("fp16", "bf16") and args.allreduce in ("mpi", "nccl"):
        what = "MPI has no 16-bit float sum" if args.allreduce == "mpi" else "NCCL sums 16-bit floats in 16 bits"
        raise HpctrainError(f"--compression {kind} with --allreduce {args.allreduce}: {what}, and hpctrain's "
                            f"16-bit exchange sums in float32 over its own rings; use --allreduce auto, ring or "
                            f"hier (--compression powersgd works with {args.allreduce}: its factors are float32 sums)")


# Flags whose value may start with '-' ("--adam-betas -0.1,0.9"): argparse
# takes such a word for a flag and says "expected one argument"; joined to its
# flag ("--adam-betas=-0.1,0.9") it reaches the flag's own check, which names
# what is wrong with it.
DASH_VALUES = ("--adam-betas",)


def _dash_values(argv):
    argv, out = [str(a) for a in argv], []
    i = 0
    while i < len(argv):
        if argv[i] in DASH_VALUES and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and not argv[i + 1].startswith("--"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def parse(argv=None, quiet=False, prog="python -m hpctrain.train"):
    """Parse flags; a bad flag raises HpctrainError. With quiet=True (non-zero
    ranks) --help prints nothing, so the job shows one copy."""
    parser = build_parser(prog)
    parser.quiet = quiet
    args = parser.parse_args(_dash_values(with_config_file(parser, sys.argv[1:] if argv is None else list(argv))))
    if not args.init_from:   # with --init-from, the pretrained model decides them (interop/pretrained.init_args)
        for dest, value in PRETRAINED_DEFAULTS.items():
            if getattr(args, dest) is None:
                setattr(args, dest, value)
    if args.steps is None and args.epochs is None:
        args.steps = DEFAULT_STEPS
    elif args.steps is None:
        # --epochs: the plan turns them into steps once the data's manifest
        # and the worker count are known (run/plan.py); 0 until then.
        args.steps = 0
    if not quiet:   # rank 0 warns for the job (the others parse the same flags)
        for line in doubtful(args, parser):
            print(f"hpctrain: warning: {line}", file=sys.stderr, flush=True)
    return args


def configuration(args):
    """The run's merged configuration: every setting by its flag's dest name
    (the --config file's, the command line's over it, the defaults), as the
    final record's `config` and each checkpoint's `config` attribute (JSON)
    keep it; written to FILE.json, itself a --config file for the same run."""
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(vars(args).items()) if k != "config"}
    if args.epochs is not None:
        config["steps"] = None   # parse's placeholder: --epochs sets the steps
    return config


def doubtful(args, parser):
    """Settings that may be meant but look like a slip: each a line, the run goes on."""
    default = parser.get_default
    lines = []
    if args.lr_schedule != "step":
        lines += [f"{flag} {value:g} has no effect without --lr-schedule step"
                  for flag, value, dflt in (("--lr-decay-steps", args.lr_decay_steps, "lr_decay_steps"),
                                            ("--lr-decay", args.lr_decay, "lr_decay"))
                  if value != default(dflt)]
    if args.lr_schedule != "cosine" and args.lr_min != default("lr_min"):
        lines.append(f"--lr-min {args.lr_min:g} has no effect without --lr-schedule cosine")
    if args.steps and args.warmup_steps > args.steps:
        lines.append(f"--warmup-steps {args.warmup_steps} is longer than the run ({args.steps} steps): "
                     f"the learning rate never reaches --lr {args.lr:g}")
    if args.model not in ("mlp", None) and args.hidden != default("hidden"):
        lines.append(f"--hidden has no effect with --model {args.model} (it sizes --model mlp)")
    powersgd = [flag for flag in ("powersgd_rank", "powersgd_start", "powersgd_min_rate", "powersgd_warm_start",
                                  "powersgd_epsilon", "powersgd_error_feedback") if getattr(args, flag) != default(flag)]
    if powersgd and args.compression != "powersgd":
        lines.append(f"{', '.join('--' + f.replace('_', '-') for f in powersgd)} ha{'ve' if len(powersgd) > 1 else 's'} "
                     f"no effect without --compression powersgd")
    elif args.compression == "powersgd" and args.steps and args.powersgd_start >= args.steps:
        lines.append(f"--powersgd-start {args.powersgd_start} is not before the last step ({args.steps}): "
                     f"nothing is compressed")
    if not args.hidden and args.model == "mlp":
        lines.append("--hidden gives no layer widths: the model is linear (inputs straight to the "
                     "classes, no hidden layer)")
    return lines


DEFAULT_TIMEOUT = build_parser().get_default("timeout")
