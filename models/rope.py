"""Rotary position embedding in the Hugging Face ("rotate half") channel layout, and the rules
that scale its frequencies for long contexts.

Channel i of the first half of a head is paired with channel i + D/2 and rotated by the angle
position * theta^(-2i/D) / factor_i, where factor_i is 1 without scaling (`LlamaConfig.
rope_factors`). GGUF files store Q/K rows permuted for llama.cpp's interleaved layout (arch
"llama"; "qwen2" and "qwen3" keep this layout); the GGUF loader undoes that permutation, so every
checkpoint meets this one RoPE.

Scaling rules (as transformers' modeling_rope_utils means them; llama.cpp writes llama3's
factors as its rope_freqs tensor), each a factor per frequency and a scale of cos and sin:
  linear   every factor = `factor`.
  llama3   wavelengths 2 pi / f longer than original / low_freq_factor: `factor`; shorter than
           original / high_freq_factor: 1; in between the inverse of a linear blend of 1/factor
           and 1 by original / wavelength (Llama 3.1-3.3).
  yarn     frequencies blended between f / factor and f by a ramp over the dimensions whose
           rotations within the original context lie between beta_slow and beta_fast; cos and
           sin scaled by 0.1 ln(factor) + 1 (or `attention_factor`) (Qwen2.5/Qwen3 past 32k).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def rope_angles(
    positions: jnp.ndarray,
    head_dim: int,
    theta: float,
    factors: tuple[float, ...] | None = None,
    scale: float = 1.0,
):
    """cos, sin of shape positions.shape + [head_dim // 2], in float32, times `scale`; frequency
    i divided by factors[i] where given."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if factors is not None:
        inv_freq = inv_freq / jnp.asarray(factors, jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates x [..., heads, D] by the angles of cos/sin, which broadcast against
    [..., heads, D/2] (one position's angles for every head: [..., 1, D/2]); computes in float32."""
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)  # [..., heads, D/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(dtype)


# The fields each rule takes (beyond rope_type and rope_theta), and which of them it requires.
SCALING_FIELDS = {
    "default": (set(), set()),
    "linear": ({"factor"}, set()),
    "llama3": (
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
        set(),
    ),
    "yarn": (
        {"factor"},
        {
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "truncate",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
        },
    ),
}


def scaling(
    rope_type: str, fields: dict, *, head_dim: int, theta: float, max_positions: int
) -> tuple[tuple[float, ...], float]:
    """(factors [head_dim / 2] or None for "default", cos/sin scale) of a scaling rule
    (module doc) with its fields as a Hugging Face config writes them; `max_positions` is
    yarn's original context where its fields name none. ValueError for an unknown rule, a
    missing field or one the rule does not take (partial_rotary_factor, for one)."""
    if rope_type not in SCALING_FIELDS:
        raise ValueError(
            f"rope type {rope_type!r} is not implemented (implemented: {', '.join(SCALING_FIELDS)})"
        )
    required, optional = SCALING_FIELDS[rope_type]
    if missing := required - set(fields):
        raise ValueError(f"rope type {rope_type!r} lacks {sorted(missing)}")
    if unknown := set(fields) - required - optional:
        raise ValueError(f"rope type {rope_type!r}: fields {sorted(unknown)} are not implemented")
    if rope_type == "default":
        return None, 1.0
    f = lambda name, default=None: default if fields.get(name) is None else fields[name]
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)  # float64 [D/2]
    factor = float(fields["factor"])
    if rope_type == "linear":
        return (factor,) * (head_dim // 2), 1.0
    if rope_type == "llama3":
        original = fields["original_max_position_embeddings"]
        low, high = fields["low_freq_factor"], fields["high_freq_factor"]
        wavelength = 2 * math.pi / freqs
        smooth = (original / wavelength - low) / (high - low)
        blended = 1.0 / ((1 - smooth) / factor + smooth)
        out = np.where(wavelength > original / low, factor, blended)
        out = np.where(wavelength < original / high, 1.0, out)
        return tuple(float(x) for x in out), 1.0
    original = f("original_max_position_embeddings", max_positions)
    fast, slow = f("beta_fast", 32.0), f("beta_slow", 1.0)
    # the dimension (of head_dim) whose frequency turns `rotations` times over the context
    dim = lambda rotations: (
        head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    )
    lo, hi = dim(fast), dim(slow)
    if f("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2) - lo) / ((hi - lo) or 0.001), 0, 1)
    kept = 1 - ramp  # share of the original frequency
    out = 1.0 / ((1 - kept) / factor + kept)
    mscale = lambda m=1.0: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    attention = f("attention_factor")
    if attention is None:
        m, m_all = f("mscale"), f("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale()
    return tuple(float(x) for x in out), float(attention)
