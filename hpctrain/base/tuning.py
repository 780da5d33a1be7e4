"""The CPU tuning of the compiled layers (nn/compiled.py, nn/passes.py,
hpctrain/base/vector_width.py) and of im2col (nn/conv.py), in one table: a row
per (instruction set, vendor) numba compiles for, looked up by
`tuning_for(isa, vendor)`. Each value is a measured speed; what changes
the bits a kernel gives is only the row's `key` (the sum order and which
layers run direct), which start-up compares across ranks and checkpoints
record (run/startup.py, run/identity.py).

A new CPU generation is a new row here and a test that forces it
(tests/test_compiled.py, NUMBA_CPU_NAME): nothing else moves.

    python -c "from hpctrain.base import tuning; print(*tuning.ROWS, sep='\\n')"
"""
from dataclasses import dataclass

# ---- im2col (nn/conv.py): the same on every CPU, compiled layers or not -------
# These decide how a NumPy convolution blocks its images, so the order its
# weight gradient sums them in: one value everywhere keeps NumPy's bits
# independent of the CPU (and reading it loads no LLVM).
# Floats of im2col columns per block (1 MB of float32): a block's columns and
# its GEMM's output stay in the caches of the machine it was measured on (512
# KB L2 a core, 16 MB L3); 2**18 was the best or near it from 1 to 16 images
# for 32x32x3 -> 32 and 16x16x32 -> 64 (bench layers).
BLOCK_FLOATS = 1 << 18
# From this many columns per output pixel (k*k*in) the forward pass keeps no
# batch of columns: the weight gradient writes them again, a block at a time
# (measured, 16x16x32 -> 64, batch 32: 8.2 ms against 10.4 for one GEMM over
# the kept columns; for 32x32x3 -> 32, K = 27, the kept columns were faster).
AGAIN_FROM = 64

# ---- the compiled kernels' values every row shares -----------------------------
# The most accumulators a kernel holds (nn/compiled.py's stack intrinsic, one
# size so that a kernel's closure is only numbers, what numba's disk cache
# hashes): every row's PIXELS x O and CHANNELS x O fit (tests/test_compiled.py).
STACK_ITEMS = 256
# Batch norm's sums kernels are made per channel count up to this many
# (nn/passes.py), beyond it one plain loop: the same bits either way, so a
# speed alone (measured on Intel only, below).
SUMS_CHANNELS = 64


