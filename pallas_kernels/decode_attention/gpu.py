"""KIVI decode attention on CUDA cores: a score and a value kernel (Pallas, Triton lowering).

One decode step: for each sequence ``b`` and query head ``h`` (KV head ``h // n_rep``)

    out[b, h] = softmax_t(q[b, h] . K_t / sqrt(D)) @ V   over t in [0, lengths[b])

Why this shape. At 2 bits a decode step must touch ~2 G key and value elements in ~0.2 ms
(Llama-2-7B heads, 8 x 32k), so every element may cost only about two instructions; a
tensor-core kernel that dequantizes tiles and moves them into the operand layout spends ~9
(docs/history.md, TC). Here nothing is dequantized: both sides are dot products with *one
fixed weight per element group*, done straight on the packed bits, each thread on its own
registers. Codes are read as int32 words (4 bytes; the uint8 cache arrays are reinterpreted
by an XLA bitcast, no copy).

* Keys (per-channel quantization, ``k = s_d c + z_d`` per group of G tokens):
  ``q . k_t = sum_d (q_d s_d) c_td + sum_d q_d z_d``. The score kernel forms (`_fold_query`),
  per group and query head, ``q_d s_d`` as one int16 per channel (``coef * y``, about 16 bits
  relative to the group's largest term; two channels per int32 word) and the bias
  ``sum_d q_d z_d``. A key word holds, in byte r, channel 4w + r of 8 // bits tokens; one
  AND with a mask repeated in every byte keeps one token's code in each byte
  (``c * 2**(bits*j)``), and two ``dp2a`` (IDP.2A, low and high byte pair) multiply the 4
  bytes by the 4 channels' int16 query and sum them into one exact int32: 4 LOP3 and 8 IDP
  per 16 codes.
* Values (per-token quantization, ``v = s_t c + z_t`` per channel group):
  ``sum_t p_t v_td = sum_t (p_t s_t) c_td + sum_t p_t z_t``. IDP.4A again, now summing over
  4 tokens: the words of 4 consecutive tokens (a quad) are byte-transposed (8 PRMT), so that
  byte a of word r holds byte r of token a; the same masks as for keys leave one code of each
  of the 4 tokens per byte. The weights ``p_t s_t`` of a quad's 4 tokens are packed as int8
  parts (two: error at most 1/64516 of the largest weight in the set)
  against the largest weight among the ``value_chain`` quads that a thread chains into the
  same int32 sums in one iteration (no data leaves the thread); the sums are then scaled into
  per-thread float32 accumulators, reduced over tokens once, at the end of the program.

Two kernels in a row, because the value side needs the softmax weights of every token
before it starts and per-thread accumulators cannot afford an online-softmax rescale: the
score kernel folds the query into each tile of key groups and writes the base-2 logits of the
quantized keys (4 bytes per token and query head) and each program's maximum; each program
of the value kernel (a token split of a row) first takes its share of the residual tail (the
last R tokens: full-precision values, and keys either quantized or, from Qk on,
full-precision), then reads its split's logits once, exponentiates against the larger of the
row's quantized max and its tail share's max, and accumulates. XLA merges the splits' partial
softmaxes at the end. With MHA the score kernel's loop is left to Triton's software pipeliner
(`KernelTuning.score_stages`, `triton_stages`): its loads go into shared memory by cp.async, two
tiles ahead, without holding registers. (A third kernel that folded the query into every key
group first, for the score kernel to read as int16 words, was slower at every shape measured:
docs/history.md.) IDP.4A, IDP.2A and PRMT are inline PTX (`ptx`, with the jnp twins that
interpret mode runs).

Token regions per sequence (``l = lengths[b]``, ``R`` the residual length, as in
``kivi_jax.cache``): keys of ``[0, Qk)``, ``Qk = l - l % R``, and values of ``[0, Pv)``,
``Pv = max(l - R, 0)``, are quantized; the R tokens ``[Pv, Pv + R)`` (ring slot ``t % R``) form
the tail, whose keys come from the score kernel (``t < Qk``) or ``k_residual`` and whose values
come from ``v_residual``. Everything is masked by ``t < l``; length-0 rows give zeros.

Supported: k_bits, v_bits in {2, 4}; G a power of two >= 16 dividing D; D in {64, 128};
bfloat16 or float16 queries (``supported_config_reason`` names what is not).

Measured on an H200 (docs/performance.md, GPU time): 3.93x faster than cuDNN bf16 attention
at Llama-2-7B heads, 8 x 32k tokens (KIVI-4 2.68x; 245.6 and 360.7 µs a step against 965.6).
With GQA every query head has its own score and value programs here, which read the KV
head's words in turn (through L2): at Llama-3-8B heads (4 query heads per KV head), 8 x 32k,
these kernels run 0.91x (KIVI-4) and 1.08x (KIVI-2) cuDNN's speed. So with GQA the default is
a tensor-core pair where it supports the configuration (`gqa_scores.py`, `gqa_values.py`: one
warp per KV head serves all its query heads; `GpuTuning.gqa_scores`, `gqa_values`). The kernels read
one layer's arrays as they are (`kivi_jax.cache`: one buffer per layer), so a model's decode
step hands them over without a copy.

Over a page pool (kivi_jax.paged) every kernel takes the row's page table as one more operand
and the KV head's whole pool as one block; each tile lies in one page, whose id the kernel loads
from the table (`pages.py`, `decode_attention_pallas_paged`): the same loads from another
start, the outputs in the row's token order.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kivi_jax.pallas_kernels import triton_stages
from kivi_jax.pallas_kernels.decode_attention import (
    gqa_scores,
    gqa_values,
    loops,
    mixed,
    pages,
    ptx,
    residual,
    state,
)

_LOG2E = math.log2(math.e)
# Value sums chained over a tile: 254 S_hi + S_lo <= chain * 4 * 255 * 127 * 255 < 2**31.
_MAX_CHAIN = 64


# Fields that may be None: a default chosen by the shape (see the methods).
_NONE_MEANS_DEFAULT = (
    "num_splits",
    "score_slices",
    "value_quads",
    "score_stages",
    "gqa_program_groups",
)

# The fields that name a choice, and their choices.
_CHOICES = {
    "gqa_scores": ("cuda_cores", "tensor_cores"),
    "gqa_values": ("cuda_cores", "tensor_cores"),
}

# Warps per program of both CUDA-core kernels: one, so that the value kernel's layout
# conversions are shuffles (2 and 4 warps ran slower in every kernel: docs/history.md R2, R6,
# R10). Triton's num_stages for both (3 no faster, 1 slower: R1, R6); their loops are
# pipelined only where `KernelTuning.score_stages` marks them.
_NUM_WARPS = 1
_NUM_STAGES = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuTuning:
    """What a user may set of the GPU kernels: one precision trade-off (`value_parts`), the
    device's size, and which kernels run with GQA. Apart from `value_parts`, no effect on
    results beyond rounding (float32 summation order, and which value weights share an int8
    scale). Ints must be positive; a bad value raises a ValueError naming the field, an
    unknown field a TypeError. The kernels' tile sizes are settled choices, each with its
    measured reason, in `KernelTuning`.

    value_parts: int8 parts that carry each value weight p_t s_t, 1 or 2. 2 (the default):
      error at most 1/64516 of the largest weight of its chain, finer than bfloat16. 1 trades
      precision for speed: at most 1/254 of it (about bfloat16's step for the largest weight,
      coarser for the rest; ~4x the error of a plain bf16 attention, 25-30x a plain fp16
      one's), half the value kernel's integer dot products (the value kernel 15% faster at
      8 x 32k, 2 bits: docs/history.md R5). The folded query is always an int16 per channel
      (with one int8 part, keys' outlier channels left the others too coarse).
    num_splits: value-kernel token splits per (sequence, query head; with the tensor-core
      value kernel, per KV head); None (the default): the largest power of two at or below
      ceil(target_programs / rows) (at 8 x 32k, 5 splits ran the value kernel 14% slower
      than 4 or 8: R5).
    target_programs: the value-kernel programs `num_splits` None aims at: 8 per SM (an H100
      or H200 has 132 SMs).
    one_wave: score-kernel programs that run in about one wave (an H200 holds up to 32
      one-warp programs on each of its 132 SMs; 4096 chosen). At or below it the MHA score
      kernel uses the register prefetch for 2-bit keys and the tensor-core score kernel 8
      key groups a program (`KernelTuning.key_stages`, `gqa_groups`).
    gqa_scores, gqa_values: the score and value kernels with GQA (n_rep > 1):
      "tensor_cores" (the default: `gqa_scores.gqa_key_scores`, `gqa_values.
      gqa_weighted_values`, one warp per KV head serving its <= 8 query heads with mma.sync)
      where they support the configuration (`supported_reason` of each: G = 32, n_rep <= 8),
      else, or if "cuda_cores", one program per query head (`key_scores`, `_value_kernel`).
      With both on tensor cores the Llama-3-8B-head step on the H200 ran 37% less time at
      8 x 32k, 2 bits, 30% less at 4 bits, and 21% less at 1 x 32k (docs/history.md G9, G10).
    """

    value_parts: int = 2
    num_splits: int | None = None
    target_programs: int = 8 * 132
    one_wave: int = 32 * 128
    gqa_scores: str = "tensor_cores"
    gqa_values: str = "tensor_cores"

    def __post_init__(self):
        name = type(self).__name__
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and f.name in _NONE_MEANS_DEFAULT:
                continue
            if f.name in _CHOICES:
                if v not in _CHOICES[f.name]:
                    names = " or ".join(map(repr, _CHOICES[f.name]))
                    raise ValueError(f"{name}.{f.name} must be {names}, got {v!r}")
                continue
            if f.name == "value_interleave":
                if not isinstance(v, bool):
                    raise ValueError(f"{name}.{f.name} must be a bool, got {v!r}")
                continue
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}.{f.name} must be a positive int, got {v!r}")
        if self.value_parts not in (1, 2):
            raise ValueError(f"{name}.value_parts must be 1 or 2, got {self.value_parts}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelTuning(GpuTuning):
    """`GpuTuning` and the kernels' tile sizes: settled choices, each default with its
    measured reason (H200 sweeps, docs/history.md), in one place. The kernels run with
    `KernelTuning(**asdict(tuning))` for a plain `GpuTuning` (`kernel_tuning`); the tests and
    `benchmarks/attention.py --sweep` pass other tilings to reach the kernels' general paths at
    small shapes (clamped tiles, several programs a row, uneven splits) and to time them.
    score_slices must be a power of two.

    score_rows: key rows per iteration of the score kernel (a row: 4 tokens at 2 bits, 2 at 4
      bits, of every channel; rounded to whole key groups of G tokens). 16 (32 slower: R6, R12).
    score_slices: pieces a key row is loaded in (each thread's share of a row is summed on
      the thread). None: by the key bit width (`key_slices`).
    score_program_groups: key groups per score-kernel program (rounded down to a power of
      two, at most the capacity's groups rounded up to one, at least the groups per
      iteration; a row's last program holds the rest of its groups, `score_tiles`). 16 (8:
      2% faster at 4 bits, 4% slower at 2; 32 slower at 4 bits, even at 2: R12).
    value_quads: quads of 4 tokens per value sub-tile (a thread holds one quad's words of one
      channel group). None: by the value bit width (`quads`).
    value_chain: value sub-tiles per iteration whose integer dot products a thread chains
      into the same accumulators before they are scaled into float32 (the weights' int8 scale
      is the largest weight among those 4 * value_chain tokens); at most 64 (the chained int32
      sums would overflow). 2 (4 and 1 slower: R5, R6).
    prefetch: tiles whose loads are issued ahead of the one being computed, held in registers
      (the value kernel, the score kernel at 1 stage, and the tensor-core kernels). 1 (2 and
      3 slower at every shape timed: R5-R11).
    score_stages: software-pipeline stages of the score kernel's loop (> 1): Triton issues the
      loads of a tile stages - 1 iterations ahead as asynchronous copies into shared memory
      (cp.async: no registers held while they are in flight; `triton_stages`, a private jax
      hook: where jax lacks it the kernels warn once and use the register prefetch); 1: the
      register prefetch. None: by the configuration (`key_stages`).
    value_interleave (bool): a row's value splits take its tiles in turn (tile k of split s
      is the row's tile k * splits + s), so that they walk neighbouring tiles together
      (about 1% faster: R9); False: one contiguous range each.
    tail_slots: residual ring slots per chunk of a value-kernel program's share of the tail
      (the largest power of two dividing R, at most tail_slots; chunks dealt out to the
      token splits in turn). 16 (32 and 64 slower: E1).
    gqa_program_groups: key groups per program of the tensor-core score kernel (its loads
      issued `prefetch` groups ahead). None: by the programs (`gqa_groups`).
    gqa_value_blocks: blocks of 16 tokens per iteration of the tensor-core value kernel
      (a power of two dividing the capacity's blocks, at most this). 2 (1 and 4 slower:
      G9).
    gqa_tail_slots: `tail_slots` of the tensor-core value kernel, whose tail share serves
      all n_rep heads (each chunk's residual keys and values held in registers once). 4 (the
      value kernel 9% faster than with 16; 1 no faster: G9).
    """

    score_rows: int = 16
    score_slices: int | None = None
    score_program_groups: int = 16
    value_quads: int | None = None
    value_chain: int = 2
    prefetch: int = 1
    score_stages: int | None = None
    value_interleave: bool = True
    tail_slots: int = 16
    gqa_program_groups: int | None = None
    gqa_value_blocks: int = 2
    gqa_tail_slots: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.score_slices is not None and self.score_slices & (self.score_slices - 1):
            raise ValueError("KernelTuning.score_slices must be a power of two")
        if self.value_chain > _MAX_CHAIN:
            raise ValueError(
                f"KernelTuning.value_chain={self.value_chain}: at most {_MAX_CHAIN} (the "
                "chained int32 sums of the value kernel would overflow)"
            )

    def key_slices(self, k_bits: int) -> int:
        """score_slices, or if None the default for k_bits-bit keys: 2 at 2 bits (1 ran the
        KIVI-2 step 2.7% slower) and 1 at 4 bits (the KIVI-4 step 2-3.5% faster than with 2
        in three sweeps; half the shared-memory stores per loop in a local build). H200
        sweeps, docs/history.md (R6, R7)."""
        return self.score_slices or (2 if k_bits == 2 else 1)

    def key_stages(self, n_rep: int, *, k_bits: int, programs: int) -> int:
        """score_stages, or if None the default for n_rep query heads per KV head, k_bits-bit
        keys and the score kernel's number of programs: 3 with one (MHA; H200, Llama-2-7B
        heads at 8 x 32k: the score kernel 10% faster than with the register prefetch at 4
        bits, 11% at 2 bits; 2 stages as fast at 4 bits, no faster at 2; at 208 x 2176, 2
        bits, 10% faster), except 1 for 2-bit keys in at most `one_wave` programs (at
        16 x 2176, 2560 programs, the register prefetch 13% faster at 2 bits, 18% slower at
        4); and 1 with GQA, whose query heads read their KV head's key words in turn,
        through L2 (Llama-3-8B heads at 8 x 32k: the score kernel 4% faster with the register
        prefetch at 4 bits, 6% at 2). docs/history.md (R12, E1)."""
        if self.score_stages:
            return self.score_stages
        if n_rep > 1 or (k_bits == 2 and programs <= self.one_wave):
            return 1
        return 3

    def gqa_groups(self, *, n_groups: int, rows: int) -> int:
        """gqa_program_groups, or if None the default for `rows` rows (sequences times KV
        heads) of n_groups key groups: 16, but 8 where 16 would leave fewer than `one_wave`
        programs. H200, Llama-3-8B heads, 2 bits, the tensor-core score kernel with 8
        against 16: 26% less time at 1 x 32k (4: 20%), 15% at 1 x 128k, 23% at 16 x 2176;
        at 8 x 32k (4096 programs) 2% more (docs/history.md, G10)."""
        if self.gqa_program_groups:
            return self.gqa_program_groups
        return 16 if rows * pl.cdiv(n_groups, 16) >= self.one_wave else 8

    def quads(self, v_bits: int) -> int:
        """value_quads, or if None the default for v_bits-bit values: 16 at 2 bits (the value
        kernel in 9% less time than with 8) and 8 at 4 bits (16 took 42% more)."""
        return self.value_quads or (16 if v_bits == 2 else 8)


def kernel_tuning(tuning: GpuTuning) -> KernelTuning:
    """The tuning the kernels run with: `tuning` if it is a KernelTuning, else `tuning`'s
    fields with the settled tile sizes."""
    if isinstance(tuning, KernelTuning):
        return tuning
    return KernelTuning(**dataclasses.asdict(tuning))


def supported_config_reason(
    *, k_bits: int, v_bits: int, group_size: int, head_dim: int, dtype
) -> str | None:
    """None if the GPU kernels support this configuration, else a sentence saying why not."""
    if k_bits not in (2, 4) or v_bits not in (2, 4):
        return f"k_bits={k_bits}, v_bits={v_bits}: the GPU kernel supports 2 and 4 bits"
    if group_size < 16 or group_size & (group_size - 1):
        return f"group_size={group_size}: the GPU kernel needs a power of two >= 16"
    if head_dim not in (64, 128):
        return f"head_dim={head_dim}: the GPU kernel supports 64 and 128"
    if head_dim % group_size:
        return f"group_size={group_size} does not divide head_dim={head_dim}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype)}: the GPU kernel supports bfloat16 and float16"
    return None


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


def score_tiles(
    tuning: GpuTuning, *, capacity: int, group_size: int, head_dim: int, k_bits: int
) -> tuple[int, int, int]:
    """(key groups per program, key groups per iteration, slices of a key row) that
    `key_scores` runs with: powers of two; the groups per iteration and the slices divide the
    capacity's groups and the row's words, the groups per program (a multiple of the groups
    per iteration) need not divide the capacity's groups: the last program holds the rest
    (at 2176 tokens, 68 groups of 32: 16, 16, 16, 16 and 4)."""
    tuning = kernel_tuning(tuning)
    n_groups = capacity // group_size
    rows_per_group = group_size * k_bits // 8
    groups_per_iter = _pow2_divisor(n_groups, max(1, tuning.score_rows // rows_per_group))
    program_groups = 1 << (tuning.score_program_groups.bit_length() - 1)
    program_groups = max(groups_per_iter, min(program_groups, _next_pow2(n_groups)))
    slices = _pow2_divisor(head_dim // 4, tuning.key_slices(k_bits))
    return program_groups, groups_per_iter, slices


def value_tiles(tuning: GpuTuning, *, capacity: int, v_bits: int) -> tuple[int, int]:
    """(quads per sub-tile, sub-tiles per iteration) that `weighted_values` runs with: powers
    of two, 4 times their product dividing the capacity."""
    tuning = kernel_tuning(tuning)
    quads = _pow2_divisor(capacity // 4, tuning.quads(v_bits))
    return quads, _pow2_divisor(capacity // 4 // quads, tuning.value_chain)


def gqa_value_tiles(tuning: GpuTuning, *, capacity: int) -> int:
    """Blocks of 16 tokens per iteration that the tensor-core value kernel runs with
    (`gqa_values.gqa_weighted_values`): a power of two dividing the capacity's blocks, at most
    `tuning.gqa_value_blocks`."""
    tuning = kernel_tuning(tuning)
    return _pow2_divisor(capacity // gqa_values.BLOCK, tuning.gqa_value_blocks)


def _score_tile_start(k, *, g_base, program_groups: int, groups_per_iter: int, n_groups: int):
    """The first group (within its program) of tile k of the score program whose first group
    is g_base. Tiles past the program's last, or past the capacity's last group (the last
    program's blocks, which nothing may read or write unmasked), are clamped to the last
    one: skipped, or (where `live` still holds because later programs have groups)
    recomputed and stored again unchanged. groups_per_iter divides n_groups and
    program_groups (`score_tiles`), so the clamped tile ends within the capacity."""
    last = jnp.minimum(program_groups, n_groups - g_base) // groups_per_iter - 1
    return jnp.minimum(k, last) * groups_per_iter


def _words(codes):
    """uint8 [..., n] -> int32 [..., n // 4], byte i of a word at bits [8i, 8i + 8) (XLA reads
    this as a bitcast of the same buffer on the GPU: no copy)."""
    *lead, n = codes.shape
    return lax.bitcast_convert_type(codes.reshape(*lead, n // 4, 4), jnp.int32)


def _stack_fields(fields):
    """kpb tiles [..] -> one [.., 2, ..., 2] (log2(kpb) twos) holding field j at flat index j.

    Triton stacks two tiles at a time: stack(stack(f0, f2), stack(f1, f3)) puts f_{2a+b} at
    [.., a, b].
    """
    while len(fields) > 1:
        half = len(fields) // 2
        fields = [jnp.stack([fields[i], fields[i + half]], axis=-1) for i in range(half)]
    return fields[0]


def _field_mask(j: int, bits: int) -> int:
    """int32 mask of field j in every byte of a word (codes stay in place: c * 2**(bits*j))."""
    byte_mask = ((1 << bits) - 1) << (bits * j)
    m = byte_mask * 0x01010101
    return m - (1 << 32) if m >= 1 << 31 else m


def _byte_transpose(words, *, interpret: bool):
    """4 int32 tiles (one word of 4 tokens) -> 4 tiles, tile r holding byte r of token a's word
    in its byte a: a 4x4 byte transpose in 8 PRMT."""
    prmt = functools.partial(ptx.prmt, interpret=interpret)
    w0, w1, w2, w3 = words
    lo01, hi01 = prmt(w0, w1, 0x5140), prmt(w0, w1, 0x7362)  # bytes 0, 1 / 2, 3 interleaved
    lo23, hi23 = prmt(w2, w3, 0x5140), prmt(w2, w3, 0x7362)
    return [
        prmt(lo01, lo23, 0x5410),
        prmt(lo01, lo23, 0x7632),
        prmt(hi01, hi23, 0x5410),
        prmt(hi01, hi23, 0x7632),
    ]


def _pack_bytes(x, *, interpret: bool):
    """4 int32 tiles -> one, the low byte of tile a in byte a (3 PRMT)."""
    prmt = functools.partial(ptx.prmt, interpret=interpret)
    return prmt(prmt(x[0], x[1], 0x5140), prmt(x[2], x[3], 0x5140), 0x5410)


_Q_HI = 127  # |hi| <= 127: the int8 high part
_Q_LO = 254  # the low part carries (u - hi) * 254, |.| <= 127: about 16 bits in all
_TINY = 1e-30  # below this a set's largest |x| counts as zero (1 / unit stays finite)


def _int8_unit(amax, top: int = _Q_HI):
    """The unit that maps values with |x| <= amax onto integers of at most `top` (127: the
    high part of `_int8_parts`; the folded query's int16 takes 32767): amax / top (1 where
    amax is below 1e-30, so that such values give zeros and 1 / unit stays finite)."""
    return jnp.where(amax > _TINY, amax / top, 1.0)


def _int8_parts(x, unit, n: int):
    """n int32 parts in [-127, 127], for |x| <= 127 unit: (hi,) with x = unit * hi + e,
    |e| <= unit / 2 = 127 unit / 254 (n = 1), or (hi, lo) with x = unit * (hi + lo / 254) + e,
    |e| <= 127 unit / 64516 (n = 2)."""
    u = x * (1.0 / unit)  # |u| <= 127 (to within rounding)
    hi = jnp.floor(u + 0.5)
    if n == 1:
        return (hi.astype(jnp.int32),)
    lo = jnp.floor((u - hi) * _Q_LO + 0.5)  # |u - hi| <= 1/2
    return hi.astype(jnp.int32), lo.astype(jnp.int32)


def _parts_unit(n: int) -> int:
    """What the unit of `_int8_parts` is divided by to weigh the last of n parts."""
    return _Q_LO ** (n - 1)


def _join_parts(sums):
    """Integer sums of each part (hi first) -> sum_i 254**(n-1-i) sums_i, in units of the last
    part (exact in int32 within the bounds of `_MAX_CHAIN` and the score kernel's rows)."""
    total = sums[0]
    for x in sums[1:]:
        total = total * _Q_LO + x
    return total


_Q16 = 32767  # the folded query's int16 range


def _int16_pairs(xs):
    """Products x[s] [n, w, 4] f32 (channel 4i + r of slice s at [.., i, r]) of n groups ->
    (words, coef [n]), words[half][s] int32 [n, w]: x as int16 (in units of coef), channels
    4i and 4i + 1 in the low and high half of word i of half 0, channels 4i + 2 and 4i + 3 in
    half 1: x_gd = coef_g y_gd + e_gd with |y_gd| <= 32767 and |e_gd| <= max_d |x_gd| / 65534."""
    amax = functools.reduce(
        jnp.maximum, [jnp.max(jnp.max(jnp.abs(x), axis=2), axis=1) for x in xs]
    )  # [n]
    unit = _int8_unit(amax, _Q16)
    r = lax.broadcasted_iota(jnp.int32, (1, 1, 4), 2)
    words = [[], []]
    for x in xs:
        y = jnp.floor(x * (1.0 / unit)[:, None, None] + 0.5).astype(jnp.int32)  # |y| <= 32767
        y = (y & 0xFFFF) << (16 * (r % 2))
        words[0].append(jnp.sum(jnp.where(r < 2, y, 0), axis=2))
        words[1].append(jnp.sum(jnp.where(r < 2, 0, y), axis=2))
    return words, unit


def _fold_query(q, scales, zeros):
    """The query folded into n key groups' scales, slice by slice: q[s] [1, w, 4] f32 scaled
    query, scales[s] / zeros[s] [n, w, 4] (channel 4i + r of slice s at [.., i, r]) ->
    (words, coef [n], bias [n]): q_d s_gd as `_int16_pairs` (about 16 bits, more than the
    bfloat16 query carries), and bias_g = sum_d q_d z_gd."""
    qk = [x * sc.astype(jnp.float32) for x, sc in zip(q, scales, strict=True)]  # q_d s_gd
    words, unit = _int16_pairs(qk)
    qz = [x * z.astype(jnp.float32) for x, z in zip(q, zeros, strict=True)]  # q_d z_gd
    bias = functools.reduce(jnp.add, [jnp.sum(jnp.sum(x, axis=2), axis=1) for x in qz])
    return words, unit, bias


def _fine_logits(words, folded, *, field: int, bits: int, interpret: bool):
    """What the fine channels add to field `field`'s logits of a tile of n key groups: words
    int32 [n, GB, F/4] (fine codes: byte r of word i holds fine channel 4i + r of the token
    byte's kpb tokens), folded: the weights [n, F/4, 4] (`mixed.FineChannels`) as
    `_int16_pairs` -> [n, GB], the codes summed by IDP.2A as the keys' are (F < D: within
    int32)."""
    (w_lo, w_hi), unit = folded
    x = words & _field_mask(field, bits)  # c * 2**(bits*field) in every byte
    acc = jnp.zeros(words.shape, jnp.int32)
    for half, w in enumerate((w_lo[0], w_hi[0])):
        w = jnp.broadcast_to(w[:, None, :], words.shape)
        acc = ptx.dp2a(w, x, acc, high=half == 1, interpret=interpret)
    return jnp.sum(acc, axis=2).astype(jnp.float32) * (unit * 2.0 ** (-bits * field))[:, None]


def _score_kernel(
    len_ref,  # []                 int32
    q_ref,  # [nS, ws, 4]          the query (its dtype; times q_scale here)
    ks_ref,  # [NG, nS, ws, 4]     key scales, folded into the query here (`_fold_query`)
    kz_ref,  # [NG, nS, ws, 4]     key zero points
    kw_ref,  # [NG, GB, nS, ws]    int32 key words: group, token byte, channel quads
    s_ref,  # out [NG, GB, 2..2]   f32 logits of token g*G + kpb*tb + j (j over the 2s)
    m_ref,  # out [M]              f32 at p: max over program p's quantized keys; -1e30 past P
    *,
    n_groups: int,  # key groups in the capacity; the last program's blocks reach past them
    q_scale: float,
    bits: int,
    group_size: int,
    residual_length: int,
    groups_per_iter: int,
    prefetch: int,
    interpret: bool,
    table: pages.RowPages | None = None,
    fine=None,  # (fine words [NG, GB, F/4] int32, weights [NG, F/4, 4] f32), `mixed.fine_last`
):
    NG = s_ref.shape[0]
    *_, GB, nS, ws = kw_ref.shape
    kpb, n1 = 8 // bits, groups_per_iter
    q = [q_ref[s][None].astype(jnp.float32) * q_scale for s in range(nS)]  # [1, ws, 4]
    length = len_ref[()]
    qk_groups = (length - length % residual_length) // group_size
    g_base = pl.program_id(2) * NG
    n_tiles = jnp.clip(pl.cdiv(qk_groups - g_base, n1), 0, NG // n1)
    first_group = functools.partial(
        _score_tile_start, g_base=g_base, program_groups=NG, groups_per_iter=n1, n_groups=n_groups
    )

    def load(k):
        """Tile k: key words per slice [n1, GB, ws], and the key scales and zero points per
        slice [n1, ws, 4]."""
        start = first_group(k)
        at = (pl.ds(start, n1),) if table is None else table.tile(g_base + start, n1)
        words = tuple(kw_ref[(*at, slice(None), s, slice(None))] for s in range(nS))
        params = tuple(tuple(r[(*at, s)] for s in range(nS)) for r in (ks_ref, kz_ref))
        if fine is None:
            return words, params
        return words, params, tuple(r[at] for r in fine)

    def compute(k, tile, m):
        words, params, *fine_tile = tile
        q8, coef, bias = _fold_query(q, *params)
        if fine_tile:
            fine_words, fine_weights = fine_tile[0]
            fine_folded = _int16_pairs([fine_weights])
        shape = (n1, GB, ws)
        valid = (g_base + first_group(k) + lax.broadcasted_iota(jnp.int32, (n1, 1), 0)) < qk_groups
        q8 = [[jnp.broadcast_to(x[:, None, :], shape) for x in half] for half in q8]
        sc = []
        for j in range(kpb):
            acc = jnp.zeros(shape, jnp.int32)  # |.| <= D * 32767 * 255 < 2**31 (D <= 128)
            for s in range(nS):
                x = words[s] & _field_mask(j, bits)  # c * 2**(bits*j) in every byte
                for half in range(2):
                    acc = ptx.dp2a(q8[half][s], x, acc, high=half == 1, interpret=interpret)
            total = jnp.sum(acc, axis=2)  # [n1, GB]
            scale = (coef * 2.0 ** (-bits * j))[:, None]
            logit = total.astype(jnp.float32) * scale + bias[:, None]
            if fine_tile:
                logit = logit + _fine_logits(
                    fine_words, fine_folded, field=j, bits=bits, interpret=interpret
                )
            sc.append(logit)
            m = jnp.maximum(m, jnp.where(valid, sc[j], loops.NEG_INIT))
        s_ref[pl.ds(first_group(k), n1)] = _stack_fields(sc)  # [n1, GB, 2, ..., 2]
        return m

    m_init = jnp.full((n1, GB), loops.NEG_INIT, jnp.float32)  # reduced after the loop
    live = lambda k: g_base + k * n1 < qk_groups  # k < n_tiles, or a clamped tile (above)
    p, programs = pl.program_id(2), pl.num_programs(2)
    m = jnp.max(loops.pipelined_loop(n_tiles, prefetch, load, compute, m_init, live))
    m_ref[p] = m

    @pl.when(programs + p < m_ref.shape[0])
    def _():  # program p also fills pad slot P + p with -1e30 (m >= it; a constant stored
        m_ref[programs + p] = jnp.minimum(m, loops.NEG_INIT)  # in a cond fails to lower)


def _value_kernel(
    len_ref,  # []                         int32
    bm_ref,  # [P]                         f32 max of each score program of the row
    s_ref,  # [C/4, 4]                     f32 logits (the score kernel's output), by quad
    vw_ref,  # [C/4, 4, n_ch, wpg]         int32 value words: quad, token, channel group, word
    vs_ref,  # [C/4, 4, n_ch]              value scale
    vz_ref,  # [C/4, 4, n_ch]              value zero point
    q_ref,  # [D]                          the query (its dtype; times q_scale here)
    kr_ref,  # [R, D]                      residual keys, token t at ring slot t % R
    vr_ref,  # [R, D]                      residual values
    st_ref,  # [C]                         f32 the logits again, flat
    m_ref,  # out []                       f32 m: the program's max logit
    o_ref,  # out [n_ch, wpg, 4, vpb]      f32 sum_t p_t v_t over the split's quantized values,
    #                                          channel ((ch*wpg + u)*4 + r)*vpb + j
    ot_ref,  # out [D]                     f32 sum_t p_t v_t over the program's tail share
    l_ref,  # out []                       f32 sum_t p_t over both, p_t = 2**(s_t - m)
    *,
    splits: int,
    tail_slots: int,
    q_scale: float,
    bits: int,
    max_chunk: int,
    residual_length: int,
    quads: int,
    chain: int,
    parts: int,
    tokens_per_split: int,
    interleave: bool,
    prefetch: int,
    interpret: bool,
    table: pages.RowPages | None = None,
    sliding_keys: bool = False,
):
    """One token split of a row: its share of the residual tail (`residual.tail_share`), then the
    split's tiles of quantized values within [0, Pv), both against one max m: the larger of
    the tail share's max and the row's max over its quantized keys (which cover every
    quantized value: Pv <= Qk). The tail costs no kernel of its own and no program waits for
    another; XLA merges the splits' partial softmaxes. The loads of the first value tiles and
    (where a row has at most 4 chunks of them, `residual.row_max`) of the score programs' maxima are
    issued before the tail share, so that their latencies overlap its own."""
    C4 = s_ref.shape[0]
    *_, n_ch, wpg = vw_ref.shape
    vpb = 8 // bits
    length = len_ref[()]
    split = pl.program_id(2)
    pv = jnp.maximum(length - residual_length, 0)
    step = 4 * quads * chain  # tokens per iteration
    tile_start, end, n_tiles = residual.split_tiles(
        pv, split=split, splits=splits, step=step, tokens_per_split=tokens_per_split,
        interleave=interleave,
    )  # fmt: skip
    shape = (quads, n_ch, wpg)

    def load(k):
        """Tile k: per sub-tile and token of a quad, the words, scales, zero points and logits
        (quads clamped into the capacity: a tile past n_tiles is loaded, not used)."""
        i0 = jnp.minimum(tile_start(k) // 4, C4 - step // 4)
        if table is not None:  # the tile's page (step divides page_size)
            page, j0 = table.locate(i0)
        tiles = []
        for c in range(chain):
            q = pl.ds(i0 + c * quads, quads)
            at = (q,) if table is None else (page, pl.ds(j0 + c * quads, quads))
            tiles.append(
                tuple(
                    (vw_ref[(*at, a)], vs_ref[(*at, a)], vz_ref[(*at, a)], s_ref[q, a])
                    for a in range(4)
                )
            )
        return tuple(tiles)

    # The first value tiles and the row's maxima are loaded while the tail share is computed
    # (against its own max, rescaled to m after).
    ring = tuple(load(k) for k in range(prefetch))
    row_max = residual.row_max(lambda ds: bm_ref[ds], bm_ref.shape[0], max_chunk)
    q = q_ref[...].astype(jnp.float32)[None, :] * q_scale  # [1, D]
    C = st_ref.shape[0]
    [(m_tail, o_tail, l_tail)] = residual.tail_share(
        length, [q], kr_ref, vr_ref, lambda h, tok: st_ref[jnp.minimum(tok, C - 1)],
        split=split, splits=splits, slots=tail_slots, prefetch=prefetch,
        sliding_keys=sliding_keys,
    )  # fmt: skip
    m = jnp.maximum(row_max(), m_tail)
    ot_ref[...] = o_tail * jnp.exp2(m_tail - m)
    l_tail = l_tail * jnp.exp2(m_tail - m)

    def compute(k, tile, carry):
        acc, pz, ls = list(carry[0]), carry[1], carry[2]
        quad = lax.broadcasted_iota(jnp.int32, (quads,), 0)
        w = []  # w[c][a] [quads, n_ch]: p_t s_t of token a of each quad of sub-tile c
        for c, sub in enumerate(tile):
            t0 = tile_start(k) + 4 * quads * c
            w.append([])
            for a, (_, vs, vz, logits) in enumerate(sub):
                p = jnp.where(  # [quads]
                    t0 + 4 * quad + a < end,
                    ptx.exp2_ftz(logits - m, interpret=interpret),
                    0.0,
                )
                w[c].append(p[:, None] * vs.astype(jnp.float32))
                pz = pz + p[:, None] * vz.astype(jnp.float32)
                ls = ls + p
        # The weights as int8 parts per quad and channel group, against the largest among the
        # tile's 4 * chain tokens of that quad position (no data leaves the thread).
        unit = _int8_unit(functools.reduce(jnp.maximum, [jnp.abs(x) for ws in w for x in ws]))
        packed = []  # packed[c][i]: words [quads, n_ch, wpg], token a's part i in byte a
        for ws in w:
            by_token = [_int8_parts(x, unit, parts) for x in ws]
            packed.append([])
            for i in range(parts):
                x = _pack_bytes([part[i] for part in by_token], interpret=interpret)
                packed[-1].append(jnp.broadcast_to(x[..., None], shape))
        # Integer dot products over the 4 tokens of each quad, chained over the sub-tiles, one
        # field at a time (so that only one field's int32 sums are live), then scaled into
        # float32.
        tokens = [_byte_transpose([wd for wd, *_ in sub], interpret=interpret) for sub in tile]
        coef = (unit / _parts_unit(parts))[..., None]
        for r in range(4):
            for j in range(vpb):
                sums = [jnp.zeros(shape, jnp.int32) for _ in range(parts)]  # hi first
                for c in range(chain):
                    x = tokens[c][r] & _field_mask(j, bits)  # c * 2**(bits*j) of 4 tokens
                    for i in range(parts):
                        sums[i] = ptx.dp4a(x, packed[c][i], sums[i], interpret=interpret)
                f = r * vpb + j
                acc[f] = acc[f] + _join_parts(sums).astype(jnp.float32) * coef
        return tuple(acc), pz, ls

    carry = (
        tuple(jnp.zeros(shape, jnp.float32) for _ in range(4 * vpb)),
        jnp.zeros((quads, n_ch), jnp.float32),
        jnp.zeros((quads,), jnp.float32),
    )
    live = lambda k: tile_start(k) < end  # k < n_tiles
    acc, pz, ls = loops.pipelined_loop(n_tiles, prefetch, load, compute, carry, live, ring)
    pz = jnp.sum(pz, axis=0)[:, None]  # [n_ch, 1]
    for r in range(4):
        for j in range(vpb):
            a = jnp.sum(acc[r * vpb + j], axis=0)  # [n_ch, wpg]
            o_ref[:, :, r, j] = a * 2.0 ** (-bits * j) + pz
    l_ref[()] = jnp.sum(ls) + l_tail
    m_ref[()] = m


def _loop_stages(stages: int, interpret: bool) -> int:
    """The pipeline stages a kernel's loop runs with: `stages` where Triton's pipeliner can be
    asked for them (`triton_stages.install`; in interpret mode the same plain loop runs), else
    1 (the register prefetch)."""
    return stages if stages > 1 and (interpret or triton_stages.install()) else 1


def key_scores(q, k_codes, k_scale, k_zero, lengths, table=None, fine=None, *, q_scale, bits,
               group_size, residual_length, tuning, interpret):  # fmt: skip
    """The score kernel. q [B, H, n_rep, D] (queries, any float dtype; the logits are of
    q * q_scale in float32) -> logits [B, H, n_rep, C] of the quantized keys (defined for
    t < Qk) and each program's max [B, H, n_rep, M] (P programs a row, M = P rounded up to a
    power of two, -1e30 past P: a value program reads them in one load where M <= 1024).
    table: None, the keys [B, H, C / kpb, D], [B, H, C / G, D]; or int32 [B, Mp], the keys a
    pool of pages [Pp, H, ps / kpb, D], [Pp, H, ps / G, D] (kivi_jax.paged), C = Mp * ps, each
    tile of key groups within one page (`pages`). fine: None, or a mixed state's fine key
    channels (`mixed.FineChannels`, contiguous keys only), added to the logits and maxima."""
    tuning = kernel_tuning(tuning)
    B, H, n_rep, D = q.shape
    G, kpb = group_size, 8 // bits
    C = k_codes.shape[2] * kpb if table is None else table.shape[1] * k_codes.shape[2] * kpb
    GB, W = G // kpb, D // 4  # token bytes per key group, words per token byte
    NG, n1, nS = score_tiles(tuning, capacity=C, group_size=G, head_dim=D, k_bits=bits)
    ws = W // nS  # words per slice of a key row
    P = pl.cdiv(C // G, NG)
    M = _next_pow2(P)
    twos = (2,) * (kpb.bit_length() - 1)  # kpb = 2 * ... * 2, see _stack_fields
    zeros = (0,) * len(twos)
    Hq = H * n_rep
    stages = _loop_stages(tuning.key_stages(n_rep, k_bits=bits, programs=B * Hq * P), interpret)
    kernel = functools.partial(
        _score_kernel,
        n_groups=C // G,
        q_scale=q_scale,
        bits=bits,
        group_size=G,
        residual_length=residual_length,
        groups_per_iter=n1,
        prefetch=tuning.prefetch if stages == 1 else 0,  # 0: a plain loop
        interpret=interpret,
    )
    if table is None:
        kv = lambda b, h, p: (b, h // n_rep, p, 0, 0, 0)
        key_specs = [pl.BlockSpec((None, None, NG, nS, ws, 4), kv)] * 2 + [
            pl.BlockSpec((None, None, NG, GB, nS, ws), kv)
        ]
        keys = (
            k_scale.reshape(B, H, C // G, nS, ws, 4),
            k_zero.reshape(B, H, C // G, nS, ws, 4),
            _words(k_codes).reshape(B, H, C // G, GB, nS, ws),
        )
        table_specs, tables = [], ()
    else:  # the KV head's whole pool, a tile of n1 groups (dividing a page's) placed by the table
        Pp, gpp = k_codes.shape[0], k_codes.shape[2] * kpb // G  # pages, key groups a page
        n1 = _pow2_divisor(gpp, n1)
        kernel = pages.table_first(
            functools.partial(kernel, groups_per_iter=n1), per_page=gpp, pages=Pp
        )
        pool = lambda b, h, p: (0, h // n_rep, 0, 0, 0, 0)
        key_specs = [pl.BlockSpec((Pp, None, gpp, nS, ws, 4), pool)] * 2 + [
            pl.BlockSpec((Pp, None, gpp, GB, nS, ws), pool)
        ]
        keys = (
            k_scale.reshape(Pp, H, gpp, nS, ws, 4),
            k_zero.reshape(Pp, H, gpp, nS, ws, 4),
            _words(k_codes).reshape(Pp, H, gpp, GB, nS, ws),
        )
        table_specs, tables = [pages.table_spec(table)], (table,)
    name = "kivi_scores" if table is None else "kivi_scores_paged"
    fine_specs, fines = [], ()
    if fine is not None:
        if table is not None:
            raise ValueError("the fine key channels are read from the contiguous state")
        Fp = fine.codes.shape[3]
        kernel = mixed.fine_last(kernel)
        fine_specs = [
            pl.BlockSpec((None, None, NG, GB, Fp // 4), lambda b, h, p: (b, h // n_rep, p, 0, 0)),
            pl.BlockSpec((None, None, NG, Fp // 4, 4), lambda b, h, p: (b, h, p, 0, 0)),
        ]
        fines = (
            _words(fine.codes).reshape(B, H, C // G, GB, Fp // 4),
            fine.weights.reshape(B, Hq, C // G, Fp // 4, 4),
        )
        name = "kivi_scores_fine"
    scores, block_max = pl.pallas_call(
        kernel,
        grid=(B, Hq, P),  # query heads of one KV head read the same key words (through L2)
        in_specs=[
            *table_specs,
            pl.BlockSpec((None,), lambda b, h, p: (b,)),
            pl.BlockSpec((None, None, nS, ws, 4), lambda b, h, p: (b, h, 0, 0, 0)),
            *key_specs,
            *fine_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, NG, GB, *twos), lambda b, h, p: (b, h, p, 0, *zeros)),
            pl.BlockSpec((None, None, M), lambda b, h, p: (b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hq, C // G, GB, *twos), jnp.float32),
            jax.ShapeDtypeStruct((B, Hq, M), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=_NUM_WARPS, num_stages=_NUM_STAGES),
        interpret=interpret,
        name=name if stages == 1 else triton_stages.staged_name(name, stages),
    )(*tables, lengths, q.reshape(B, Hq, nS, ws, 4), *keys, *fines)
    return scores.reshape(B, H, n_rep, C), block_max.reshape(B, H, n_rep, M)


def _splits(tuning: GpuTuning, *, n_steps: int, rows: int) -> tuple[int, int]:
    """(token splits per row, tiles per split) of a value kernel with n_steps tiles per row
    and `rows` rows: `num_splits`, or the largest power of two at or below
    ceil(target_programs / rows) (at 8 x 32k, 256 rows, 5 splits ran the value kernel 14%
    slower than 4 or 8, the step 6%: docs/history.md, R5); at most n_steps, and no split
    left without tiles."""
    if tuning.num_splits is not None:
        S = max(1, min(tuning.num_splits, n_steps))
    else:
        cap = max(1, min(n_steps, pl.cdiv(tuning.target_programs, rows)))
        S = 1 << (cap.bit_length() - 1)
    per_split = pl.cdiv(n_steps, S)
    return pl.cdiv(n_steps, per_split), per_split


def weighted_values(q, scores, block_max, v_codes, v_scale, v_zero, k_residual, v_residual,
                    lengths, table=None, *, q_scale, bits, group_size, residual_length, tuning,
                    interpret, sliding_keys=False):  # fmt: skip
    """The value kernel: S token splits per row, each a partial softmax over its quantized
    values and its share of the residual tail against its own max (`_value_kernel`).
    q [B, H, n_rep, D], scores [B, H, slots, C] and block_max [B, H, slots, P] (`key_scores`,
    slots = n_rep; or `gqa_key_scores`, `gqa_scores.head_slots(n_rep)` slots of which the first
    n_rep are read in place),
    k_residual / v_residual [B, H, R, D] -> per split its max logit m [B, H, n_rep, S], the
    sums of 2**(s_t - m) v_t over its quantized values [B, H, n_rep, S, D] and over its tail
    share [B, H, n_rep, S, D], and the sum of 2**(s_t - m) over both [B, H, n_rep, S]. One
    query head per program (the n_rep heads of a KV head read its value words in turn,
    through L2), except with GQA where `tuning.gqa_values` picks the tensor-core kernel and
    it applies (`gqa_values.gqa_weighted_values`: one program per KV head and split).
    table: None, the values [B, H, C, .]; or int32 [B, Mp], the values a pool of pages
    [Pp, H, ps, .] (kivi_jax.paged), C = Mp * ps, each tile within one page (`pages`).
    sliding_keys: a mixed state's keys of the tail [Pv, l) are the ring's (the logits of
    [Pv, Qk) not read: `residual.tail_share`)."""
    tuning = kernel_tuning(tuning)
    B, H, slots, C = scores.shape
    n_rep = q.shape[2]
    P, R = block_max.shape[3], k_residual.shape[2]
    D = v_codes.shape[3] * (8 // bits)
    G, vpb, Hq = group_size, 8 // bits, H * n_rep
    n_ch, wpg = D // G, G // vpb // 4  # channel groups, words per group and token
    max_chunk = _pow2_divisor(P, 1024)
    tile_capacity = C if table is None else v_codes.shape[2]  # the tiles divide a page
    tensor_cores = n_rep > 1 and tuning.gqa_values == "tensor_cores"
    if tensor_cores and not gqa_values.supported_reason(
        n_rep=n_rep, group_size=G, head_dim=D, v_bits=bits
    ):
        blocks = gqa_value_tiles(tuning, capacity=tile_capacity)
        step = gqa_values.BLOCK * blocks
        S, steps_per_split = _splits(tuning, n_steps=C // step, rows=B * H)
        return gqa_values.gqa_weighted_values(
            q, scores, block_max, v_codes, v_scale, v_zero, k_residual, v_residual, lengths,
            table, q_scale=q_scale, bits=bits, group_size=G, splits=S, blocks=blocks,
            tokens_per_split=steps_per_split * step, interleave=tuning.value_interleave,
            tail_slots=_pow2_divisor(R, tuning.gqa_tail_slots), max_chunk=max_chunk,
            prefetch=tuning.prefetch, interpret=interpret, sliding_keys=sliding_keys,
        )  # fmt: skip
    quads, chain = value_tiles(tuning, capacity=tile_capacity, v_bits=bits)
    step = 4 * quads * chain
    S, steps_per_split = _splits(tuning, n_steps=C // step, rows=B * Hq)
    kv = lambda b, h, s: (b, h // n_rep, 0, 0, 0)
    row = lambda b, h, s: (b, h, 0)
    slot = lambda b, h, s: (b, h // n_rep * slots + h % n_rep)  # query head h's score slot
    per_split = lambda b, h, s: (b, h, s)
    residuals = pl.BlockSpec((None, None, R, D), lambda b, h, s: (b, h // n_rep, 0, 0))
    kernel = functools.partial(
        _value_kernel,
        splits=S,
        tail_slots=_pow2_divisor(R, tuning.tail_slots),
        q_scale=q_scale,
        bits=bits,
        max_chunk=max_chunk,
        residual_length=R,
        quads=quads,
        chain=chain,
        parts=tuning.value_parts,
        tokens_per_split=steps_per_split * step,
        interleave=tuning.value_interleave,
        prefetch=tuning.prefetch,
        interpret=interpret,
        sliding_keys=sliding_keys,
    )
    if table is None:
        value_specs = [
            pl.BlockSpec((None, None, C // 4, 4, n_ch, wpg), lambda b, h, s: (*kv(b, h, s), 0)),
            pl.BlockSpec((None, None, C // 4, 4, n_ch), kv),
            pl.BlockSpec((None, None, C // 4, 4, n_ch), kv),
        ]
        values = (
            _words(v_codes).reshape(B, H, C // 4, 4, n_ch, wpg),
            v_scale.reshape(B, H, C // 4, 4, n_ch),
            v_zero.reshape(B, H, C // 4, 4, n_ch),
        )
        table_specs, tables = [], ()
    else:  # the KV head's whole pool, a tile of step tokens (dividing a page) placed by the table
        Pp, qpp = v_codes.shape[0], v_codes.shape[2] // 4  # pages, quads a page
        kernel = pages.table_first(kernel, per_page=qpp, pages=Pp)
        pool = lambda b, h, s: (0, h // n_rep, 0, 0, 0)
        value_specs = [
            pl.BlockSpec((Pp, None, qpp, 4, n_ch, wpg), lambda b, h, s: (*pool(b, h, s), 0)),
            pl.BlockSpec((Pp, None, qpp, 4, n_ch), pool),
            pl.BlockSpec((Pp, None, qpp, 4, n_ch), pool),
        ]
        values = (
            _words(v_codes).reshape(Pp, H, qpp, 4, n_ch, wpg),
            v_scale.reshape(Pp, H, qpp, 4, n_ch),
            v_zero.reshape(Pp, H, qpp, 4, n_ch),
        )
        table_specs, tables = [pages.table_spec(table)], (table,)
    m, o, o_tail, l_sum = pl.pallas_call(
        kernel,
        grid=(B, Hq, S),
        in_specs=[
            *table_specs,
            pl.BlockSpec((None,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, None, P), lambda b, h, s: (*slot(b, h, s), 0)),
            pl.BlockSpec((None, None, C // 4, 4), lambda b, h, s: (*slot(b, h, s), 0, 0)),
            *value_specs,
            pl.BlockSpec((None, None, D), row),
            residuals,
            residuals,
            pl.BlockSpec((None, None, C), lambda b, h, s: (*slot(b, h, s), 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None), per_split),
            pl.BlockSpec(
                (None, None, None, n_ch, wpg, 4, vpb), lambda b, h, s: (b, h, s, 0, 0, 0, 0)
            ),
            pl.BlockSpec((None, None, None, D), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None), per_split),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hq, S), jnp.float32),
            jax.ShapeDtypeStruct((B, Hq, S, n_ch, wpg, 4, vpb), jnp.float32),
            jax.ShapeDtypeStruct((B, Hq, S, D), jnp.float32),
            jax.ShapeDtypeStruct((B, Hq, S), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=_NUM_WARPS, num_stages=_NUM_STAGES),
        interpret=interpret,
        name="kivi_values" if table is None else "kivi_values_paged",
    )(
        *tables,
        lengths,
        block_max.reshape(B, H * slots, P),
        scores.reshape(B, H * slots, C // 4, 4),
        *values,
        q.reshape(B, Hq, D),
        k_residual,
        v_residual,
        scores.reshape(B, H * slots, C),
    )
    return (
        m.reshape(B, H, n_rep, S),
        o.reshape(B, H, n_rep, S, D),
        o_tail.reshape(B, H, n_rep, S, D),
        l_sum.reshape(B, H, n_rep, S),
    )


def dispatch_key_scores(q, k_codes, k_scale, k_zero, lengths, table=None, fine=None, *, q_scale,
                        bits, group_size, residual_length, tuning, interpret):  # fmt: skip
    """The score kernel the tuning picks for q [B, H, n_rep, D]: with GQA the tensor-core one
    where `tuning.gqa_scores` asks for it and it applies (`gqa_scores.gqa_key_scores`), else
    `key_scores`; -> (logits, maxima) as each returns them (`table`, `fine`: as
    `key_scores`)."""
    tuning = kernel_tuning(tuning)
    B, H, n_rep, D = q.shape
    C = k_scale.shape[2] * group_size * (1 if table is None else table.shape[1])
    common = dict(q_scale=q_scale, bits=bits, group_size=group_size,
                  residual_length=residual_length, interpret=interpret)  # fmt: skip
    tensor_cores = n_rep > 1 and tuning.gqa_scores == "tensor_cores"
    if tensor_cores and not gqa_scores.supported_reason(
        n_rep=n_rep, group_size=group_size, head_dim=D, k_bits=bits
    ):
        return gqa_scores.gqa_key_scores(
            q, k_codes, k_scale, k_zero, lengths, table, fine,
            program_groups=tuning.gqa_groups(n_groups=C // group_size, rows=B * H),
            prefetch=tuning.prefetch, **common,
        )  # fmt: skip
    return key_scores(q, k_codes, k_scale, k_zero, lengths, table, fine, tuning=tuning, **common)


@functools.partial(
    jax.jit,
    static_argnames=(
        "k_bits",
        "v_bits",
        "group_size",
        "residual_length",
        "sliding_keys",
        "sm_scale",
        "tuning",
        "interpret",
    ),
)
def kivi_decode_attention_gpu(
    q,  # [B, Hq, D]
    k_codes,  # uint8 [B, H, C // kpb, D]
    k_scale,  # [B, H, C // G, D]
    k_zero,
    v_codes,  # uint8 [B, H, C, D // vpb]
    v_scale,  # [B, H, C, D // G]
    v_zero,
    k_residual,  # [B, H, R, D]
    v_residual,  # [B, H, R, D]
    lengths,  # int32 [B]
    side=None,  # the MixedState of a mixed-precision state (kivi_jax.cache), else None
    table=None,  # None, or int32 [B, Mp]: the arrays above with a token axis are pools of pages
    *,
    k_bits: int,
    v_bits: int,
    group_size: int,
    residual_length: int,
    sliding_keys: bool = False,
    sm_scale: float | None = None,
    tuning: GpuTuning = GpuTuning(),
    interpret: bool = False,
):
    """Decode attention over a KIVI state with the GPU kernels -> [B, Hq, D]. A mixed state
    (`side`, `sliding_keys`) runs the same kernels, its fine key channels added by the score
    kernel, its tail's keys read from the ring by the value kernel with sliding keys, -inf
    set at its full-precision entries' positions between the two and those entries merged as
    one more split (`mixed`). With a page table the codes,
    scales and zero points are pools of pages ([Pp, H, ps / kpb, D], [Pp, H, ps / G, D],
    [Pp, H, ps, .]; kivi_jax.paged, C = Mp * ps), read through the table in the kernels, each
    tile from one page (plain KIVI only: a mixed state's edits read the contiguous state)."""
    B, Hq, D = q.shape
    _, H, C, _ = v_codes.shape
    G, R = group_size, residual_length
    if table is not None:
        if side is not None:
            raise NotImplementedError(
                "the GPU kernels read a mixed state (kivi2-mix) from the contiguous view, not "
                "through a page table"
            )
        if C % G:
            raise ValueError(f"page_size={C} must be a multiple of G={G}")
        C *= table.shape[1]
    reason = supported_config_reason(
        k_bits=k_bits, v_bits=v_bits, group_size=G, head_dim=D, dtype=q.dtype
    )
    if reason is not None:
        raise NotImplementedError(reason)
    if Hq % H:
        raise ValueError(f"{Hq} query heads are not a multiple of {H} KV heads")
    if R % G or C % G:
        raise ValueError(f"residual_length={R} and capacity={C} must be multiples of G={G}")
    n_rep = Hq // H
    q_scale = (1.0 / math.sqrt(D) if sm_scale is None else sm_scale) * _LOG2E  # base-2 logits
    q = q.reshape(B, H, n_rep, D)
    common = dict(group_size=G, interpret=interpret)
    fine = extras = None
    if side is not None:
        qs = q.astype(jnp.float32) * q_scale
        if side.fine_codes is not None:
            fine = mixed.fine_operands(
                qs, k_scale, side.fine_codes, side.fine_channels, k_bits=k_bits
            )
    scores, block_max = dispatch_key_scores(
        q, k_codes, k_scale, k_zero, lengths, table, fine, q_scale=q_scale, bits=k_bits,
        residual_length=R, tuning=tuning, **common,
    )  # fmt: skip
    if side is not None:
        extras = mixed.extra_entries(side, lengths, residual_length=R, sliding_keys=sliding_keys)
        scores = mixed.mask_extras(scores, extras)
    m, o, o_tail, l_sum = weighted_values(
        q, scores, block_max, v_codes, v_scale, v_zero, k_residual, v_residual, lengths, table,
        q_scale=q_scale, bits=v_bits, residual_length=R, tuning=tuning,
        sliding_keys=sliding_keys, **common,
    )  # fmt: skip
    # the full-precision entries' partial softmax, merged as one more split (no tail)
    extra = None if extras is None else mixed.extras_softmax(qs, extras)
    return _merge_splits(m, o, o_tail, l_sum, extra).reshape(B, Hq, D).astype(q.dtype)


def _merge_splits(m, o, o_tail, l_sum, extra=None):
    """The value kernel's per-split partial softmaxes (`weighted_values`: m and l_sum
    [..., S], o and o_tail [..., S, D]) rescaled to their largest max and merged -> [..., D]
    float32. A split without tokens has zero sums (and m the row's quantized max, or -1e30
    where the row has no quantized keys and the split no tail chunk); an empty row has
    m = -1e30 in every split, so weights of 1 on zero sums, and gives zeros. Written as sums
    over S, which XLA makes one reduction fusion (~2 µs on the H200 at every S the kernels
    use; elementwise over the S slices was slower from S = 8 on, docs/history.md G10).
    extra: one more split's (m [...], o [..., D], l [...]) (`mixed.extras_softmax`), added to
    the sums as a term of its own."""
    top = jnp.max(m, axis=-1, keepdims=True)
    if extra is not None:
        m_e, o_e, l_e = extra
        top = jnp.maximum(top, m_e[..., None])
    w = jnp.exp2(m - top)  # [..., S]
    num = jnp.sum(w[..., None] * (o + o_tail), axis=-2)
    den = jnp.sum(w * l_sum, axis=-1)[..., None]
    if extra is not None:
        w_e = jnp.exp2(m_e[..., None] - top)  # [..., 1]
        num, den = num + w_e * o_e, den + w_e * l_e[..., None]
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)  # length 0 -> zeros


def unsupported_reason(q: jax.Array, cache) -> str | None:
    """None if `decode_attention_pallas(q, cache)` runs, else what it does not support."""
    return state.unsupported_reason(
        cache, head_dim=q.shape[-1], dtype=q.dtype, supported=supported_config_reason,
        reads_mixed=True,
    )  # fmt: skip


def decode_attention_pallas(
    q: jax.Array, cache, *, interpret: bool = False, tuning: GpuTuning = GpuTuning()
) -> jax.Array:
    """The kernels over one layer's KiviCache: q [B, Hq, D] -> [B, Hq, D] in q's dtype."""
    reason = unsupported_reason(q, cache)
    if reason is not None:
        raise NotImplementedError(f"impl='pallas': {reason}")
    arrays, config = state.kernel_args(cache)
    side, window = state.mixed_args(cache)
    return kivi_decode_attention_gpu(
        q, *arrays, *side, **config, **window, tuning=tuning, interpret=interpret
    )


def unsupported_paged_reason(q: jax.Array, paged) -> str | None:
    """None if `decode_attention_pallas_paged(q, paged)` runs, else what it does not support."""
    return state.unsupported_reason(
        paged.rows, head_dim=q.shape[-1], dtype=q.dtype, supported=supported_config_reason,
        reads_mixed=False,
    )  # fmt: skip


def decode_attention_pallas_paged(
    q: jax.Array, paged, *, interpret: bool = False, tuning: GpuTuning = GpuTuning()
) -> jax.Array:
    """The kernels over one layer's kivi_jax.paged.PagedCache, the table read in the kernels
    (each tile's page id loaded from it; no contiguous view): q [B, Hq, D] -> [B, Hq, D] in q's
    dtype. Plain KIVI (a mixed state: the contiguous kernels on the view, `paged.
    decode_attention`). Tiles never cross a page: each kernel's settled tile, halved until it
    divides page_size (any multiple of G; from 128 tokens on every tile is the contiguous
    kernels': values 128 tokens at 2 bits and 64 at 4, keys 64 and 32, the tensor-core
    kernels one key group and 32 tokens)."""
    from kivi_jax.paged import merge

    reason = unsupported_paged_reason(q, paged)
    if reason is not None:
        raise NotImplementedError(f"impl='pallas' through the page table: {reason}")
    # the rows' rings and lengths and the pool's codes, scales and zeros in one Cache's fields
    arrays, config = state.kernel_args(merge(paged.rows, paged.pages))
    return kivi_decode_attention_gpu(
        q, *arrays, None, paged.table, **config, tuning=tuning, interpret=interpret
    )
