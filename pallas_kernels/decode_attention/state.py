"""What the fused kernels read from one layer's KiviCache (the layout lives in kivi_jax.cache)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cache_reason(cache, *, reads_mixed: bool) -> str | None:
    """None if a fused kernel can read `cache` (a KiviCache; one with mixed-precision side
    storage only where `reads_mixed`), else a sentence saying why not."""
    from kivi_jax.cache import KiviCache  # imported here: kivi_jax imports the kernels lazily

    if not isinstance(cache, KiviCache):
        return f"the fused kernel reads a KiviCache, not a {type(cache).__name__}"
    if cache.config.mixed and not reads_mixed:
        return (
            "this kernel does not read a mixed-precision state (kivi2-mix: sinks, sliding keys, "
            "fine key channels, heavy tokens; docs/design.md); impl='auto' uses the reference"
        )
    return None


def unsupported_reason(cache, *, head_dim: int, dtype, supported, reads_mixed: bool) -> str | None:
    """None if a kernel whose `supported(k_bits=, v_bits=, group_size=, head_dim=, dtype=)`
    accepts the cache's configuration can read `cache`, else what it does not support."""
    reason = cache_reason(cache, reads_mixed=reads_mixed)
    if reason is not None:
        return reason
    cfg = cache.config
    return supported(
        k_bits=cfg.k_bits,
        v_bits=cfg.v_bits,
        group_size=cfg.group_size,
        head_dim=head_dim,
        dtype=dtype,
    )


def kernel_args(cache) -> tuple[tuple[jax.Array, ...], dict]:
    """(the arrays in the kernels' argument order, the static config as keyword arguments).

    The kernels read scales, zeros and rings in the cache dtype: those stored in a float8
    format (KiviConfig's *_format) are widened to it first, exactly (every float8 value is a
    bfloat16, float16 and float32 value), by XLA, a pass over them before the kernels; an
    int8 zero point (Format.E4M3_INT8) is read as its value, which is one of the cache dtype,
    and so are an INT8 ring's tokens (codes times a power of two, kivi_jax.cache.ring_values)."""
    from kivi_jax.cache import ring_values
    from kivi_jax.quantization import zero_values

    cfg = cache.config
    wide = lambda x: x if x.dtype == cache.dtype else x.astype(cache.dtype)
    # An integer zero (Format.E4M3_INT8) read as its value: one of the cache dtype.
    zeros = lambda s, z, f, bits: wide(z) if z.dtype != jnp.int8 else (
        zero_values(s, z, f.params(cache.dtype, bits)).astype(cache.dtype)
    )  # fmt: skip
    arrays = (
        cache.k_codes,
        wide(cache.k_scale),
        zeros(cache.k_scale, cache.k_zero, cfg.k_scale_format, cfg.k_bits),
        cache.v_codes,
        wide(cache.v_scale),
        zeros(cache.v_scale, cache.v_zero, cfg.v_scale_format, cfg.v_bits),
        *ring_values(cache),
        cache.lengths,
    )
    return arrays, dict(
        k_bits=cfg.k_bits,
        v_bits=cfg.v_bits,
        group_size=cfg.group_size,
        residual_length=cfg.residual_length,
    )


def mixed_args(cache) -> tuple[tuple, dict]:
    """What the GPU kernels read of a mixed state beyond `kernel_args`: ((side,), dict(
    sliding_keys=...)), or ((), {}) for a plain state; INT8 sinks and heavy tokens decoded
    to the cache dtype (exact), as the rings are."""
    from kivi_jax.cache import side_values

    if cache.side is None:
        return (), {}
    side = side_values(cache.side, cache.dtype)  # INT8 sinks and heavy tokens as values
    return (side,), dict(sliding_keys=cache.config.sliding_keys)
