"""Fused KIVI decode attention for GPUs: a Pallas kernel with the Triton lowering.

One decode step: for each sequence ``b`` and query head ``h`` (KV head ``h // n_rep``)

    out[b, h] = softmax_t(q[b, h] . K_t / sqrt(D)) @ V   over t in [0, lengths[b])

read straight from the packed KIVI state (layout: ``kivi_jax.cache``). Nothing is dequantized
to HBM: every byte of codes, scales, zero points and residual is read once, inside the kernel.

Grid ``(B, H, S)``: one program per sequence, KV head and token split (flash-decoding). A
program holds the ``n_rep`` query heads of its KV head as the rows of one tile (zero-padded to
``block_h >= 16`` rows, the smallest tensor-core operand: GQA groups share every byte read),
walks its token range in blocks of ``block_t = n_groups * G`` tokens with an online softmax
(base 2, ``log2(e) / sqrt(D)`` folded into q), and writes an unnormalised partial output with
its running max and sum; ``_merge`` combines the ``S`` partials by log-sum-exp (a few small
XLA ops). ``S`` is chosen so that ``B * H * S`` is about 4 programs per SM, so batch 1 at long
context fills the GPU.

Each sequence has three token regions (``l = lengths[b]``, ``R`` the residual length):

* ``[0, Pv)``, ``Pv = max(l - R, 0)``: quantized keys and values. Blocks wholly inside run the
  *fast path* (no masks, no residual).
* ``[Pv, Qk)``, ``Qk = l - l % R``: quantized keys, full-precision values (value residual).
* ``[Qk, l)``: both in the residual.

Blocks that touch ``[Pv, l)`` (at most ``(R + block_t) / block_t`` of them per sequence) run
the *general path*: keys dequantized or read from ``k_residual`` (a block never straddles
``Qk``, because ``block_t`` divides ``R``), values chosen per token between the dequantized
codes and ``v_residual`` (token ``t`` at ring slot ``t % R``), tokens ``>= l`` masked out (and
their values zeroed, so stale slots cannot inject NaN). Length-0 sequences give zeros.

Two tilings (``GpuTuning.tile``), identical results up to rounding:

* ``"block"`` (default, fastest measured): per iteration one key tile ``K^T [D, block_t]`` and
  one value tile ``V [block_t, D]`` dequantized per value, then one tensor-core dot for
  ``q . K^T`` and one for ``p . V`` (fp32 accumulation). A code becomes the float32
  ``128 + c`` with a shift and two logic ops on its bits (``c << 16 | 0x43000000``: no int to
  float conversion), and the value is ``(128 + c) * s + (z - 128 s)``, one FMA, with
  ``z - 128 s`` formed on the small scale tiles. The fields of each byte are interleaved along
  the tile's last axis with 2-way joins (keys are unpacked transposed, so their packed axis,
  tokens, is the last one) and the group scales are repeated along it the same way; this keeps
  several contiguous elements per thread (a 3-D broadcast + reshape left one element per
  thread and 16-bit shared-memory traffic: 12.6 against 9.3 SASS instructions per value).
* ``"group"``: sub-tiles of G tokens (keys) and G x G (values), with ``k_mode`` / ``v_mode``:
  ``"fold"`` folds the key scale into the query (``q . k_t = sum_d (q_d s_gd) c_td +
  sum_d q_d z_gd``, one ``[block_h, D]`` product per G tokens) and the value scale into the
  probabilities (``sum_t (p_t s_tj) c_td + sum_t p_t z_tj``), with codes fed to the tensor
  cores as ``c | 0x4300`` read as bfloat16 (exactly ``128 + c``; ``0x6400`` / 1024 for
  float16) and the constant removed in a per-row bias computed from the same rounded operand;
  ``"dequant"`` dequantizes per value. On the H200 the folds cost more than they save: the
  per-group row reductions and broadcasts turn into warp shuffles and shared-memory layout
  conversions (docs/performance.md has the numbers).

Supported: k_bits, v_bits in {2, 4}; G a power of two >= 16 dividing D; D in {64, 128};
bfloat16 or float16 queries. ``supported_config_reason`` names what is not.
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
# Bit pattern that, OR-ed with a small unsigned integer c and read as the float dtype, gives
# MAGIC + c exactly (bfloat16: exponent 2^7 and 7 mantissa bits, so c < 128; float16: 2^10).
_MAGIC_BITS = {jnp.dtype(jnp.bfloat16): (0x4300, 128.0), jnp.dtype(jnp.float16): (0x6400, 1024.0)}
_NEG_INIT = -1e30  # running-max start: finite, so empty splits merge without inf - inf.


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuTuning:
    """Tuning knobs (no effect on results).

    n_groups: key groups (of G tokens) per loop iteration; block_t = n_groups * G tokens.
      Lowered to a power of two dividing gcd(R, C) / G when needed.
    num_splits: token splits per (sequence, KV head); None picks enough programs to fill the GPU.
    target_programs: programs aimed for when num_splits is None (132 SMs on an H200).

    The defaults are the fastest of the H200 sweeps in benchmarks/results (tile="block" with
    n_groups=1, num_warps=4 and with n_groups=2, num_warps=8 tie within 2%; the former is the
    one the GPU test grid ran).
    """

    n_groups: int = 1
    num_splits: int | None = None
    target_programs: int = 4 * 132
    num_warps: int = 4
    num_stages: int = 2
    # "block": whole [block_t, D] tiles dequantized per value, one dot each (module doc);
    # "group": G-token / G x G sub-tiles, where k_mode and v_mode apply.
    tile: str = "block"
    k_mode: str = "fold"  # "fold": key scale into the query; "dequant": per value
    v_mode: str = "fold"  # "fold" / "lazy" (zero-point sums deferred) / "dequant": per value


def supported_config_reason(
    *, k_bits: int, v_bits: int, group_size: int, head_dim: int, dtype
) -> str | None:
    """None if the GPU kernel supports this configuration, else a sentence saying why not."""
    if k_bits not in (2, 4) or v_bits not in (2, 4):
        return f"k_bits={k_bits}, v_bits={v_bits}: the GPU kernel supports 2 and 4 bits"
    if group_size < 16 or group_size & (group_size - 1):
        return f"group_size={group_size}: the GPU kernel needs a power of two >= 16"
    if head_dim not in (64, 128):
        return f"head_dim={head_dim}: the GPU kernel supports 64 and 128"
    if head_dim % group_size:
        return f"group_size={group_size} does not divide head_dim={head_dim}"
    if jnp.dtype(dtype) not in _MAGIC_BITS:
        return f"dtype {jnp.dtype(dtype)}: the GPU kernel supports bfloat16 and float16"
    return None


def _pow2_floor(x: int) -> int:
    return 1 << (max(x, 1).bit_length() - 1)


def _unpack_rows(byte_tile, bits: int):
    """uint8 [r, n] -> int32 [r * per, n]; row i*per + j = bits [bits*j, +bits) of byte row i."""
    per = 8 // bits
    r, n = byte_tile.shape
    x = byte_tile.astype(jnp.int32)
    x = jnp.broadcast_to(x[:, None, :], (r, per, n))
    shift = lax.broadcasted_iota(jnp.int32, (r, per, n), 1) * bits
    c = lax.shift_right_logical(x, shift) & ((1 << bits) - 1)
    return c.reshape(r * per, n)


def _unpack_cols(byte_tile, bits: int):
    """uint8 [r, n] -> int32 [r, n * per]; column m*per + j = bits [bits*j, +bits) of byte m."""
    per = 8 // bits
    r, n = byte_tile.shape
    x = byte_tile.astype(jnp.int32)
    x = jnp.broadcast_to(x[:, :, None], (r, n, per))
    shift = lax.broadcasted_iota(jnp.int32, (r, n, per), 2) * bits
    c = lax.shift_right_logical(x, shift) & ((1 << bits) - 1)
    return c.reshape(r, n * per)


def _interleave_last(fields):
    """[f0, ..., f_{n-1}] (n a power of two), each [.., m] -> [.., m * n], element k*n + j = f_j[k].

    Nested 2-way stacks (Triton joins): stack(stack(f0, f2), stack(f1, f3)) is [.., 2, 2] whose
    flattened index 2a + b holds f_{2a + b}. Joins keep each thread's elements contiguous.
    """
    shape = fields[0].shape
    while len(fields) > 1:
        half = len(fields) // 2
        fields = [jnp.stack([fields[i], fields[i + half]], axis=-1) for i in range(half)]
    out = fields[0]
    return out.reshape(*shape[:-1], math.prod(out.shape[len(shape) - 1 :]))


def _repeat_last(x, times: int):
    """[.., m] -> [.., m * times], each element repeated `times` times (a power of two)."""
    while times > 1:
        x = _interleave_last([x, x])
        times //= 2
    return x


def _magic_fields(x, bits: int):
    """int32 bytes -> the 8 // bits float32 fields 128 + c (two integer ops each, no I2F)."""
    return [
        lax.bitcast_convert_type(
            (lax.shift_left(x, 16 - bits * j) & (((1 << bits) - 1) << 16)) | 0x43000000,
            jnp.float32,
        )
        for j in range(8 // bits)
    ]


def _unpack_rows_t_f32(byte_tile, bits: int):
    """uint8 [r, n] (fields along rows) -> float32 [n, r * per] = 128 + code, transposed:
    column i*per + j holds field j of byte row i."""
    return _interleave_last(_magic_fields(byte_tile.T.astype(jnp.int32), bits))


def _unpack_cols_f32(byte_tile, bits: int):
    """uint8 [r, n] -> float32 [r, n * per] holding 128 + code (column order as _unpack_cols)."""
    return _interleave_last(_magic_fields(byte_tile.astype(jnp.int32), bits))


def _as_magic_float(codes, dtype):
    """int32 codes (< 128) -> dtype holding MAGIC + code exactly: one OR, no int->float convert."""
    bits, _ = _MAGIC_BITS[jnp.dtype(dtype)]
    return lax.bitcast_convert_type(codes.astype(jnp.int16) | jnp.int16(bits), dtype)


def _dot(a, b_t):
    """a [m, k] @ b_t[n, k]^T with fp32 accumulation."""
    return lax.dot_general(a, b_t, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
    """a [m, k] @ b [k, n] with fp32 accumulation."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(
    len_ref,  # [] int32
    q_ref,  # [block_h, D]     query rows of this KV head, pre-scaled by log2(e)/sqrt(D)
    kc_ref,  # [C // kpb, D]   uint8
    ks_ref,  # [C // G, D]
    kz_ref,  # [C // G, D]
    vc_ref,  # [C, D // vpb]   uint8
    vs_ref,  # [C, D // G]
    vz_ref,  # [C, D // G]
    kr_ref,  # [R, D]
    vr_ref,  # [R, D]
    o_ref,  # out [block_h, D] f32, unnormalised
    m_ref,  # out [block_h]    f32, running max (base 2)
    l_ref,  # out [block_h]    f32, running sum
    *,
    k_bits: int,
    v_bits: int,
    group_size: int,
    residual_length: int,
    n_groups: int,
    blocks_per_split: int,
    dtype,
    k_mode: str,
    v_mode: str,
    tile: str,
    ablate: str,
):
    G, R = group_size, residual_length
    kpb, vpb = 8 // k_bits, 8 // v_bits
    block_t = n_groups * G
    block_h, D = q_ref.shape
    n_ch = D // G  # value channel groups
    _, magic = _MAGIC_BITS[jnp.dtype(dtype)]

    length = len_ref[()]
    qk_end = length - length % R  # keys [0, qk_end) quantized
    pv_end = jnp.maximum(length - R, 0)  # values [0, pv_end) quantized
    split = pl.program_id(2)
    blk_lo = split * blocks_per_split
    blk_hi = jnp.minimum(blk_lo + blocks_per_split, pl.cdiv(length, block_t))
    n_fast = pv_end // block_t  # blocks with both K and V quantized

    q = q_ref[...].astype(jnp.float32)  # [block_h, D]
    q_lo = q.astype(dtype)

    def softmax_update(carry, scores, values_fn):
        """scores: list of [block_h, G] (base-2 logits); values_fn(p_list) -> list of n_ch
        [block_h, G] contributions."""
        m_prev, l_prev, acc = carry
        m_blk = functools.reduce(jnp.maximum, [jnp.max(s, axis=1) for s in scores])
        m_new = jnp.maximum(m_prev, m_blk)
        alpha = jnp.exp2(m_prev - m_new)
        p = [jnp.exp2(s - m_new[:, None]) for s in scores]
        l_new = l_prev * alpha + functools.reduce(jnp.add, [jnp.sum(pi, axis=1) for pi in p])
        contrib = values_fn(p)
        acc = tuple(a * alpha[:, None] + c for a, c in zip(acc, contrib, strict=True))
        return m_new, l_new, acc

    if tile == "block":
        _block_loops(
            q, length, qk_end, pv_end, blk_lo, blk_hi, n_fast,
            kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, kr_ref, vr_ref, o_ref, m_ref, l_ref,
            k_bits=k_bits, v_bits=v_bits, G=G, R=R, n_groups=n_groups, dtype=dtype,
        )  # fmt: skip
        return

    lazy = v_mode == "lazy"

    def fast_body(blk, carry):
        t0 = blk * block_t
        scores = []
        for i in range(n_groups):
            tg = t0 + i * G  # first token of this key group (a multiple of G)
            g = tg // G
            if ablate == "no_keys":
                scores.append(jnp.zeros((block_h, G), jnp.float32))
                continue
            codes = _unpack_rows(kc_ref[pl.ds(tg // kpb, G // kpb), :], k_bits)  # [G, D]
            s = ks_ref[pl.ds(g, 1), :].astype(jnp.float32)  # [1, D]
            z = kz_ref[pl.ds(g, 1), :].astype(jnp.float32)
            if k_mode == "fold":
                k_op = _as_magic_float(codes, dtype)  # magic + c
                qs = (q * s).astype(dtype)  # key scale folded into the query
                bias = jnp.sum(q * z, axis=1) - magic * jnp.sum(qs.astype(jnp.float32), axis=1)
                scores.append(_dot(qs, k_op) + bias[:, None])  # [block_h, G]
            else:  # dequantize every value
                k = (codes.astype(jnp.float32) * s + z).astype(dtype)
                scores.append(_dot(q_lo, k))

        def values(p):
            out, pz, pss = [], [], []
            for j in range(n_ch):
                o_j = jnp.zeros((block_h, G), jnp.float32)
                pz_j = jnp.zeros((block_h, G), jnp.float32)
                pss_j = jnp.zeros((block_h, G), jnp.float32)
                for i in range(n_groups):
                    if ablate == "no_values":
                        o_j = o_j + p[i]
                        continue
                    tg = t0 + i * G
                    vb = vc_ref[pl.ds(tg, G), pl.ds(j * (G // vpb), G // vpb)]  # [G, G/vpb]
                    codes = _unpack_cols(vb, v_bits)  # [G tok, G ch]
                    if v_mode == "dequant":
                        vs = vs_ref[pl.ds(tg, G), pl.ds(j, 1)].astype(jnp.float32)  # [G, 1]
                        vz = vz_ref[pl.ds(tg, G), pl.ds(j, 1)].astype(jnp.float32)
                        v = (codes.astype(jnp.float32) * vs + vz).astype(dtype)
                        o_j = o_j + _dot_nn(p[i].astype(dtype), v)
                        continue
                    v_op = _as_magic_float(codes, dtype)
                    vs = vs_ref[pl.ds(tg, G), j].astype(jnp.float32)  # [G]
                    vz = vz_ref[pl.ds(tg, G), j].astype(jnp.float32)
                    ps = (p[i] * vs[None, :]).astype(dtype)  # value scale folded into p
                    o_j = o_j + _dot_nn(ps, v_op)
                    if lazy:  # corrections summed over tokens once, at the end
                        pz_j = pz_j + p[i] * vz[None, :]
                        pss_j = pss_j + ps.astype(jnp.float32)
                    else:
                        corr = jnp.sum(p[i] * vz[None, :], axis=1) - magic * jnp.sum(
                            ps.astype(jnp.float32), axis=1
                        )
                        o_j = o_j + corr[:, None]
                out.append(o_j)
                pz.append(pz_j)
                pss.append(pss_j)
            return out + (pz + pss if lazy else [])

        return softmax_update(carry, scores, values)

    def general_body(blk, carry):
        t0 = blk * block_t
        k_quant = t0 < qk_end  # blocks never straddle qk_end (block_t divides R)
        scores, toks = [], []
        for i in range(n_groups):
            tg = t0 + i * G
            t = tg + lax.broadcasted_iota(jnp.int32, (1, G), 1)  # [1, G]
            codes = _unpack_rows(kc_ref[pl.ds(tg // kpb, G // kpb), :], k_bits)
            s = ks_ref[pl.ds(tg // G, 1), :].astype(jnp.float32)
            z = kz_ref[pl.ds(tg // G, 1), :].astype(jnp.float32)
            k_deq = codes.astype(jnp.float32) * s + z  # [G, D]
            k_res = kr_ref[pl.ds(tg % R, G), :].astype(jnp.float32)
            k = jnp.where(k_quant, k_deq, k_res).astype(dtype)
            sc = _dot(q_lo, k)
            scores.append(jnp.where(t < length, sc, -jnp.inf))
            toks.append(t)

        def values(p):
            out = []
            for j in range(n_ch):
                o_j = jnp.zeros((block_h, G), jnp.float32)
                for i in range(n_groups):
                    tg = t0 + i * G
                    t = toks[i].reshape(G, 1)
                    vb = vc_ref[pl.ds(tg, G), pl.ds(j * (G // vpb), G // vpb)]
                    codes = _unpack_cols(vb, v_bits).astype(jnp.float32)  # [G tok, G ch]
                    vs = vs_ref[pl.ds(tg, G), pl.ds(j, 1)].astype(jnp.float32)  # [G, 1]
                    vz = vz_ref[pl.ds(tg, G), pl.ds(j, 1)].astype(jnp.float32)
                    v_res = vr_ref[pl.ds(tg % R, G), pl.ds(j * G, G)].astype(jnp.float32)
                    v = jnp.where(t < pv_end, codes * vs + vz, v_res)
                    v = jnp.where(t < length, v, 0.0).astype(dtype)  # stale slots may hold junk
                    o_j = o_j + _dot_nn(p[i].astype(dtype), v)
                out.append(o_j)
            return out + ([jnp.zeros((block_h, G), jnp.float32)] * (2 * n_ch) if lazy else [])

        return softmax_update(carry, scores, values)

    carry = (
        jnp.full((block_h,), _NEG_INIT, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        tuple(jnp.zeros((block_h, G), jnp.float32) for _ in range(n_ch * (3 if lazy else 1))),
    )
    carry = lax.fori_loop(blk_lo, jnp.minimum(blk_hi, n_fast), fast_body, carry)
    carry = lax.fori_loop(jnp.maximum(blk_lo, n_fast), blk_hi, general_body, carry)
    m, l_sum, acc = carry
    for j in range(n_ch):
        o_j = acc[j]
        if lazy:
            pz_j, pss_j = acc[n_ch + j], acc[2 * n_ch + j]
            o_j = o_j + (jnp.sum(pz_j, axis=1) - magic * jnp.sum(pss_j, axis=1))[:, None]
        o_ref[:, pl.ds(j * G, G)] = o_j
    m_ref[...] = m
    l_ref[...] = l_sum


def _block_loops(
    q, length, qk_end, pv_end, blk_lo, blk_hi, n_fast,
    kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, kr_ref, vr_ref, o_ref, m_ref, l_ref,
    *, k_bits, v_bits, G, R, n_groups, dtype,
):  # fmt: skip
    """tile="block": each iteration dequantizes a whole key tile K^T [D, block_t] and value
    tile V [block_t, D], then one tensor-core dot for q.K^T and one for p.V.

    A value is (128 + c) * s + (z - 128 s): the float32 128 + c comes from a shift and two
    logic ops on the code's bits (_magic_fields, no int->float conversion), (z - 128 s) is
    formed on the small scale tiles, one FMA per value. The fields of a byte are interleaved
    along the last axis with 2-way joins (keys are unpacked transposed so that their packed axis,
    tokens, is the last one), and group scales are repeated along it the same way: no 3-D
    broadcast + reshape, so Triton keeps several contiguous elements per thread.
    """
    kpb = 8 // k_bits
    block_t = n_groups * G
    block_h, D = q.shape
    n_ch = D // G
    q_lo = q.astype(dtype)

    def keys_t(t0):  # K^T [D, block_t], float32
        s = ks_ref[pl.ds(t0 // G, n_groups), :].astype(jnp.float32).T  # [D, n_groups]
        z = kz_ref[pl.ds(t0 // G, n_groups), :].astype(jnp.float32).T
        z = z - 128.0 * s
        if n_groups == 1:
            s, z = jnp.broadcast_to(s, (D, block_t)), jnp.broadcast_to(z, (D, block_t))
        else:
            s, z = _repeat_last(s, G), _repeat_last(z, G)
        c = _unpack_rows_t_f32(kc_ref[pl.ds(t0 // kpb, block_t // kpb), :], k_bits)
        return c * s + z

    def values(t0):  # V [block_t, D], float32
        s = vs_ref[pl.ds(t0, block_t), :].astype(jnp.float32)  # [block_t, n_ch]
        z = vz_ref[pl.ds(t0, block_t), :].astype(jnp.float32)
        z = z - 128.0 * s
        if n_ch == 1:
            s, z = jnp.broadcast_to(s, (block_t, D)), jnp.broadcast_to(z, (block_t, D))
        else:
            s, z = _repeat_last(s, G), _repeat_last(z, G)
        c = _unpack_cols_f32(vc_ref[pl.ds(t0, block_t), :], v_bits)  # [block_t, D]
        return c * s + z

    def update(carry, scores, v):
        m_prev, l_prev, acc = carry
        m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.exp2(scores - m_new[:, None])
        l_new = l_prev * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot_nn(p.astype(dtype), v.astype(dtype))
        return m_new, l_new, acc

    def fast_body(blk, carry):
        t0 = blk * block_t
        scores = _dot_nn(q_lo, keys_t(t0).astype(dtype))  # [block_h, block_t]
        return update(carry, scores, values(t0))

    def general_body(blk, carry):
        t0 = blk * block_t
        t_row = t0 + lax.broadcasted_iota(jnp.int32, (1, block_t), 1)
        t_col = t0 + lax.broadcasted_iota(jnp.int32, (block_t, 1), 0)
        k_res = kr_ref[pl.ds(t0 % R, block_t), :].astype(jnp.float32).T
        k_t = jnp.where(t0 < qk_end, keys_t(t0), k_res)  # blocks never straddle qk_end
        scores = jnp.where(t_row < length, _dot_nn(q_lo, k_t.astype(dtype)), -jnp.inf)
        v_res = vr_ref[pl.ds(t0 % R, block_t), :].astype(jnp.float32)
        v = jnp.where(t_col < pv_end, values(t0), v_res)
        v = jnp.where(t_col < length, v, 0.0)  # stale slots may hold anything
        return update(carry, scores, v)

    carry = (
        jnp.full((block_h,), _NEG_INIT, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        jnp.zeros((block_h, D), jnp.float32),
    )
    carry = lax.fori_loop(blk_lo, jnp.minimum(blk_hi, n_fast), fast_body, carry)
    carry = lax.fori_loop(jnp.maximum(blk_lo, n_fast), blk_hi, general_body, carry)
    m, l_sum, acc = carry
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l_sum


def _merge(o, m, l_sum, n_rep: int, out_dtype):
    """Log-sum-exp merge of the splits. o [B, H, S, bh, D], m and l [B, H, S, bh] (base 2)."""
    o, m, l_sum = o[:, :, :, :n_rep], m[:, :, :, :n_rep], l_sum[:, :, :, :n_rep]
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - m_max)  # [B, H, S, n_rep]
    num = jnp.sum(o * w[..., None], axis=2)  # [B, H, n_rep, D]
    den = jnp.sum(l_sum * w, axis=2)[..., None]
    out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)  # length 0 -> zeros
    b, h = out.shape[:2]
    return out.reshape(b, h * n_rep, -1).astype(out_dtype)


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
        "_ablate",
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
    _ablate: str = "",
):
    """Decode attention over a KIVI state with the fused Pallas-Triton kernel -> [B, Hq, D].

    `_ablate` ("no_keys" / "no_values") drops one side of the fast path; for timing only.
    """
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
    block_h = max(16, pl.next_power_of_2(n_rep))
    n_groups = min(_pow2_floor(tuning.n_groups), _pow2_floor(math.gcd(R, C) // G))
    while (R // G) % n_groups or (C // G) % n_groups:
        n_groups //= 2
    block_t = n_groups * G
    n_blocks = C // block_t
    if tuning.num_splits is not None:
        num_splits = max(1, min(tuning.num_splits, n_blocks))
    else:
        num_splits = max(1, min(n_blocks, pl.cdiv(tuning.target_programs, B * H)))
    blocks_per_split = pl.cdiv(n_blocks, num_splits)
    num_splits = pl.cdiv(n_blocks, blocks_per_split)

    scale = (1.0 / math.sqrt(D) if sm_scale is None else sm_scale) * _LOG2E
    qh = (q.astype(jnp.float32) * scale).astype(q.dtype).reshape(B, H, n_rep, D)
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, block_h - n_rep), (0, 0)))  # [B, H, block_h, D]

    kernel = functools.partial(
        _kernel,
        k_bits=k_bits,
        v_bits=v_bits,
        group_size=G,
        residual_length=R,
        n_groups=n_groups,
        blocks_per_split=blocks_per_split,
        dtype=q.dtype,
        k_mode=tuning.k_mode,
        v_mode=tuning.v_mode,
        tile=tuning.tile,
        ablate=_ablate,
    )

    def whole(x):  # the (b, h) slice of a [B, H, ...] array
        zeros = (0,) * (x.ndim - 2)
        return pl.BlockSpec((None, None, *x.shape[2:]), lambda b, h, s: (b, h, *zeros))

    state = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual, v_residual)
    o, m, l_sum = pl.pallas_call(
        kernel,
        grid=(B, H, num_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, None, block_h, D), lambda b, h, s: (b, h, 0, 0)),
            *[whole(x) for x in state],
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_h, D), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, num_splits, block_h, D), jnp.float32),
            jax.ShapeDtypeStruct((B, H, num_splits, block_h), jnp.float32),
            jax.ShapeDtypeStruct((B, H, num_splits, block_h), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=tuning.num_warps, num_stages=tuning.num_stages
        ),
        interpret=interpret,
        name="kivi_decode_attention",
    )(lengths.astype(jnp.int32), qh, *state)
    return _merge(o, m, l_sum, n_rep, q.dtype)


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
    """The fused kernel over one layer's KiviCache: q [B, Hq, D] -> [B, Hq, D] in q's dtype."""
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
