"""KIVI decode attention for query groups on tensor cores: one fused kernel (Pallas, Triton).

With GQA, n_rep query heads share each KV head. Here one program takes a KV head's whole
query group, so each key and value code is loaded and unpacked once for all n_rep heads, and
the multiply-accumulates run as `dot`s (tensor-core MMAs) whose rows are the group's queries,
padded to M = max(16, n_rep) rows (the MMA's smallest; padded rows are zeros and dropped).

Each tile's codes are dequantized once (k = s_d c + z_d per key group, v = s_t c + z_t per
value channel group, in float32, rounded to the query's dtype as a bfloat16/float16 cache is)
and enter the MMAs, which accumulate in float32.

Measured (H200, jax 0.11.2, Llama-3-8B heads, 8 x 32k, the same process): KIVI-2 797-863 us
and KIVI-4 687-732 us against cuDNN's 241 and the CUDA-core kernels' 228 and 271: 3.5x
slower than the path it was to replace. 9.3 SASS instructions per code in the main loop
(I2FP, FFMA and F2FP per element, ~2 integer ops to unpack, the operands staged through
shared memory with barriers); an earlier form that folded the scales into the queries and
probabilities (codes OR'ed into the bits of 2**7) took 18.4 and ran 943-1105 us, its
per-group bias sums costing shuffles. Not used by `impl="pallas"`; docs/history.md.

One program per (sequence, KV head, token split) runs flash decoding over tiles of T tokens
(`GqaTuning.tile_groups` key groups): the split's tiles of the region where keys and values
are both quantized, [0, V1) with V1 = T floor(Pv / T), then its share of the tail tiles
[V1, l), where a token's key comes from the codes (t < Qk) or the key ring, its value from the
codes (t < Pv) or the value ring (ring slot t % R: a tile's slots are contiguous, T divides R).
Each program leaves its max, sum of weights and weighted values; XLA merges the splits.
Token regions as in `kivi_jax.cache` and `gpu` (Qk = l - l % R, Pv = max(l - R, 0)).
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
from kivi_jax.pallas_kernels.decode_attention import triton_stages

_LOG2E = math.log2(math.e)
_NEG_INIT = -1e30  # running-max start: finite, so an empty split never computes inf - inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class GqaTuning:
    """Tile sizes of the query-group kernel (no effect on results beyond float32 rounding).

    tile_groups: key groups of G tokens per tile (rounded down to a power of two dividing the
      capacity's and the residual length's groups).
    num_splits: token splits per (sequence, KV head); None: the largest power of two at or
      below ceil(target_programs / (batch x KV heads)), at most one per tile.
    target_programs: the programs `num_splits` None aims at.
    warps: warps per program.
    stages: software-pipeline stages of the main loop (Triton's cp.async pipeliner,
      `triton_stages`); 1: a plain loop.
    """

    tile_groups: int = 2
    num_splits: int | None = None
    target_programs: int = 4 * 132
    warps: int = 4
    stages: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and f.name == "num_splits":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GqaTuning.{f.name} must be a positive int, got {v!r}")
        if self.warps & (self.warps - 1):
            raise ValueError("GqaTuning.warps must be a power of two")


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def query_rows(n_rep: int) -> int:
    """M: the query rows of a program, n_rep padded to a power of two of at least 16."""
    return max(16, 1 << (n_rep - 1).bit_length())


def _stack_fields(fields):
    """kpb tiles [..., n] -> [..., n * kpb] holding field j of column i at column i * kpb + j.

    Triton joins two tiles at a time, on a new last axis: stack(stack(f0, f2), stack(f1, f3))
    puts f_{2a+b} at [..., a, b], so the merged columns run i * kpb + j.
    """
    kpb = len(fields)
    while len(fields) > 1:
        half = len(fields) // 2
        fields = [jnp.stack([fields[i], fields[i + half]], axis=-1) for i in range(half)]
    (x,) = fields
    lead = x.shape[: x.ndim - (kpb.bit_length() - 1)]
    return x.reshape(*lead[:-1], lead[-1] * kpb)


def _gqa_kernel(
    len_ref,  # []                  int32
    q_ref,  # [M, D]                f32 queries times q_scale (rows >= n_rep zero)
    kc_ref,  # [C // kpb, D]        uint8 key codes (token kpb i + j in bits [kb j, kb j + kb))
    ks_ref,  # [C // G, D]          key scales
    kz_ref,  # [C // G, D]          key zero points
    vc_ref,  # [C, D // vpb]        uint8 value codes (channel vpb e + j in byte e)
    vs_ref,  # [C, D // G]          value scales
    vz_ref,  # [C, D // G]          value zero points
    kr_ref,  # [R, D]               key ring (token t at slot t % R)
    vr_ref,  # [R, D]               value ring
    m_ref,  # out [M]               f32 the program's max logit (base 2)
    l_ref,  # out [M]               f32 sum_t 2**(s_t - m)
    o_ref,  # out [M, D]            f32 sum_t 2**(s_t - m) v_t
    *,
    k_bits: int,
    v_bits: int,
    group_size: int,
    residual_length: int,
    tile: int,
    splits: int,
    dtype,
):
    M, D = q_ref.shape
    G, R, T = group_size, residual_length, tile
    kpb, vpb = 8 // k_bits, 8 // v_bits
    n_ch = D // G  # value channel groups
    length = len_ref[()]
    split = pl.program_id(2)
    qk = length - length % R
    pv = jnp.maximum(length - R, 0)
    v1 = pv - pv % T
    q = q_ref[...]  # [M, D] f32
    q_lo = q.astype(dtype)

    def key_scores(g):
        """Logits [M, G] of key group g's quantized keys."""
        codes = kc_ref[pl.ds(g * (G // kpb), G // kpb), :].astype(jnp.int32)  # [G/kpb, D]
        mask = (1 << k_bits) - 1
        fields = [((codes >> (k_bits * j)) & mask).T for j in range(kpb)]  # [D, G/kpb] each
        c = _stack_fields(fields).astype(jnp.float32)  # [D, G], token kpb i + j
        s = ks_ref[g, :].astype(jnp.float32)[:, None]
        z = kz_ref[g, :].astype(jnp.float32)[:, None]
        return jnp.dot(q_lo, (c * s + z).astype(dtype), preferred_element_type=jnp.float32)

    def weighted_values(t0, p):
        """sum_t p_t v_t over the G tokens [t0, t0 + G) of quantized values: n_ch tiles
        [M, G], channel group ch's in tile ch. p [M, G] f32."""
        p_lo = p.astype(dtype)
        out = []
        mask = (1 << v_bits) - 1
        for ch in range(n_ch):
            codes = vc_ref[pl.ds(t0, G), pl.ds(ch * (G // vpb), G // vpb)].astype(jnp.int32)
            fields = [(codes >> (v_bits * j)) & mask for j in range(vpb)]  # [G, G/vpb] each
            c = _stack_fields(fields).astype(jnp.float32)  # [G tokens, G channels]
            s = vs_ref[pl.ds(t0, G), ch].astype(jnp.float32)[:, None]
            z = vz_ref[pl.ds(t0, G), ch].astype(jnp.float32)[:, None]
            out.append(jnp.dot(p_lo, (c * s + z).astype(dtype), preferred_element_type=jnp.float32))
        return out

    def ring(ref, t0):
        """Ring slots of the G tokens [t0, t0 + G), in the query's dtype: [G, D]."""
        return ref[pl.ds(t0 % R, G), :].astype(dtype)

    def step(t_tile, carry, *, tail: bool):
        """Online softmax over one tile of T tokens (a main tile, or a tail tile with masks
        and the rings)."""
        m, l_sum, acc = carry
        scores = []
        for i in range(T // G):
            t0 = t_tile + i * G
            s = key_scores(t0 // G)
            if tail:
                tok = t0 + lax.broadcasted_iota(jnp.int32, (1, G), 1)
                s_ring = jnp.dot(q_lo, ring(kr_ref, t0).T, preferred_element_type=jnp.float32)
                s = jnp.where(tok < length, jnp.where(tok < qk, s, s_ring), -jnp.inf)
            scores.append(s)
        m_new = functools.reduce(jnp.maximum, [jnp.max(s, axis=1) for s in scores], m)
        alpha = jnp.exp2(m - m_new)
        acc = [a * alpha[:, None] for a in acc]
        l_sum = l_sum * alpha
        for i, s in enumerate(scores):
            t0 = t_tile + i * G
            p = jnp.exp2(s - m_new[:, None])  # [M, G]; 0 where masked
            l_sum = l_sum + jnp.sum(p, axis=1)
            if tail:
                tok = t0 + lax.broadcasted_iota(jnp.int32, (1, G), 1)
                p_ring = jnp.where(tok < pv, 0.0, p).astype(dtype)
                p = jnp.where(tok < pv, p, 0.0)
                for ch in range(n_ch):
                    v = vr_ref[pl.ds(t0 % R, G), pl.ds(ch * G, G)].astype(dtype)
                    acc[ch] = acc[ch] + jnp.dot(p_ring, v, preferred_element_type=jnp.float32)
            for ch, part in enumerate(weighted_values(t0, p)):
                acc[ch] = acc[ch] + part
        return m_new, l_sum, acc

    carry = (
        jnp.full((M,), _NEG_INIT, jnp.float32),
        jnp.zeros((M,), jnp.float32),
        [jnp.zeros((M, G), jnp.float32) for _ in range(n_ch)],
    )
    n_main = v1 // T
    carry = lax.fori_loop(
        0,
        pl.cdiv(n_main - split, splits),
        lambda k, c: step((k * splits + split) * T, c, tail=False),
        carry,
    )
    n_tail = pl.cdiv(length - v1, T)
    m, l_sum, acc = lax.fori_loop(
        0,
        pl.cdiv(n_tail - split, splits),
        lambda k, c: step(v1 + (k * splits + split) * T, c, tail=True),
        carry,
    )
    m_ref[...] = m
    l_ref[...] = l_sum
    for ch in range(n_ch):
        o_ref[:, pl.ds(ch * G, G)] = acc[ch]


def tile_tokens(tuning: GqaTuning, *, capacity: int, group_size: int, residual_length: int) -> int:
    """T: tokens per tile, a power of two of whole key groups dividing the capacity and R."""
    G = group_size
    n = math.gcd(capacity // G, residual_length // G)
    return G * _pow2_divisor(n, tuning.tile_groups)


def num_splits(tuning: GqaTuning, *, batch: int, kv_heads: int, tiles: int) -> int:
    """S: token splits per (sequence, KV head)."""
    if tuning.num_splits is not None:
        return max(1, min(tuning.num_splits, tiles))
    cap = max(1, min(tiles, pl.cdiv(tuning.target_programs, batch * kv_heads)))
    return 1 << (cap.bit_length() - 1)


@functools.partial(
    jax.jit,
    static_argnames=(
        "k_bits", "v_bits", "group_size", "residual_length", "sm_scale", "tuning", "interpret",
    ),
)  # fmt: skip
def kivi_decode_attention_gqa(
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
    tuning: GqaTuning = GqaTuning(),
    interpret: bool = False,
):
    """Decode attention over a KIVI state, a KV head's query group per program -> [B, Hq, D].

    The configurations of `gpu.supported_config_reason`; the caller checks them."""
    B, Hq, D = q.shape
    _, H, C, _ = v_codes.shape
    G, R = group_size, residual_length
    if Hq % H:
        raise ValueError(f"{Hq} query heads are not a multiple of {H} KV heads")
    if R % G or C % G:
        raise ValueError(f"residual_length={R} and capacity={C} must be multiples of G={G}")
    n_rep = Hq // H
    M = query_rows(n_rep)
    T = tile_tokens(tuning, capacity=C, group_size=G, residual_length=R)
    S = num_splits(tuning, batch=B, kv_heads=H, tiles=C // T)
    q_scale = (1.0 / math.sqrt(D) if sm_scale is None else sm_scale) * _LOG2E  # base-2 logits
    qs = q.astype(jnp.float32).reshape(B, H, n_rep, D) * q_scale
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, M - n_rep), (0, 0)))
    row = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, h, s: (b, h, 0, 0))
    per_split = lambda *shape: pl.BlockSpec(
        (None, None, None, *shape), lambda b, h, s: (b, h, s, *(0,) * len(shape))
    )
    stages = tuning.stages if tuning.stages > 1 and (interpret or triton_stages.install()) else 1
    name = "kivi_gqa" if stages == 1 else triton_stages.staged_name("kivi_gqa", stages)
    m, l_sum, o = pl.pallas_call(
        functools.partial(
            _gqa_kernel,
            k_bits=k_bits,
            v_bits=v_bits,
            group_size=G,
            residual_length=R,
            tile=T,
            splits=S,
            dtype=q.dtype,
        ),
        grid=(B, H, S),
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, s: (b,)),
            row(M, D),
            row(*k_codes.shape[2:]),
            row(*k_scale.shape[2:]),
            row(*k_zero.shape[2:]),
            row(*v_codes.shape[2:]),
            row(*v_scale.shape[2:]),
            row(*v_zero.shape[2:]),
            row(R, D),
            row(R, D),
        ],
        out_specs=[per_split(M), per_split(M), per_split(M, D)],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, S, M), jnp.float32),
            jax.ShapeDtypeStruct((B, H, S, M), jnp.float32),
            jax.ShapeDtypeStruct((B, H, S, M, D), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=tuning.warps, num_stages=stages),
        interpret=interpret,
        name=name,
    )(lengths, qs, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual, v_residual)
    # The splits' partial softmaxes rescaled to the largest max; an empty row has zero sums in
    # every split and gives zeros.
    top = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - top)  # [B, H, S, M]
    num = jnp.sum(w[..., None] * o, axis=2)  # [B, H, M, D]
    den = jnp.sum(w * l_sum, axis=2)[..., None]
    out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)[:, :, :n_rep]
    return out.reshape(B, Hq, D).astype(q.dtype)
