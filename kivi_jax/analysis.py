"""The error measures of the KIVI paper's analysis (its Tables 2 and 3), for one attention head.

X_K, X_V are [tokens, channels]; q is [queries, channels]; X' is X after quantize-dequantize along
an axis. A = softmax(q X_K^T / sqrt(d)) and A' the same with X'_K. Per-token quantization groups G
channels of one token; per-channel quantization groups G tokens of one channel.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from kivi_jax.quantization import fake_quantize


class Grouping(enum.Enum):
    PER_TOKEN = "per-token"
    PER_CHANNEL = "per-channel"


def quantize_dequantize(x: jax.Array, bits: int, group_size: int, grouping: Grouping) -> jax.Array:
    """x [tokens, channels] after quantize-dequantize in float32, no residual."""
    axis = 1 if grouping is Grouping.PER_TOKEN else 0
    return fake_quantize(x.astype(jnp.float32), bits, group_size, axis)


def attention_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """A = softmax(q k^T / sqrt(d)) over the tokens: [queries, tokens]."""
    return jax.nn.softmax(q @ k.T / jnp.sqrt(jnp.float32(k.shape[-1])), axis=-1)


def key_reconstruction_error(k: jax.Array, k_hat: jax.Array) -> jax.Array:
    """||X_K - X'_K||_F."""
    return jnp.linalg.norm(k - k_hat)


def attention_score_error(q: jax.Array, k: jax.Array, k_hat: jax.Array) -> jax.Array:
    """||A - A'||_F."""
    return jnp.linalg.norm(attention_scores(q, k) - attention_scores(q, k_hat))


def value_reconstruction_error(v: jax.Array, v_hat: jax.Array) -> jax.Array:
    """||X_V - X'_V||_F."""
    return jnp.linalg.norm(v - v_hat)


def attention_output_error(a: jax.Array, v: jax.Array, v_hat: jax.Array) -> jax.Array:
    """Delta = ||(A X_V - A X'_V) / (A X_V)||_F, the division elementwise."""
    out = a @ v
    return jnp.linalg.norm((out - a @ v_hat) / out)
