"""Rotary position embedding in the Hugging Face ("rotate half") channel layout.

Channel i of the first half of a head is paired with channel i + D/2 and rotated by the angle
position * theta^(-2i/D). GGUF files store Q/K rows permuted for llama.cpp's interleaved layout;
the GGUF loader undoes that permutation, so every checkpoint meets this one RoPE.
"""

from __future__ import annotations

import jax.numpy as jnp


def rope_angles(positions: jnp.ndarray, head_dim: int, theta: float):
    """cos, sin of shape positions.shape + [head_dim // 2], in float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates x [..., heads, D] by the angles of cos/sin, which broadcast against
    [..., heads, D/2] (one position's angles for every head: [..., 1, D/2]); computes in float32."""
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)  # [..., heads, D/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(dtype)
