"""kivi-jax: KIVI 2-bit asymmetric KV-cache quantization for JAX.

The KV state (kivi_jax.cache) is a pytree passed into and returned from pure functions:

    cache = kivi_jax.init_cache(kivi_jax.KiviConfig(), batch=1, max_len=4096,
                                num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
    cache = kivi_jax.prefill(cache, k, v)          # k, v [batch, seq, kv_heads, head_dim]
    cache = kivi_jax.append(cache, k_t, v_t)       # k_t, v_t [batch, kv_heads, head_dim]
    out = kivi_jax.decode_attention(q_t, cache)    # q_t [batch, q_heads, head_dim]
"""

from kivi_jax.attention import decode_attention, decode_attention_reference
from kivi_jax.cache import (
    FullCache,
    KiviCache,
    append,
    dequantize,
    init_cache,
    layer,
    prefill,
)
from kivi_jax.config import KIVI2, KIVI4, KiviConfig
from kivi_jax.memory import HeldBits, MemoryReport, held_bits, memory_report
from kivi_jax.quantization import fake_quantize, pack_codes, unpack_codes

__all__ = [
    "KIVI2",
    "KIVI4",
    "FullCache",
    "HeldBits",
    "KiviCache",
    "KiviConfig",
    "MemoryReport",
    "append",
    "decode_attention",
    "decode_attention_reference",
    "dequantize",
    "fake_quantize",
    "held_bits",
    "init_cache",
    "layer",
    "memory_report",
    "pack_codes",
    "prefill",
    "unpack_codes",
]