@dataclass(frozen=True)
class Tuning:
    """One row: the register blocks and switches of the compiled kernels
    for one (isa, vendor); vendor "*" is any vendor.

    pixels:          {O: output pixels a block} of the forward kernel and
                     the gathered input gradient (PIXELS x O/V accumulators,
                     V floats a register); its keys are the output channel
                     counts that run direct (`fits`)
    channels:        {O: input channels a block} of the weight gradient
    loop_vectorize:  {O: whether LLVM's loop vectorizer runs beside the SLP one}
    forward_passes:  {O: (output channels a pass, loop vectorizer)} of the
                     forward kernel; {} is one pass of O with loop_vectorize
    forward_pixels:  the forward kernel's pixels a block, the one that
                     computes the fewest pixels of a row taken; () is `pixels`
    reuse:           at stride 1 the forward kernel loads each input value
                     of a block's row once for the k offsets that read it:
                     its sums in the order (kh, c, kw), not (kh, kw, c)
    wide_vectors:    compile with 512-bit registers (-prefer-256-bit off;
                     hpctrain/base/vector_width.py)
    """
    isa: str
    vendor: str
    pixels: dict
    channels: dict
    loop_vectorize: dict
    forward_passes: dict = None
    forward_pixels: tuple = ()
    reuse: bool = False
    wide_vectors: bool = False

    def fits(self, out_channels):
        return out_channels in self.pixels

    @property
    def key(self):
        """What decides the kernels' bits (rows with one key round alike):
        the forward sum's order and the output channel counts run direct
        (another count runs im2col, another order)."""
        if not self.pixels:
            return "no direct convolutions"
        order = "kh,c,kw at stride 1" if self.reuse else "kh,kw,c"
        return f"sums {order}; direct at {'/'.join(map(str, sorted(self.pixels)))} outputs"

    def forward_blocks(self, out, width):
        """(pixels a block, output channels a pass, loop vectorizer) of the
        forward kernel for `out` channels and rows `width` pixels wide."""
        channels, loop = (self.forward_passes or {}).get(out, (out, self.loop_vectorize[out]))
        if not self.forward_pixels:
            return self.pixels[out], channels, loop
        # the fewest pixels computed, a row's last block overlapping (ties: the larger block)
        return min(self.forward_pixels, key=lambda p: -(-width // p) * p if width >= p else 10 ** 6), channels, loop


# Measured (one thread, batch 32, GFLOP/s; AVX2 with numba told the CPU has
# no AVX-512, NUMBA_CPU_FEATURES):
# - AVX-512 (32 registers of 16 floats; AMD's Zen 4): 4 pixels at O = 16 ran
#   at 108, 7 and 14 fell apart as the compiler spilled. Without the loop
#   vectorizer 16 and 32 channels ran at 93-115 and 64 at 6-7 (its unrolled
#   block too big for the SLP vectorizer alone); with it, 64 ran at 97-114
#   and 16 and 32 at 2-3 (it vectorized the wrong loop).
# - Intel's AVX-512: the forward kernel at 64 output channels in two passes
#   of 32 (W's columns for one pass, 37 KB at 32 input channels, stay in L1;
#   74 KB did not, and the kernel waited on L2), all without the loop
#   vectorizer, with 4 to 7 pixels a block as the row's width is cut best
#   (its last block overlaps the one before: 14 pixels as 7 + 7, 11 as
#   6 + 6). Against the row above (one thread, 20 images): 32->64 channels,
#   14 wide, 95 -> 132 (7 pixels); 64->64, 11 wide, 94 -> 118-149 (6);
#   64->32, 14 wide, 127-135 -> 150-166 (7); 16->16, 28 wide, 111-114 ->
#   129-138 (7). Reuse (batch 32, ms, interleaved medians, (kh, kw, c) ->
#   (kh, c, kw)): 28x28, 16 -> 16 channels 1.95 -> 1.32; 1 -> 16 0.18 ->
#   0.10; 1 -> 32 0.33 -> 0.22; 14x14, 32 -> 64 2.28 -> 1.95; 7x7, 64 -> 64
#   1.10 -> 0.91; 13x13, 32 -> 64 2.10 -> 1.79; 32 -> 32 and 64 -> 32
#   1.01-1.05x; none slower. At stride 2 it was 1.3-8x slower (its offsets
#   do not fold away), so only stride 1 reuses. LLVM tunes these CPUs to
#   256-bit vectors; 512-bit ones: weight gradient 16->16 channels 81 ->
#   115, 32->32 77 -> 124, forward 16->16 100 -> 112 (hpctrain/base/vector_width.py).
#   Zen 4 is not tuned that way (nothing changes there), but 512-bit is its
#   measured row too.
# - AVX2 (16 registers of 8 floats): O = 16 at 4 pixels 106, 4 channels 90
#   (16: 34, spilled); O = 32 at 2 pixels 95 (4: 40), 2 channels 54; O = 64
#   at most 58 whatever the blocks, so 64 channels stay im2col there.
# - Batch norm's sums per channel count (Intel, float32, ms, the plain loop
#   -> per channel count): 25,088 x 16, statistics 0.36 -> 0.13, gradient
#   sums 0.16 -> 0.13; 6,272 x 32, 0.094 -> 0.049 and 0.061 -> 0.040; 1,568 x
#   64, 0.044 -> 0.027 and 0.032 -> 0.022.
_AVX512 = dict(pixels={16: 4, 32: 4, 64: 3}, channels={16: 16, 32: 8, 64: 4},
               loop_vectorize={16: False, 32: False, 64: True}, wide_vectors=True)
ROWS = (
    Tuning("avx512", "intel", **_AVX512, forward_passes={16: (16, False), 32: (32, False), 64: (32, False)},
           forward_pixels=(7, 6, 5, 4), reuse=True),
    Tuning("avx512", "*", **_AVX512),
    Tuning("avx2", "*", pixels={16: 4, 32: 2}, channels={16: 4, 32: 2}, loop_vectorize={16: False, 32: False}),
    # neither: convolutions by im2col; batch norm's sums kernels still made per channel count
    Tuning(None, "*", pixels={}, channels={}, loop_vectorize={}),
)


def vendor_of(cpu_name):
    """"amd", "generic" or "intel" of an LLVM CPU name: AMD's are znver* and
    amdfam*, an unknown CPU "generic"; any other name counts as Intel's."""
    if cpu_name.startswith(("znver", "amdfam")):
        return "amd"
    return "generic" if cpu_name.startswith("generic") else "intel"


def rounding(label):
    """The key part of a label "isa/vendor: key" (nn/compiled.py
    tuning_key; "NumPy" is its own): two CPUs whose labels differ only in
    isa or vendor but share a row's key give the same bits."""
    return label.partition(": ")[2] or label


def tuning_for(isa, vendor):
    """The row for (isa, vendor): its own, else its isa's "*" row (isa
    None, or one without a row: no AVX2 or AVX-512, no direct convolutions)."""
    for row in ROWS:
        if row.isa == isa and row.vendor in (vendor, "*"):
            return row
    return ROWS[-1]
