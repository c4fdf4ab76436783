"""KIVI decode attention on CUDA cores: query, score and value kernels (Pallas, Triton lowering).

One decode step: for each sequence ``b`` and query head ``h`` (KV head ``h // n_rep``)

    out[b, h] = softmax_t(q[b, h] . K_t / sqrt(D)) @ V   over t in [0, lengths[b])

Why this shape. At 2 bits a decode step must touch ~2 G key and value elements in ~0.2 ms
(Llama-2-7B heads, 8 x 32k), so every element may cost only about two instructions. The
earlier tensor-core kernel spent ~9 (unpacking, then moving every dequantized tile through
shared memory into the operand layout Triton picks). Here nothing is dequantized: both sides
are dot products with *one fixed weight per element group*, done straight on the packed bits,
each thread on its own registers. Codes are read as int32 words (4 bytes; the uint8 cache
arrays are reinterpreted by an XLA bitcast, no copy).

* Keys (per-channel quantization, ``k = s_d c + z_d`` per group of G tokens):
  ``q . k_t = sum_d (q_d s_d) c_td + sum_d q_d z_d``. The query kernel writes, per group and
  query head, ``q_d s_d`` as two int8 parts per channel (``coef * (254 hi + lo)``, about 16 bits
  relative to the group's largest term) and the bias ``sum_d q_d z_d``. A key word holds, in
  byte r, channel 4w + r of 8 // bits tokens; one AND with a mask repeated in every byte keeps
  one token's code in each byte (``c * 2**(bits*j)``), and one ``dp4a`` (IDP.4A) multiplies
  the 4 bytes by 4 int8 query parts and sums them into an exact int32: 4 LOP3 and 8 IDP per
  16 codes.
* Values (per-token quantization, ``v = s_t c + z_t`` per channel group):
  ``sum_t p_t v_td = sum_t (p_t s_t) c_td + sum_t p_t z_t``. A shift and an OR move byte ``r``
  of a word to mantissa bits [15, 23) under the exponent of 1.0; each of its ``8 // bits``
  codes is then one AND away from the float32 ``X = 1 + c * 2**(bits*j - 8)`` (``j`` the
  code's field in the byte), and one FMA ``acc += (p_t s_t) * X`` adds it into a per-thread
  accumulator tile that is reduced over tokens once, at the end of the program;
  ``c = 2**(8 - bits*j) (X - 1)`` turns the sums into the output with per-group constants. The
  float32 sums carry the offset ``1`` of ``X`` (at most 256 code steps) and lose at most 8 of
  their 24 bits to it.

Three kernels, because the value side needs the softmax weights of every token before it
starts and per-thread accumulators cannot afford an online-softmax rescale: the query kernel
folds the query into every key group; the score kernel writes the base-2 logits of the
quantized keys (4 bytes per token and query head) and each program's maximum; XLA forms the
global max per row with the residual tail; the value kernel then reads the logits once,
exponentiates against that max and accumulates. The residual tail (at most R tokens per row,
held in full precision) is a small XLA einsum, merged at the end.

Token regions per sequence (``l = lengths[b]``, ``R`` the residual length, as in
``kivi_jax.cache``): keys of ``[0, Qk)``, ``Qk = l - l % R``, and values of ``[0, Pv)``,
``Pv = max(l - R, 0)``, are quantized; the R tokens ``[Pv, Pv + R)`` (ring slot ``t % R``) form
the tail, whose keys come from the score kernel (``t < Qk``) or ``k_residual`` and whose values
come from ``v_residual``. Everything is masked by ``t < l``; length-0 rows give zeros.

Supported: k_bits, v_bits in {2, 4}; G a power of two >= 16 dividing D; D in {64, 128};
bfloat16 or float16 queries (``supported_config_reason`` names what is not).

Measured on an H200 (docs/performance.md): ~2.3x faster than cuDNN bf16 attention at
Llama-2-7B heads (MHA); with GQA the value kernel adds an FMA per element and query head, and
at 4 query heads per KV head the step is about half cuDNN's speed.
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

_LOG2E = math.log2(math.e)
_NEG_INIT = -1e30  # running-max start: finite, so an empty row never computes inf - inf
_ONE_BITS = 0x3F800000  # float32 1.0
_FIELD_LO = 15  # a byte's codes are moved to mantissa bits [15, 23)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuTuning:
    """Tile sizes (no effect on results beyond float32 summation order).

    score_rows: key rows per iteration of the score kernel (a row: 4 tokens at 2 bits, 2 at 4
      bits, of every channel; rounded to whole key groups of G tokens).
    score_slices: pieces a key row is loaded in (each thread's share of a row is summed on
      the thread; with a row in 8 pieces of 4 words every thread owns whole rows).
    score_program_groups: key groups per score-kernel program.
    query_program_groups, query_warps: key groups and warps per query-kernel program.
    value_rows: tokens per value sub-tile (the per-thread accumulators' rows) for MHA; divided
      by n_rep (rounded up to a power of two) for GQA, where every query head has its own.
    value_subtiles: value sub-tiles loaded per iteration (bytes in flight per program).
    prefetch: tiles whose loads are issued ahead of the one being computed (score and value
      kernels).
    num_splits: value-kernel token splits per (sequence, KV head); None aims at
      target_programs programs.

    The defaults are among the fastest of the H200 sweeps at Llama-2-7B heads (within the
    timing spread of the fastest), picked for their registers (docs/performance.md).
    """

    score_rows: int = 16
    score_slices: int = 4
    score_program_groups: int = 16
    score_warps: int = 1
    query_program_groups: int = 16
    query_warps: int = 4
    value_rows: int = 64
    value_subtiles: int = 2
    value_warps: int = 4
    prefetch: int = 2
    num_splits: int | None = None
    target_programs: int = 4 * 132
    num_stages: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and f.name == "num_splits":
                continue
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GpuTuning.{f.name} must be a positive int, got {v!r}")
        for name in ("score_warps", "value_warps", "query_warps", "score_slices"):
            if getattr(self, name) & (getattr(self, name) - 1):
                raise ValueError(f"GpuTuning.{name} must be a power of two")


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


def score_tiles(
    tuning: GpuTuning, *, capacity: int, group_size: int, head_dim: int, k_bits: int
) -> tuple[int, int, int]:
    """(key groups per program, key groups per iteration, slices of a key row) that
    `key_scores` runs with: powers of two dividing the capacity's groups and the row's words."""
    program_groups = _pow2_divisor(capacity // group_size, tuning.score_program_groups)
    rows_per_group = group_size * k_bits // 8
    groups_per_iter = _pow2_divisor(program_groups, max(1, tuning.score_rows // rows_per_group))
    return program_groups, groups_per_iter, _pow2_divisor(head_dim // 4, tuning.score_slices)


def value_tiles(tuning: GpuTuning, *, capacity: int, n_rep: int) -> tuple[int, int]:
    """(tokens per sub-tile, sub-tiles per iteration) that `weighted_values` runs with: powers
    of two, their product dividing the capacity."""
    rows = _pow2_divisor(capacity, max(1, tuning.value_rows // pl.next_power_of_2(n_rep)))
    return rows, _pow2_divisor(capacity // rows, tuning.value_subtiles)


def _byte_to_field(words, r: int):
    """int32 words -> byte r at bits [15, 23), OR-ed with float32 1.0 (a shift and an OR)."""
    s = 8 * r - _FIELD_LO
    aligned = lax.shift_left(words, -s) if s < 0 else lax.shift_right_logical(words, s)
    return aligned | _ONE_BITS


def _words(codes):
    """uint8 [..., n] -> int32 [..., n // 4], byte i of a word at bits [8i, 8i + 8) (XLA reads
    this as a bitcast of the same buffer on the GPU: no copy)."""
    *lead, n = codes.shape
    return lax.bitcast_convert_type(codes.reshape(*lead, n // 4, 4), jnp.int32)


def _field(aligned, j: int, bits: int):
    """float32 1 + c * 2**(bits*j - 8), c the code in field j of the aligned byte: one AND.

    (a | ONE) & (M | ONE) == (a & M) | ONE when M and ONE share no bits; the AND also clears
    the sign and top exponent bit that the shift left there.
    """
    mask = ((1 << bits) - 1) << (_FIELD_LO + bits * j)
    return lax.bitcast_convert_type(aligned & (mask | _ONE_BITS), jnp.float32)


def _field_weight(j: int, bits: int) -> float:
    """c = _field_weight * (X - 1) for X = _field(..., j, bits)."""
    return 2.0 ** (8 - bits * j)


def _stack_fields(fields):
    """kpb tiles [..] -> one [.., 2, ..., 2] (log2(kpb) twos) holding field j at flat index j.

    Triton stacks two tiles at a time: stack(stack(f0, f2), stack(f1, f3)) puts f_{2a+b} at
    [.., a, b].
    """
    while len(fields) > 1:
        half = len(fields) // 2
        fields = [jnp.stack([fields[i], fields[i + half]], axis=-1) for i in range(half)]
    return fields[0]


def _pipelined_loop(n_tiles, depth: int, load, compute, carry, live):
    """carry = compute(k, load(k), carry) for k in [0, n_tiles), loads issued `depth` tiles ahead.

    Each step first issues the load of tile k + depth, then computes tile k, so a load has
    `depth` computations' time to arrive (Triton pipelines only loads that feed a dot). The
    computation sits in a branch on `live(k)` (true for every k < n_tiles, in a form the
    compiler cannot fold): without a branch between them ptxas may move the loads below the
    arithmetic, to the end of the loop body, where nothing overlaps their latency (it did in
    the 2-bit MHA value kernel: benchmarks/results/cuda_core_sweeps/run5_sass_before.md). The
    body is unrolled `depth` times over a ring of tiles; the last round may run up to
    depth - 1 tiles past n_tiles, and the loads of the last `depth` steps go past it too:
    `load` must clamp such tiles into bounds, and `live` must be false for them or their
    computation harmless.
    """
    ring = tuple(load(k) for k in range(depth))

    def body(i, state):
        carry, ring = state
        ring = list(ring)
        for u in range(depth):
            k = i * depth + u
            ahead = load(k + depth)
            carry = lax.cond(live(k), functools.partial(compute, k, ring[u]), lambda c: c, carry)
            ring[u] = ahead
        return carry, tuple(ring)

    carry, _ = lax.fori_loop(0, pl.cdiv(n_tiles, depth), body, (carry, ring))
    return carry


def _field_mask(j: int, bits: int) -> int:
    """int32 mask of field j in every byte of a word (codes stay in place: c * 2**(bits*j))."""
    byte_mask = ((1 << bits) - 1) << (bits * j)
    m = byte_mask * 0x01010101
    return m - (1 << 32) if m >= 1 << 31 else m


def _dp4a(a, b, c, *, interpret: bool):
    """c + sum_i a_i * b_i over the 4 bytes of int32 words: a's unsigned, b's signed.

    On the GPU this is one instruction (IDP.4A); in interpret mode the same integer sum.
    """
    if interpret:
        for i in range(4):
            a_i = lax.shift_right_logical(a, 8 * i) & 0xFF
            b_i = lax.shift_right_arithmetic(lax.shift_left(b, 24 - 8 * i), 24)
            c = c + a_i * b_i
        return c
    [out] = plgpu.elementwise_inline_asm(
        "dp4a.u32.s32 $0, $1, $2, $3;",
        args=[a, b, c],
        constraints="=r,r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)],
    )
    return out


_Q_HI = 127  # |hi| <= 127: the query's int8 high part
_Q_LO = 254  # the low part carries (u - hi) * 254, |.| <= 127: about 16 bits in all
_TINY = 1e-30  # below this a group's largest |q_d s_gd| counts as zero (1 / unit stays finite)


def _query_kernel(
    q_ref,  # [n_rep, W, 4]              f32 scaled queries, channel 4w + r at [h, w, r]
    ks_ref,  # [NG, W, 4]                key scales of NG groups
    kz_ref,  # [NG, W, 4]                key zero points
    q8_ref,  # out [n_rep, NG, 2, W]     int32 hi and lo parts, channel 4w + r in byte r
    cb_ref,  # out [n_rep, 2, NG]        f32 coef and bias per group
):
    """The query folded into each key group's scales, as two int8 parts per channel."""
    n_rep = q_ref.shape[0]
    scale, zero = ks_ref[...].astype(jnp.float32), kz_ref[...].astype(jnp.float32)
    byte_shift = 8 * lax.broadcasted_iota(jnp.int32, (1, 1, 4), 2)
    round_ = lambda x: jnp.floor(x + 0.5)
    for h in range(n_rep):
        q = q_ref[h][None]  # [1, W, 4]
        qk = q * scale  # [NG, W, 4]: q_d s_gd
        amax = jnp.max(jnp.max(jnp.abs(qk), axis=2), axis=1)  # [NG]
        unit = jnp.where(amax > _TINY, amax / _Q_HI, 1.0)  # a group of ~zeros: hi = lo = 0
        u = qk * (1.0 / unit)[:, None, None]  # |u| <= 127 (to within rounding)
        hi = round_(u)
        lo = round_((u - hi) * _Q_LO)  # |u - hi| <= 1/2
        for part, x in enumerate((hi, lo)):
            q8_ref[h, :, part, :] = jnp.sum((x.astype(jnp.int32) & 0xFF) << byte_shift, axis=2)
        cb_ref[h, 0, :] = unit / _Q_LO
        cb_ref[h, 1, :] = jnp.sum(jnp.sum(q * zero, axis=2), axis=1)


def quantize_query(qs, k_scale, k_zero, *, tuning: GpuTuning, interpret: bool):
    """The scaled query folded into each key group, as two int8 parts per channel.

    qs [B, H, n_rep, D] f32, k_scale / k_zero [B, H, NG, D] ->
      q8 [B, H, n_rep, NG, 2, D // 4] int32: hi and lo of channels 4w..4w+3 in the bytes of w,
      cb [B, H, n_rep, 2, NG] f32: coef and bias, such that in every group g
      q_d s_gd = coef_g * (254 hi_gd + lo_gd) + e_gd with |e_gd| <= max_d |q_d s_gd| / 64516
      (about 16 bits, more than the bfloat16 query carries), and bias_g = sum_d q_d z_gd.
    """
    B, H, n_rep, D = qs.shape
    NG, W = k_scale.shape[2], D // 4
    blk = _pow2_divisor(NG, tuning.query_program_groups)
    params = pl.BlockSpec((None, None, blk, W, 4), lambda b, h, g: (b, h, g, 0, 0))
    q8, cb = pl.pallas_call(
        _query_kernel,
        grid=(B, H, NG // blk),
        in_specs=[
            pl.BlockSpec((None, None, n_rep, W, 4), lambda b, h, g: (b, h, 0, 0, 0)),
            params,
            params,
        ],
        out_specs=[
            pl.BlockSpec((None, None, n_rep, blk, 2, W), lambda b, h, g: (b, h, 0, g, 0, 0)),
            pl.BlockSpec((None, None, n_rep, 2, blk), lambda b, h, g: (b, h, 0, 0, g)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, n_rep, NG, 2, W), jnp.int32),
            jax.ShapeDtypeStruct((B, H, n_rep, 2, NG), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=tuning.query_warps, num_stages=1),
        interpret=interpret,
        name="kivi_query",
    )(
        qs.reshape(B, H, n_rep, W, 4),
        k_scale.reshape(B, H, NG, W, 4),
        k_zero.reshape(B, H, NG, W, 4),
    )
    return q8, cb


def _score_kernel(
    len_ref,  # []                    int32
    q8_ref,  # [NG, 2, nS, ws]         int32 the query in each group (quantize_query)
    cb_ref,  # [2, NG]                f32 coef and bias per group
    kw_ref,  # [NG, GB, nS, ws]       int32 key words: group, token byte, channel quads
    s_ref,  # out [NG, GB, 2..2]      f32 logits of token g*G + kpb*tb + j (j over the 2s)
    m_ref,  # out []                  f32 max over this program's quantized keys
    *,
    bits: int,
    group_size: int,
    residual_length: int,
    groups_per_iter: int,
    prefetch: int,
    interpret: bool,
):
    NG, GB, nS, ws = kw_ref.shape
    kpb, n1 = 8 // bits, groups_per_iter
    length = len_ref[()]
    qk_groups = (length - length % residual_length) // group_size
    g_base = pl.program_id(2) * NG
    n_tiles = jnp.clip(pl.cdiv(qk_groups - g_base, n1), 0, NG // n1)

    def first_group(k):
        """Tile k's first group. Tiles past the program's last are clamped to it: skipped, or
        (where `live` still holds because later programs have groups) recomputed and stored
        again unchanged."""
        return jnp.minimum(k, NG // n1 - 1) * n1

    def load(k):
        """Tile k: key words per slice [n1, GB, ws], the query's two parts per slice [n1, ws],
        coef and bias [n1]."""
        g = pl.ds(first_group(k), n1)
        words = tuple(kw_ref[g, :, s, :] for s in range(nS))
        q8 = tuple(tuple(q8_ref[g, part, s, :] for s in range(nS)) for part in range(2))
        return words, q8, (cb_ref[0, g], cb_ref[1, g])

    def compute(k, tile, m):
        words, q8, (coef, bias) = tile
        shape = (n1, GB, ws)
        valid = (g_base + first_group(k) + lax.broadcasted_iota(jnp.int32, (n1, 1), 0)) < qk_groups
        q8 = [[jnp.broadcast_to(x[:, None, :], shape) for x in part] for part in q8]
        sc = []
        for j in range(kpb):
            acc = [jnp.zeros(shape, jnp.int32) for _ in range(2)]  # sums of hi and lo parts
            for s in range(nS):
                x = words[s] & _field_mask(j, bits)  # c * 2**(bits*j) in every byte
                for part in range(2):
                    acc[part] = _dp4a(x, q8[part][s], acc[part], interpret=interpret)
            total = jnp.sum(acc[0] * _Q_LO + acc[1], axis=2)  # [n1, GB]
            scale = (coef * 2.0 ** (-bits * j))[:, None]
            sc.append(total.astype(jnp.float32) * scale + bias[:, None])
            m = jnp.maximum(m, jnp.where(valid, sc[j], _NEG_INIT))
        s_ref[pl.ds(first_group(k), n1)] = _stack_fields(sc)  # [n1, GB, 2, ..., 2]
        return m

    m_init = jnp.full((n1, GB), _NEG_INIT, jnp.float32)  # reduced after the loop
    live = lambda k: g_base + k * n1 < qk_groups  # k < n_tiles, or a clamped tile (above)
    m_ref[()] = jnp.max(_pipelined_loop(n_tiles, prefetch, load, compute, m_init, live))


def _value_kernel(
    len_ref,  # []                         int32
    m_ref,  # [n_rep]                      f32 global max of each query head's logits
    s_ref,  # [n_rep, C]                   f32 logits (the score kernel's output)
    vw_ref,  # [C, n_ch, wpg]              int32 value words: token, channel group, word
    vs_ref,  # [C, n_ch]                   value scale
    vz_ref,  # [C, n_ch]                   value zero point
    o_ref,  # out [n_rep, n_ch, wpg, 4, vpb] f32 sum_t p_t v_t, channel ((ch*wpg + u)*4 + r)*vpb + j
    l_ref,  # out [n_rep]                  f32 sum_t p_t
    *,
    bits: int,
    residual_length: int,
    rows: int,
    subtiles: int,
    tokens_per_split: int,
    prefetch: int,
):
    n_rep = m_ref.shape[0]
    C, n_ch, wpg = vw_ref.shape
    vpb = 8 // bits
    length = len_ref[()]
    pv = jnp.maximum(length - residual_length, 0)
    lo = pl.program_id(2) * tokens_per_split
    step = rows * subtiles
    hi = jnp.minimum(lo + tokens_per_split, pv)  # this split's quantized values: [lo, hi)
    n_tiles = jnp.clip(pl.cdiv(hi - lo, step), 0, tokens_per_split // step)
    m = [m_ref[h] for h in range(n_rep)]

    def load(k):
        """Tile k's codes, scales, zero points and logits per sub-tile (rows clamped into the
        capacity: a tile past the split is loaded from in-bounds rows, not used)."""
        tiles = []
        for sub in range(subtiles):
            t0 = jnp.minimum(lo + k * step, C - step) + sub * rows
            logits = tuple(s_ref[h, pl.ds(t0, rows)] for h in range(n_rep))
            words = vw_ref[pl.ds(t0, rows)]
            tiles.append((words, vs_ref[pl.ds(t0, rows), :], vz_ref[pl.ds(t0, rows), :], logits))
        return tuple(tiles)

    def compute(k, tile, carry):
        acc, sp, pz, ls = (list(map(list, carry[0])), *map(list, carry[1:]))
        for sub, (words, vs, vz, logits) in enumerate(tile):
            t0 = lo + k * step + sub * rows
            valid = (t0 + lax.broadcasted_iota(jnp.int32, (rows,), 0)) < hi
            aligned = [_byte_to_field(words, r) for r in range(4)]  # [rows, n_ch, wpg]
            x = [[_field(a, j, bits) for j in range(vpb)] for a in aligned]  # x[r][j]
            vs, vz = vs.astype(jnp.float32), vz.astype(jnp.float32)  # [rows, n_ch]
            for h in range(n_rep):
                p = jnp.where(valid, jnp.exp2(logits[h] - m[h]), 0.0)  # [rows]
                ps = p[:, None] * vs  # the token's value scale folded into its weight
                sp[h] = sp[h] + ps
                pz[h] = pz[h] + p[:, None] * vz
                ls[h] = ls[h] + p
                for r in range(4):
                    for j in range(vpb):
                        f = r * vpb + j  # field j of byte r
                        acc[h][f] = acc[h][f] + ps[:, :, None] * x[r][j]
        return tuple(map(tuple, acc)), tuple(sp), tuple(pz), tuple(ls)

    zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
    carry = (
        tuple(tuple(zeros(rows, n_ch, wpg) for _ in range(4 * vpb)) for _ in range(n_rep)),
        tuple(zeros(rows, n_ch) for _ in range(n_rep)),
        tuple(zeros(rows, n_ch) for _ in range(n_rep)),
        tuple(zeros(rows) for _ in range(n_rep)),
    )
    live = lambda k: lo + k * step < hi  # k < n_tiles
    acc, sp, pz, ls = _pipelined_loop(n_tiles, prefetch, load, compute, carry, live)
    for h in range(n_rep):
        sp_h = jnp.sum(sp[h], axis=0)[:, None]  # [n_ch, 1]
        pz_h = jnp.sum(pz[h], axis=0)[:, None]
        for r in range(4):
            for j in range(vpb):
                a = jnp.sum(acc[h][r * vpb + j], axis=0)  # [n_ch, wpg]
                o_ref[h, :, :, r, j] = _field_weight(j, bits) * (a - sp_h) + pz_h
        l_ref[h] = jnp.sum(ls[h])


def key_scores(qs, k_codes, k_scale, k_zero, lengths, *, bits, group_size, residual_length,
               tuning, interpret):  # fmt: skip
    """The score kernel. qs [B, H, n_rep, D] f32 (scaled queries) -> logits [B, H, n_rep, C]
    of the quantized keys (defined for t < Qk) and each program's max [B, H, n_rep, P]."""
    B, H, n_rep, D = qs.shape
    G, kpb = group_size, 8 // bits
    C = k_codes.shape[2] * kpb
    GB, W = G // kpb, D // 4  # token bytes per key group, words per token byte
    NG, n1, nS = score_tiles(tuning, capacity=C, group_size=G, head_dim=D, k_bits=bits)
    ws = W // nS  # words per slice of a key row
    P = C // G // NG
    twos = (2,) * (kpb.bit_length() - 1)  # kpb = 2 * ... * 2, see _stack_fields
    zeros = (0,) * len(twos)
    q8, cb = quantize_query(qs, k_scale, k_zero, tuning=tuning, interpret=interpret)
    Hq = H * n_rep
    scores, block_max = pl.pallas_call(
        functools.partial(
            _score_kernel,
            bits=bits,
            group_size=G,
            residual_length=residual_length,
            groups_per_iter=n1,
            prefetch=tuning.prefetch,
            interpret=interpret,
        ),
        grid=(B, Hq, P),  # query heads of one KV head read the same key words (through L2)
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, p: (b,)),
            pl.BlockSpec((None, None, NG, 2, nS, ws), lambda b, h, p: (b, h, p, 0, 0, 0)),
            pl.BlockSpec((None, None, 2, NG), lambda b, h, p: (b, h, 0, p)),
            pl.BlockSpec((None, None, NG, GB, nS, ws), lambda b, h, p: (b, h // n_rep, p, 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, NG, GB, *twos), lambda b, h, p: (b, h, p, 0, *zeros)),
            pl.BlockSpec((None, None, None), lambda b, h, p: (b, h, p)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hq, C // G, GB, *twos), jnp.float32),
            jax.ShapeDtypeStruct((B, Hq, P), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=tuning.score_warps, num_stages=tuning.num_stages
        ),
        interpret=interpret,
        name="kivi_scores",
    )(
        lengths,
        q8.reshape(B, Hq, C // G, 2, nS, ws),
        cb.reshape(B, Hq, 2, C // G),
        _words(k_codes).reshape(B, H, C // G, GB, nS, ws),
    )
    return scores.reshape(B, H, n_rep, C), block_max.reshape(B, H, n_rep, P)


def weighted_values(m, scores, v_codes, v_scale, v_zero, lengths, *, bits, group_size,
                    residual_length, tuning, interpret):  # fmt: skip
    """The value kernel. m [B, H, n_rep] (max logit per row), scores [B, H, n_rep, C] ->
    unnormalised sum_t 2**(s_t - m) v_t [B, H, S, n_rep, D] and sum_t 2**(s_t - m)
    [B, H, S, n_rep] over the quantized values, per token split."""
    B, H, n_rep, C = scores.shape
    D = v_codes.shape[3] * (8 // bits)
    G, vpb = group_size, 8 // bits
    n_ch, wpg = D // G, G // vpb // 4  # channel groups, words per group and token
    rows, subtiles = value_tiles(tuning, capacity=C, n_rep=n_rep)
    step = rows * subtiles
    n_steps = C // step
    if tuning.num_splits is not None:
        S = max(1, min(tuning.num_splits, n_steps))
    else:
        S = max(1, min(n_steps, pl.cdiv(tuning.target_programs, B * H)))
    steps_per_split = pl.cdiv(n_steps, S)
    S = pl.cdiv(n_steps, steps_per_split)
    o, l_sum = pl.pallas_call(
        functools.partial(
            _value_kernel,
            bits=bits,
            residual_length=residual_length,
            rows=rows,
            subtiles=subtiles,
            tokens_per_split=steps_per_split * step,
            prefetch=tuning.prefetch,
        ),
        grid=(B, H, S),
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, None, n_rep), lambda b, h, s: (b, h, 0)),
            pl.BlockSpec((None, None, n_rep, C), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, C, n_ch, wpg), lambda b, h, s: (b, h, 0, 0, 0)),
            pl.BlockSpec((None, None, C, n_ch), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, C, n_ch), lambda b, h, s: (b, h, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec(
                (None, None, None, n_rep, n_ch, wpg, 4, vpb),
                lambda b, h, s: (b, h, s, 0, 0, 0, 0, 0),
            ),
            pl.BlockSpec((None, None, None, n_rep), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, S, n_rep, n_ch, wpg, 4, vpb), jnp.float32),
            jax.ShapeDtypeStruct((B, H, S, n_rep), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=tuning.value_warps, num_stages=tuning.num_stages
        ),
        interpret=interpret,
        name="kivi_values",
    )(lengths, m, scores, _words(v_codes).reshape(B, H, C, n_ch, wpg), v_scale, v_zero)
    return o.reshape(B, H, S, n_rep, D), l_sum


@functools.partial(
    jax.jit,
    static_argnames=(
        "k_bits",
        "v_bits",
        "group_size",
        "residual_length",
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
    *,
    k_bits: int,
    v_bits: int,
    group_size: int,
    residual_length: int,
    sm_scale: float | None = None,
    tuning: GpuTuning = GpuTuning(),
    interpret: bool = False,
):
    """Decode attention over a KIVI state with the CUDA-core kernels -> [B, Hq, D]."""
    B, Hq, D = q.shape
    _, H, C, _ = v_codes.shape
    G, R = group_size, residual_length
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
    scale = (1.0 / math.sqrt(D) if sm_scale is None else sm_scale) * _LOG2E
    qs = q.astype(jnp.float32).reshape(B, H, n_rep, D) * scale
    common = dict(group_size=G, residual_length=R, tuning=tuning, interpret=interpret)
    scores, block_max = key_scores(qs, k_codes, k_scale, k_zero, lengths, bits=k_bits, **common)

    # The tail: the R tokens [Pv, Pv + R), token t at ring slot t % R.
    length = lengths[:, None]  # [B, 1]
    qk, pv = length - length % R, jnp.maximum(length - R, 0)
    tok = pv + (jnp.arange(R)[None, :] - pv) % R  # [B, R] the token at each slot
    held = (tok < length)[:, None, None, :]  # [B, 1, 1, R]
    hi = lax.Precision.HIGHEST
    s_res = jnp.einsum("bhrd,bhsd->bhrs", qs, k_residual.astype(jnp.float32), precision=hi)
    s_quant = jnp.take_along_axis(scores, jnp.minimum(tok, C - 1)[:, None, None, :], axis=-1)
    s_tail = jnp.where((tok < qk)[:, None, None, :], s_quant, s_res)
    s_tail = jnp.where(held, s_tail, -jnp.inf)
    m = jnp.maximum(jnp.max(block_max, axis=-1), jnp.max(s_tail, axis=-1))  # [B, H, n_rep]

    o, l_sum = weighted_values(m, scores, v_codes, v_scale, v_zero, lengths, bits=v_bits, **common)
    p_tail = jnp.where(held, jnp.exp2(s_tail - m[..., None]), 0.0)  # [B, H, n_rep, R]
    o_tail = jnp.einsum("bhrs,bhsd->bhrd", p_tail, v_residual.astype(jnp.float32), precision=hi)
    num = jnp.sum(o, axis=2) + o_tail
    den = (jnp.sum(l_sum, axis=2) + jnp.sum(p_tail, axis=-1))[..., None]
    out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)  # length 0 -> zeros
    return out.reshape(B, Hq, D).astype(q.dtype)


def unsupported_reason(q: jax.Array, cache) -> str | None:
    """None if `decode_attention_pallas(q, cache)` runs, else what it does not support."""
    from kivi_jax.cache import KiviCache  # the state layout lives in kivi_jax

    if not isinstance(cache, KiviCache):
        return f"the fused kernel reads a KiviCache, not a {type(cache).__name__}"
    cfg = cache.config
    return supported_config_reason(
        k_bits=cfg.k_bits,
        v_bits=cfg.v_bits,
        group_size=cfg.group_size,
        head_dim=q.shape[-1],
        dtype=q.dtype,
    )


def decode_attention_pallas(
    q: jax.Array, cache, *, interpret: bool = False, tuning: GpuTuning = GpuTuning()
) -> jax.Array:
    """The kernels over one layer's KiviCache: q [B, Hq, D] -> [B, Hq, D] in q's dtype."""
    reason = unsupported_reason(q, cache)
    if reason is not None:
        raise NotImplementedError(f"impl='pallas': {reason}")
    cfg = cache.config
    return kivi_decode_attention_gpu(
        q,
        cache.k_codes,
        cache.k_scale,
        cache.k_zero,
        cache.v_codes,
        cache.v_scale,
        cache.v_zero,
        cache.k_residual,
        cache.v_residual,
        cache.lengths,
        k_bits=cfg.k_bits,
        v_bits=cfg.v_bits,
        group_size=cfg.group_size,
        residual_length=cfg.residual_length,
        tuning=tuning,
        interpret=interpret,
    )
