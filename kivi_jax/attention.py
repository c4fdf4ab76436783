"""Decode attention over a KV state: the public dispatch, the plain-jnp reference and the
full-precision cache's path through cuDNN."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kivi_jax.cache import Cache, FullCache, check_cache, dequantized_heads_major

IMPLEMENTATIONS = ("auto", "reference", "pallas", "pallas_tpu")


def check_decode_inputs(q: jax.Array, cache: Cache) -> int:
    """Checks q [batch, q_heads, head_dim] against one cache layer; returns q_heads // kv_heads."""
    check_cache(cache)
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    b, hq, d = q.shape
    if b != cache.batch or d != cache.head_dim:
        raise ValueError(
            f"q of shape {q.shape} does not match the cache (batch={cache.batch}, "
            f"head_dim={cache.head_dim})"
        )
    if hq % cache.num_kv_heads:
        raise ValueError(
            f"q_heads={hq} must be a multiple of the cache's kv_heads={cache.num_kv_heads} (GQA)"
        )
    return hq // cache.num_kv_heads


def masked_logits(q: jax.Array, cache: Cache, window: int | None = None):
    """The reference's logits and values: (q . k / sqrt(d) float32 [B, H, rep, C], -inf at the
    tokens not read; which tokens are read [B, 1, 1, C]; the values float32 [B, H, C, D]),
    query head h at [b, h // rep, h % rep] (arguments: `decode_attention_reference`)."""
    n_rep = check_decode_inputs(q, cache)
    b, hq, d = q.shape
    k, v = dequantized_heads_major(cache)  # [B, H, C, D] float32
    qg = q.astype(jnp.float32).reshape(b, hq // n_rep, n_rep, d)  # [B, H, rep, D]
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bhrd,bhtd->bhrt", qg, k, precision=hi) / jnp.sqrt(jnp.float32(d))
    t, n = jnp.arange(k.shape[2]), cache.lengths[:, None, None, None]
    held = t < n  # [B, 1, 1, C]
    if window is not None:
        held &= t >= n - window
    return jnp.where(held, s, -jnp.inf), held, v


def decode_attention_reference(q: jax.Array, cache: Cache, window: int | None = None) -> jax.Array:
    """softmax(q . K / sqrt(d)) . V over each sequence's held tokens, in float32.

    q: [batch, q_heads, head_dim]; query head h reads KV head h // (q_heads // kv_heads).
    window: None, or W: only the last W tokens of each sequence (the query's own and the W - 1
      before it; a sliding-window model's).
    Returns [batch, q_heads, head_dim] in q's dtype; a sequence of length 0 gives zeros.
    """
    s, held, v = masked_logits(q, cache, window)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(held, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    hi = jax.lax.Precision.HIGHEST
    out = jnp.einsum("bhrt,bhtd->bhrd", p, v, precision=hi) / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(q.shape).astype(q.dtype)


_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def cudnn_unsupported_reason(q: jax.Array, cache: Cache) -> str | None:
    """None if `decode_attention_cudnn(q, cache)` runs here, else what it does not support."""
    if not isinstance(cache, FullCache):
        return f"cuDNN's attention reads a FullCache, not a {type(cache).__name__}"
    if jax.default_backend() != "gpu":
        return f"cuDNN needs a CUDA GPU (backend here: {jax.default_backend()})"
    if cache.dtype not in _CUDNN_DTYPES or q.dtype != cache.dtype:
        return f"cuDNN takes bfloat16 or float16 q and cache alike, got {q.dtype}, {cache.dtype}"
    if cache.head_dim % 8 or cache.head_dim > 128:
        return f"head_dim={cache.head_dim}: cuDNN's attention here takes multiples of 8 up to 128"
    return None


def decode_attention_cudnn(q: jax.Array, cache: FullCache) -> jax.Array:
    """The full-precision cache's decode attention through cuDNN (flash attention, GQA and the
    per-row lengths as its padding mask; the cache is stored [B, T, H, D] as cuDNN reads it, so
    nothing is transposed or copied). Same signature and result as the reference."""
    out = jax.nn.dot_product_attention(
        q[:, None], cache.k, cache.v, key_value_seq_lengths=cache.lengths, implementation="cudnn"
    )[:, 0]  # [B, N, D]
    return jnp.where(cache.lengths[:, None, None] > 0, out, jnp.zeros((), out.dtype))


def decode_attention(
    q: jax.Array,
    cache: Cache,
    *,
    impl: str = "auto",
    interpret: bool = False,
    window: int | None = None,
) -> jax.Array:
    """Attention of one new query per sequence over everything the cache holds.

    Args:
      q: [batch, q_heads, head_dim], q_heads a multiple of the cache's kv_heads.
      cache: one layer's KiviCache or FullCache, already holding this step's key and value.
      impl: "reference" (plain jnp), "pallas" (the fused GPU kernel; an error where it does not
        support the configuration), "pallas_tpu" (the fused TPU kernel, likewise) or "auto":
        on a GPU the fused kernels for a KiviCache they support (plain or mixed-precision,
        e.g. kivi2-mix) and cuDNN's attention for a bfloat16/float16 FullCache, on a TPU the
        TPU kernel where it applies (plain KIVI only), else the reference.
      interpret: run a Pallas kernel in interpret mode (CPU tests).
      window: None, or a sliding window of W tokens (`LlamaConfig.sliding_window`): only the
        last W tokens are read. The reference applies it; the fused kernels and cuDNN do not
        ("pallas", "pallas_tpu": NotImplementedError; "auto": the reference; docs/design.md).

    Returns:
      [batch, q_heads, head_dim] in q's dtype.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    check_decode_inputs(q, cache)
    if impl == "reference":
        return decode_attention_reference(q, cache, window)
    if window is not None:
        if impl != "auto":
            raise NotImplementedError(
                f"impl={impl!r}: the fused kernels do not apply a sliding window "
                f"(window={window}); impl='auto' or 'reference' does"
            )
        return decode_attention_reference(q, cache, window)
    # Imported here: the kernel modules (Triton, TPU lowering helpers) load when first used.
    from kivi_jax.pallas_kernels.decode_attention import gpu, tpu

    kernels = {  # impl: (its backend, in words, the kernel, what it does not support)
        "pallas": ("gpu", "a CUDA GPU", gpu.decode_attention_pallas, gpu.unsupported_reason),
        "pallas_tpu": ("tpu", "a TPU", tpu.decode_attention_pallas_tpu, tpu.unsupported_reason),
    }
    backend = jax.default_backend()
    if impl in kernels:
        where, words, kernel, _ = kernels[impl]
        if not interpret and backend != where:
            raise NotImplementedError(
                f"impl={impl!r}: the fused kernel runs on {words} (backend here: {backend}); "
                f"pass interpret=True to run it on the CPU"
            )
        return kernel(q, cache, interpret=interpret)
    # "auto": the backend's kernel where one applies, else the reference.
    if cudnn_unsupported_reason(q, cache) is None:
        return decode_attention_cudnn(q, cache)
    for where, _, kernel, unsupported in kernels.values():
        if backend == where and unsupported(q, cache) is None:
            return kernel(q, cache, interpret=interpret)
    return decode_attention_reference(q, cache)
