"""Memory accounting: what a cache allocates and what the tokens it holds cost per value."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kivi_jax import quantization
from kivi_jax.cache import Cache, FullCache, check_cache
from kivi_jax.config import Format, KiviConfig
from kivi_jax.paged import PagedCache, merge


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Bytes a cache allocates, by component (all layers, all sequences).

    capacity_values counts the K and V values the allocation can hold (2 * layers * batch *
    kv_heads * capacity * head_dim), so bits_per_value_allocated is the cost per value at capacity.
    full_precision_bytes is the baseline, computed one way for both kinds of cache: the
    total_bytes of FullCaches of the same layers, batch, max_len, kv heads, head_dim and dtype (for
    a FullCache, its own total_bytes). side_bytes is a mixed-precision cache's side storage
    (kivi_jax.cache.MixedState: sinks, fine key planes and channel indices, heavy tokens with
    positions and scores, ring scores).

    A paged state (kivi_jax.paged.PagedCache) is counted by the same fields, its token-axis
    arrays being its pool's: pool_bytes is the pool (every page), table_bytes its page table
    (counted once for the layers of a tuple that share it),
    and slot_bytes the per-sequence part (the rest: rings, counters, side state, table);
    capacity_values counts the values the pool can hold. A contiguous state has pool_bytes 0.
    """

    codes_bytes: int
    scales_zeros_bytes: int
    residual_bytes: int
    counters_bytes: int
    full_precision_bytes: int
    capacity_values: int
    side_bytes: int = 0
    pool_bytes: int = 0
    table_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        parts = (self.codes_bytes, self.scales_zeros_bytes, self.residual_bytes, self.side_bytes)
        return sum(parts) + self.counters_bytes + self.table_bytes

    @property
    def slot_bytes(self) -> int:
        """The per-sequence part: everything but the pool."""
        return self.total_bytes - self.pool_bytes

    @property
    def bits_per_value_allocated(self) -> float:
        return 8 * self.total_bytes / self.capacity_values


