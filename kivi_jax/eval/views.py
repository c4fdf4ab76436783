"""Prompt attention over the K/V that a cache would show: the building block of the studies.

Each function has the signature of the model's prompt attention,

    attention(q [B, S, N, D], k [B, S, H, D], v [B, S, H, D], lengths [B]) -> [B, S, N, D],

causal, query head n reading KV head n // (N // H), padded keys (t >= lengths[b]) ignored.

- `StreamingAttention(config)`: query i sees exactly what the streaming KIVI cache holds after
  token i was appended (keys [0, Qk) and values [0, Pv) quantized, the rest full precision), so one
  forward pass attends over the K/V of teacher-forced decoding through the cache (equal up to
  float rounding, which can flip 2-bit roundings in later layers: docs/accuracy.md). This works
  because a token's quantized key (its group of G tokens, formed at a flush) and quantized value
  (formed when it leaves the window) never change once made.
  For a mixed-precision config (kivi_jax.cache: sinks, sliding keys, fine key channels,
  heavy tokens) query i also sees the sinks and the heavy tokens chosen by then in full
  precision: the heavy tokens' scores are a function of the tokens (Selection.ERROR) or of the
  queries' softmax over the full-precision keys they see (Selection.MASS), both available in
  one pass, so the view still equals teacher-forced decoding through the cache (up to float
  rounding: docs/accuracy.md).
- `FakeQuantAttention(k_grouping, v_grouping, bits)`: the paper's Table 1 fake quantization:
  the whole sequence's K and V quantize-dequantized along one axis in groups of G, no residual.
- `FullAttention()`: no quantization.
- `SharedPrefixAttention(config, split)`: a prompt whose first `split` tokens come from another
  request's sealed pages (the serving engine's prefix sharing): queries at `split` and after
  see those tokens' keys and values as the pages hold them (quantized), everything else in
  full precision, as the engine's chunked prefill of the rest computes them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kivi_jax import cache as kc
from kivi_jax import quantization
from kivi_jax.analysis import Grouping
from kivi_jax.config import KiviConfig
from kivi_jax.quantization import fake_quantize


def _pad_tokens(x: jax.Array, multiple: int) -> jax.Array:
    """Pads axis 1 to a multiple by repeating the last token (a partial group keeps its range)."""
    pad = -x.shape[1] % multiple
    return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)), mode="edge") if pad else x


def quantize_tokens(
    x: jax.Array,
    bits: int,
    group_size: int,
    grouping: Grouping,
    dtype,
    params_dtype=None,
    trims=quantization.MINMAX,
):
    """x [B, S, H, D] quantize-dequantized in `dtype` (scales and zeros in `params_dtype`,
    default `dtype`; ranges chosen among `trims`), grouped per token or per channel."""
    x = x.astype(dtype)
    if grouping is Grouping.PER_TOKEN:
        return fake_quantize(x, bits, group_size, axis=3, params_dtype=params_dtype, trims=trims)
    padded = _pad_tokens(x, group_size)
    return fake_quantize(padded, bits, group_size, axis=1, params_dtype=params_dtype, trims=trims)[
        :, : x.shape[1]
    ]


def _entering_and_quantized(cfg: KiviConfig, dtype, k, v):
    """(k, v as the cache holds them when they enter, and their group-quantized values: keys
    per channel, values per token, in the config's scale formats)."""
    k, v = (kc.entering_tokens(cfg, x, dtype) for x in (k, v))
    g = cfg.group_size
    kp = cfg.k_scale_format.params(dtype, cfg.k_bits)
    vp = cfg.v_scale_format.params(dtype, cfg.v_bits)
    kq = quantize_tokens(
        k, cfg.k_bits, g, Grouping.PER_CHANNEL, dtype, params_dtype=kp, trims=cfg.k_range.trims
    )
    vq = quantize_tokens(
        v, cfg.v_bits, g, Grouping.PER_TOKEN, dtype, params_dtype=vp, trims=cfg.v_range.trims
    )
    return k, v, kq, vq


def _two_candidate_attention(q, k_a, k_b, v_a, v_b, use_k_a, use_v_a, lengths):
    """softmax over t of q_i . (k_a if use_k_a[i, t] else k_b), times (v_a if use_v_a else v_b).

    q [B, S, N, D]; k_*, v_* [B, S, H, D]; use_* [S, S] bools (query i, key t); causal and padded
    keys masked. float32 throughout.
    """
    b, s, n, d = q.shape
    h = k_a.shape[2]
    qg = q.astype(jnp.float32).reshape(b, s, h, n // h, d)  # [B, S, H, rep, D]
    scale = 1.0 / math.sqrt(d)
    hi = jax.lax.Precision.HIGHEST
    score = lambda k: jnp.einsum("bihrd,bthd->bhrit", qg, k.astype(jnp.float32), precision=hi)
    scores = jnp.where(use_k_a, score(k_a), score(k_b)) * scale  # [B, H, rep, S, S]
    i, t = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    allowed = (t <= i) & (t < lengths[:, None, None, None, None])
    scores = jnp.where(allowed, scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    p = jnp.where(allowed, p, 0.0)  # rows with no key (padding queries) give zeros, not NaN
    mix = lambda mask, v: jnp.einsum(
        "bhrit,bthd->bihrd", jnp.where(mask, p, 0.0), v.astype(jnp.float32), precision=hi
    )
    out = mix(use_v_a, v_a) + mix(~use_v_a, v_b)
    return out.reshape(b, s, n, d).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class StreamingAttention:
    """Prompt attention that sees the streaming KIVI cache's state at each query (module doc)."""

    config: KiviConfig
    cache_dtype: object = jnp.float32

    def __call__(self, q, k, v, lengths):
        if self.config.mixed:
            return _mixed_streaming_attention(self.config, self.cache_dtype, q, k, v, lengths)
        cfg, s, dtype = self.config, q.shape[1], self.cache_dtype
        k, v, kq, vq = _entering_and_quantized(cfg, dtype, k, v)
        held = jnp.arange(s)[:, None] + 1  # [S, 1]: the cache length when query i attends
        t = jnp.arange(s)[None, :]
        r = cfg.residual_length
        keys_quantized = t < held - held % r  # [S, S]
        values_quantized = t < held - r
        return _two_candidate_attention(q, kq, k, vq, v, keys_quantized, values_quantized, lengths)


def _top_n_members(score, candidate_from, n: int, first: int):
    """[B, H, S(i), S(t)] bools: token t is among the n best candidates at query i.

    score [B, H, S]; token t >= `first` is a candidate from query t + candidate_from on; best
    means score descending, then position ascending (kivi_jax.cache's heavy slots).
    """
    s = score.shape[-1]
    u = jnp.arange(s)
    beats = (score[..., None, :] > score[..., :, None]) | (
        (score[..., None, :] == score[..., :, None]) & (u[None, :] < u[:, None])
    )  # [B, H, t, u]: u ranks above t
    beats &= u >= first
    count = jnp.cumsum(beats.astype(jnp.int32), axis=-1)  # [B, H, t, u]: among [0, u]
    last = jnp.arange(s) - candidate_from  # [S(i)]: the last candidate at query i
    c = jnp.take(count, jnp.clip(last, 0, s - 1), axis=-1)  # [B, H, t, i]
    member = (u[:, None] >= first) & (u[:, None] <= last[None, :]) & (c < n)
    return jnp.swapaxes(member, -1, -2)


def _mixed_streaming_attention(cfg: KiviConfig, dtype, q, k, v, lengths):
    """StreamingAttention for a mixed-precision config (kivi_jax.cache's module doc): query i
    sees the sinks, the rings, the heavy tokens chosen so far and the codes of the rest."""
    b, s, n, d = q.shape
    h = k.shape[2]
    g, r = cfg.group_size, cfg.residual_length
    k, v = (kc.entering_tokens(cfg, x, dtype) for x in (k, v))
    # Keys through the cache's own group quantization (sinks, fine channels), groups from 0.
    kh = _pad_tokens(k, g).swapaxes(1, 2)  # [B, H, S', D]
    codes, scale, zero, lo, channels = kc._quantize_keys(kh, cfg, jnp.zeros((b,), jnp.int32), dtype)
    rep_g = lambda x: jnp.repeat(x, g, axis=2)
    k_params = cfg.k_scale_format.params(dtype, cfg.k_bits)
    if lo is None:
        kq = quantization.dequantize(codes, scale, zero, g, axis=2, params=k_params)
    else:
        kq = kc._fine_dequantize(
            codes,
            rep_g(scale.astype(jnp.float32)),
            rep_g(quantization.zero_values(scale, zero, k_params)),
            lo,
            rep_g(channels),
            cfg.k_bits,
            d,
        )
    kq = kq[:, :, :s]  # [B, H, S, D]
    v_params = cfg.v_scale_format.params(dtype, cfg.v_bits)
    v_codes, v_scale, v_zero = quantization.quantize(
        v, cfg.v_bits, g, axis=3, dtype=v_params, trims=cfg.v_range.trims
    )
    vq = quantization.dequantize(v_codes, v_scale, v_zero, g, 3, v_params).swapaxes(1, 2)
    kf, vf = (x.astype(jnp.float32).swapaxes(1, 2) for x in (k, v))  # [B, H, S, D]

    qg = q.astype(jnp.float32).reshape(b, s, h, n // h, d)
    hi = jax.lax.Precision.HIGHEST
    scale_d = 1.0 / math.sqrt(d)
    score_of = lambda keys: jnp.einsum("bihrd,bhtd->bhrit", qg, keys, precision=hi) * scale_d
    s_fp = score_of(kf)  # [B, H, rep, S(i), S(t)]
    i, t = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    causal = t <= i
    sink = t < cfg.sinks
    window = causal & (t >= i + 1 - r)  # the rings at query i
    members = jnp.zeros((1, 1, s, s), bool)
    if cfg.heavy_tokens:
        if cfg.needs_queries:  # mass from each query's softmax over the sinks and the window
            seen = window | (sink & causal)
            p_win = jax.nn.softmax(jnp.where(seen, s_fp, -jnp.inf), axis=-1)
            p_win = jnp.where(window, p_win, 0.0).sum(axis=2)  # [B, H, i, t]
            heavy_score = jnp.sum(jnp.where(window & (i < t + r), p_win, 0.0), axis=2)
        else:
            heavy_score = quantization.ordered_sum((kf - kq) ** 2) + quantization.ordered_sum(
                (vf - vq) ** 2
            )
        members = _top_n_members(heavy_score, r, cfg.heavy_tokens, cfg.sinks)
    held = i + 1
    key_q_end = jnp.maximum(held - r, 0) if cfg.sliding_keys else held - held % r
    keys_fp = ((t >= key_q_end) | sink)[None, None] | members  # [B or 1, H or 1, i, t]
    values_fp = ((t >= held - r) | sink)[None, None] | members
    keys_fp, values_fp = keys_fp[:, :, None], values_fp[:, :, None]  # [.., 1, i, t]
    scores = jnp.where(keys_fp, s_fp, score_of(kq))
    allowed = causal & (t < lengths[:, None, None, None, None])
    scores = jnp.where(allowed, scores, -jnp.inf)
    p = jnp.where(allowed, jax.nn.softmax(scores, axis=-1), 0.0)
    mix = lambda mask, x: jnp.einsum(
        "bhrit,bhtd->bihrd", jnp.where(mask, p, 0.0), x.astype(jnp.float32), precision=hi
    )
    out = mix(values_fp, vf) + mix(~values_fp, vq)
    return out.reshape(b, s, n, d).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class FakeQuantAttention:
    """The paper's Table 1: K and V quantize-dequantized along one axis, groups of G, no residual.

    A grouping of None leaves that tensor in full precision.
    """

    k_grouping: Grouping | None
    v_grouping: Grouping | None
    bits: int
    group_size: int = 32

    def __call__(self, q, k, v, lengths):
        fq = lambda x, g: (
            x if g is None else quantize_tokens(x, self.bits, self.group_size, g, jnp.float32)
        )
        k, v = fq(k, self.k_grouping), fq(v, self.v_grouping)
        everywhere = jnp.ones((q.shape[1], q.shape[1]), bool)
        return _two_candidate_attention(q, k, k, v, v, everywhere, everywhere, lengths)


@dataclasses.dataclass(frozen=True)
class FullAttention:
    """Unquantized causal attention in float32 (the baseline of the studies)."""

    def __call__(self, q, k, v, lengths):
        everywhere = jnp.ones((q.shape[1], q.shape[1]), bool)
        return _two_candidate_attention(q, k, k, v, v, everywhere, everywhere, lengths)


@dataclasses.dataclass(frozen=True)
class SharedPrefixAttention:
    """Prompt attention of a prompt whose tokens [0, split) are a shared prefix (module doc):
    split a multiple of the group size (a page boundary)."""

    config: KiviConfig
    split: int
    cache_dtype: object = jnp.float32

    def __call__(self, q, k, v, lengths):
        cfg, s, dtype = self.config, q.shape[1], self.cache_dtype
        if self.split % cfg.group_size:
            raise ValueError(f"split={self.split} must be a multiple of G={cfg.group_size}")
        k, v, kq, vq = _entering_and_quantized(cfg, dtype, k, v)
        i, t = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
        shared = (i >= self.split) & (t < self.split)
        return _two_candidate_attention(q, kq, k, vq, v, shared, shared, lengths)