def memory_report(cache: Cache | PagedCache | tuple) -> MemoryReport:
    """Exact bytes the arrays of `cache` occupy (one layer, or a tuple of layers: their sum)."""
    if isinstance(cache, tuple | list):
        if not cache:
            raise ValueError("memory_report: cache is an empty sequence; pass one or more caches")
        reports = [memory_report(c) for c in cache]
        fields = [f.name for f in dataclasses.fields(MemoryReport)]
        total = {name: sum(getattr(r, name) for r in reports) for name in fields}
        # the layers of a paged state share one page table: counted once
        tables = {id(c.table): c.table for c in cache if isinstance(c, PagedCache)}
        total["table_bytes"] = sum(t.size * t.dtype.itemsize for t in tables.values())
        return MemoryReport(**total)
    size = lambda *xs: sum(x.size * x.dtype.itemsize for x in xs)
    if isinstance(cache, PagedCache):
        flat = memory_report(merge(cache.rows, cache.pages))
        return dataclasses.replace(
            flat, pool_bytes=size(*jax.tree.leaves(cache.pages)), table_bytes=size(cache.table)
        )
    check_cache(cache)
    counters = size(cache.lengths, cache.overflow)
    # A FullCache's k and v: [batch, max_len, kv_heads, head_dim] each.
    full_kv = 2 * cache.batch * cache.max_len * cache.num_kv_heads * cache.head_dim
    full_precision_bytes = full_kv * cache.dtype.itemsize + counters
    if isinstance(cache, FullCache):
        return MemoryReport(
            codes_bytes=0,
            scales_zeros_bytes=0,
            residual_bytes=size(cache.k, cache.v),
            counters_bytes=counters,
            full_precision_bytes=full_precision_bytes,
            capacity_values=full_kv,
        )
    return MemoryReport(
        codes_bytes=size(cache.k_codes, cache.v_codes),
        scales_zeros_bytes=size(cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero),
        residual_bytes=size(*jax.tree.leaves(_rings(cache))),
        counters_bytes=counters,
        full_precision_bytes=full_precision_bytes,
        capacity_values=2 * cache.v_codes.size * (8 // cache.config.v_bits),
        side_bytes=size(*jax.tree.leaves(cache.side)),
    )


def _rings(cache) -> tuple:
    """A KiviCache's rings, and an INT8 residual's exponents (None otherwise)."""
    return cache.k_residual, cache.v_residual, cache.k_ring_exp, cache.v_ring_exp


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeldBits:
    """Bits that the K and V of `length` tokens occupy in one sequence's KV head.

    bits_per_value = total_bits / (2 * length * head_dim) counts the codes, the scales and zero
    points of the quantized tokens and the full-precision residual: the paper's "3 bits at G=32"
    counts only the first two. Of the `length` tokens, the first quantized_keys keys and
    quantized_values values are quantized (Qk = l - l % R, or Pv with sliding_keys, and
    Pv = max(l - R, 0), kivi_jax.cache), the rest are in the full-precision window; nothing is
    quantized while l < R. side_bits is a mixed-precision cache's side storage for these tokens:
    the fine key channels' low planes and channel indices, the sinks, the filled heavy slots
    (key, value, int32 position, float32 score) and, with Selection.MASS, a float32 score per
    token in the window. Scales and zeros, the window, the sinks and the heavy tokens count
    the bits of their storage format (KiviConfig's *_format: the dtype's, or 8 for float8;
    INT8 tokens 8 a value and 8 a token for the exponent); dtype_bits is the cache dtype's.
    """

    length: int
    quantized_keys: int
    quantized_values: int
    head_dim: int
    dtype_bits: int
    code_bits: int
    scale_zero_bits: int
    residual_bits: int
    side_bits: int = 0

    @property
    def total_bits(self) -> int:
        return self.code_bits + self.scale_zero_bits + self.residual_bits + self.side_bits

    @property
    def fp_bits(self) -> int:
        """What the same tokens cost in a full-precision cache of the same dtype."""
        return 2 * self.length * self.head_dim * self.dtype_bits

    @property
    def bits_per_value(self) -> float:
        return self.total_bits / (2 * self.length * self.head_dim) if self.length else 0.0

    @property
    def compression(self) -> float:
        """fp_bits / total_bits: how many times smaller than the full-precision cache."""
        return self.fp_bits / self.total_bits if self.total_bits else 1.0


def held_bits(
    config: KiviConfig | str | None, *, length: int, head_dim: int, dtype=jnp.bfloat16
) -> HeldBits:
    """Bits that `length` tokens cost in one sequence's KV head under `config` (None or "full":
    the full-precision cache; a preset's name, e.g. "kivi2", is taken as that preset).

    Raises ValueError/TypeError naming the argument: an unknown preset, a negative length, a
    head_dim that is not a positive int or that the config's group_size does not divide, a
    dtype that is not float32, bfloat16 or float16.
    """
    from kivi_jax.generate import resolve_kv  # the presets live with generate's `kv=`

    if isinstance(config, str):
        config = resolve_kv(config)
    elif config is not None and not isinstance(config, KiviConfig):
        raise TypeError(f"config must be a KiviConfig, a preset's name or None, got {config!r}")
    for name, value, least in (("length", length, 0), ("head_dim", head_dim, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if config is not None:
        config.check_head_dim(head_dim)
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                jnp.dtype(jnp.float16)):  # fmt: skip
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    w = jnp.dtype(dtype).itemsize * 8
    side = 0
    kw = vw = 2 * w  # bits of a key group's scale and zero, of a value group's
    rw = w  # bits of a full-precision token's key or value, per value
    tw = 0  # and per token (an INT8 residual's exponent)
    if config is None:
        qk = pv = 0
        k_bits = v_bits = g = 1
    else:
        kw, vw = (
            8 * (quantization.scale_dtype(p).itemsize + quantization.zero_dtype(p).itemsize)
            for p in (
                config.k_scale_format.params(dtype, config.k_bits),
                config.v_scale_format.params(dtype, config.v_bits),
            )
        )
        rw = jnp.dtype(config.residual_format.dtype(dtype)).itemsize * 8
        tw = 8 if config.residual_format is Format.INT8 else 0  # a token's int8 exponent
        g, r = config.group_size, config.residual_length
        pv = max(length - r, 0)
        qk = pv if config.sliding_keys else length - length % r
        k_bits, v_bits = config.k_bits, config.v_bits
        f, n, s = config.fine_key_channels, config.heavy_tokens, config.sinks
        side += qk * f * k_bits + 8 * f * qk // g  # low planes, channel indices
        side += min(length, s) * 2 * (head_dim * rw + tw)
        side += min(n, max(pv - s, 0)) * (2 * (head_dim * rw + tw) + 64)
        side += 32 * min(length, r) if config.needs_queries else 0
    return HeldBits(
        length=length,
        quantized_keys=qk,
        quantized_values=pv,
        head_dim=head_dim,
        dtype_bits=w,
        code_bits=(qk * k_bits + pv * v_bits) * head_dim,
        scale_zero_bits=(kw * qk + vw * pv) * head_dim // g,
        residual_bits=((length - qk) + (length - pv)) * (head_dim * rw + tw),
        side_bits=side,
    )
