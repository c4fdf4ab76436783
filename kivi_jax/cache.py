"""The KV state: a KIVI quantized cache and a full-precision cache with the same interface.

Both are pytrees of fixed-shape arrays plus static fields, so every function here traces once under
jit and the decode loop never reallocates. Functions take and return one layer's cache; a model
keeps one cache per layer (`init_cache(..., num_layers=L)` returns a tuple of L independent
caches), so that every array a decode step reads or writes is a buffer of its own: a jitted,
donated step updates it in place and hands it to the attention kernel without slicing it out of a
larger array.

Layout of `KiviCache` (one layer). B batch, H kv heads, D head_dim, G group_size,
R residual_length, C = capacity = max_len rounded up to a multiple of G, kpb = 8 // k_bits and
vpb = 8 // v_bits codes per byte (bit order: kivi_jax.quantization):

    k_codes    uint8 [B, H, C // kpb, D]   key codes, packed along tokens
    k_scale    dtype [B, H, C // G, D]     one (scale, zero) per channel per G tokens
    k_zero     dtype [B, H, C // G, D]
    v_codes    uint8 [B, H, C, D // vpb]   value codes, packed along channels
    v_scale    dtype [B, H, C, D // G]     one (scale, zero) per token per G channels
    v_zero     dtype [B, H, C, D // G]
    k_residual dtype [B, H, R, D]          the last min(l, R) keys, token t in slot t % R
    v_residual dtype [B, H, R, D]          the last min(l, R) values, token t in slot t % R
    lengths    int32 [B]                   tokens held per sequence (l)
    overflow   bool  [B]                   a write under jit would have exceeded max_len

For a sequence of length l (KIVI.md, Algorithm 1), attention reads

    keys   [0, Qk) quantized per channel, Qk = l - l % R;   keys   [Qk, l) from k_residual
    values [0, Pv) quantized per token,   Pv = max(l - R, 0); values [Pv, l) from v_residual

so keys flush R at a time and values slide one token at a time. Pv <= Qk, so a token can have a
quantized key and a full-precision value. What is stored:

    key codes, scales, zeros     of every complete group of G tokens, [0, l - l % G)
    value codes, scales, zeros   of the tokens [0, Pv)
    both rings                   the last min(l, R) tokens

A key group is quantized as soon as its G tokens are in (a decode step quantizes the one group
its token may complete, never the ring), so a flush writes nothing: it only moves Qk, and the
groups of [Qk, l - l % G) wait in the codes until it does. Every entry is either zero (never
written) or a function of the tokens it holds, so the state depends only on the tokens held, not
on how they arrived: prefill and token-by-token appends give bit-identical caches, and a step
writes the new token's ring slots, its leaving value's codes and, every G tokens, one key group.
Key groups start at token 0 of each sequence, and every quantized group consists of that
sequence's own tokens (padding of a ragged batch never enters a min or max).

`FullCache` stores k, v [B, max_len, H, D], token-major as cuDNN's attention reads them.

Capacity: outside jit, a write past max_len raises ValueError. Under jit the lengths are not known
at trace time: the tokens that do not fit are not stored, the length stops at max_len and the
row's `overflow` flag is set; check `cache.overflow` after a jitted loop (generate checks the
capacity before it runs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import quantization
from kivi_jax.config import KiviConfig

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "k_codes",
        "k_scale",
        "k_zero",
        "v_codes",
        "v_scale",
        "v_zero",
        "k_residual",
        "v_residual",
        "lengths",
        "overflow",
    ],
    meta_fields=["config", "max_len"],
)
@dataclasses.dataclass(frozen=True)
class KiviCache:
    """KIVI quantized KV state of one layer; layout: module doc."""

    k_codes: jax.Array
    k_scale: jax.Array
    k_zero: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_zero: jax.Array
    k_residual: jax.Array
    v_residual: jax.Array
    lengths: jax.Array
    overflow: jax.Array
    config: KiviConfig
    max_len: int

    @property
    def dtype(self):
        return self.k_residual.dtype

    @property
    def head_dim(self) -> int:
        return self.k_residual.shape[-1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_residual.shape[-3]

    @property
    def batch(self) -> int:
        return self.lengths.shape[-1]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k", "v", "lengths", "overflow"],
    meta_fields=["max_len"],
)
@dataclasses.dataclass(frozen=True)
class FullCache:
    """Full-precision KV state of one layer: k, v [B, max_len, H, D] (token-major), lengths [B]."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    overflow: jax.Array
    max_len: int

    @property
    def dtype(self):
        return self.k.dtype

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[-2]

    @property
    def batch(self) -> int:
        return self.lengths.shape[-1]


Cache = KiviCache | FullCache


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def init_cache(
    config: KiviConfig | None,
    *,
    batch: int,
    max_len: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
    num_layers: int | None = None,
) -> Cache | tuple[Cache, ...]:
    """An empty cache holding up to `max_len` tokens per sequence.

    Args:
      config: a KiviConfig for the quantized cache, or None for the full-precision cache.
      batch, max_len, num_kv_heads, head_dim: the fixed shape.
      dtype: dtype of the full-precision residual, the scales and zero points (float32, bfloat16
        or float16). Keys and values are cast to it on the way in.
      num_layers: if given, a tuple of that many independent caches (one per layer, each array
        a buffer of its own); otherwise one cache.
    """
    for name, value in [
        ("batch", batch),
        ("max_len", max_len),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ]:
        _check_positive_int(name, value)
    if num_layers is not None:
        _check_positive_int("num_layers", num_layers)
    dtype = jnp.dtype(dtype)
    if dtype not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
        raise ValueError(f"cache dtype must be float32, bfloat16 or float16, got {dtype}")
    if config is not None and not isinstance(config, KiviConfig):
        raise TypeError(f"config must be a KiviConfig or None, got {type(config).__name__}")

    lead = (batch, num_kv_heads)
    if config is None:
        shapes = dict(
            k=((batch, max_len, num_kv_heads, head_dim), dtype),
            v=((batch, max_len, num_kv_heads, head_dim), dtype),
        )
    else:
        config.check_head_dim(head_dim)
        g, r = config.group_size, config.residual_length
        cap = _round_up(max_len, g)
        kpb = quantization.codes_per_byte(config.k_bits)
        vpb = quantization.codes_per_byte(config.v_bits)
        shapes = dict(
            k_codes=((*lead, cap // kpb, head_dim), jnp.uint8),
            k_scale=((*lead, cap // g, head_dim), dtype),
            k_zero=((*lead, cap // g, head_dim), dtype),
            v_codes=((*lead, cap, head_dim // vpb), jnp.uint8),
            v_scale=((*lead, cap, head_dim // g), dtype),
            v_zero=((*lead, cap, head_dim // g), dtype),
            k_residual=((*lead, r, head_dim), dtype),
            v_residual=((*lead, r, head_dim), dtype),
        )
    shapes.update(lengths=((batch,), jnp.int32), overflow=((batch,), jnp.bool_))

    def one():
        arrays = {name: jnp.zeros(shape, dt) for name, (shape, dt) in shapes.items()}
        if config is None:
            return FullCache(**arrays, max_len=max_len)
        return KiviCache(**arrays, config=config, max_len=max_len)

    return one() if num_layers is None else tuple(one() for _ in range(num_layers))


def check_cache(cache) -> None:
    """Raises unless `cache` is one layer's KiviCache or FullCache."""
    if isinstance(cache, tuple | list):
        raise TypeError(
            f"expected one layer's cache, got a {type(cache).__name__} of {len(cache)} (the "
            f"caches of init_cache(..., num_layers=...)): pass one of them, caches[i]"
        )
    if not isinstance(cache, KiviCache | FullCache):
        raise TypeError(f"expected a KiviCache or FullCache, got {type(cache).__name__}")
    if cache.lengths.ndim != 1:
        raise ValueError(f"lengths must be [batch], got shape {cache.lengths.shape}")


def _is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_kv(cache: Cache, k: jax.Array, v: jax.Array, *, step: bool) -> None:
    what = "append" if step else "prefill"
    want = "[batch, kv_heads, head_dim]" if step else "[batch, seq, kv_heads, head_dim]"
    ndim = 3 if step else 4
    for name, x in (("k", k), ("v", v)):
        if x.ndim != ndim:
            raise ValueError(f"{what}: {name} must be {want}, got shape {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{what}: {name} must be floating point, got {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{what}: k and v shapes differ: {k.shape} vs {v.shape}")
    b, h, d = k.shape[0], k.shape[-2], k.shape[-1]
    if (b, h, d) != (cache.batch, cache.num_kv_heads, cache.head_dim):
        raise ValueError(
            f"{what}: k of shape {k.shape} does not match the cache (batch={cache.batch}, "
            f"kv_heads={cache.num_kv_heads}, head_dim={cache.head_dim}); expected {want}"
        )


def prefill(cache: Cache, k: jax.Array, v: jax.Array, lengths: jax.Array | None = None) -> Cache:
    """Adds a chunk of tokens to every sequence.

    Args:
      cache: one layer's cache, empty or already holding tokens.
      k, v: [batch, seq, kv_heads, head_dim], cast to the cache dtype.
      lengths: [batch] ints, how many of the `seq` positions of each row are real (right padding);
        default: all of them.

    Returns:
      The cache holding the new tokens after the old ones: exactly the state that appending them
      one at a time would give (chunked prefill, multi-turn chat).
    """
    check_cache(cache)
    _check_kv(cache, k, v, step=False)
    seq = k.shape[1]
    if lengths is None:
        counts = jnp.full((cache.batch,), seq, jnp.int32)
    else:
        counts = jnp.asarray(lengths)
        if counts.shape != (cache.batch,) or not jnp.issubdtype(counts.dtype, jnp.integer):
            raise ValueError(
                f"prefill: lengths must be integers of shape ({cache.batch},), got "
                f"{counts.dtype}{list(counts.shape)}"
            )
        if _is_concrete(counts):
            bad = np.flatnonzero((np.asarray(counts) < 0) | (np.asarray(counts) > seq))
            if bad.size:
                raise ValueError(
                    f"prefill: lengths must lie in [0, seq={seq}]; rows {bad.tolist()} have "
                    f"{np.asarray(counts)[bad].tolist()}"
                )
        counts = jnp.clip(counts.astype(jnp.int32), 0, seq)
    return _extend(cache, k, v, counts)


def append(cache: Cache, k: jax.Array, v: jax.Array, active: jax.Array | None = None) -> Cache:
    """Adds one decode step's key and value to every active sequence.

    Args:
      cache: one layer's cache.
      k, v: [batch, kv_heads, head_dim].
      active: [batch] bools; rows that are False are left untouched. Default: all rows.

    Returns:
      The updated cache, any flush included (the order of KIVI's Algorithm 1: decode_attention
      afterwards reads the state that holds the new token).
    """
    check_cache(cache)
    _check_kv(cache, k, v, step=True)
    if active is None:
        counts = jnp.ones((cache.batch,), jnp.int32)
    else:
        active = jnp.asarray(active)
        if active.shape != (cache.batch,) or active.dtype != jnp.bool_:
            raise ValueError(
                f"append: active must be bools of shape ({cache.batch},), got "
                f"{active.dtype}{list(active.shape)}"
            )
        counts = active.astype(jnp.int32)
    return _extend(cache, k[:, None], v[:, None], counts)


def _extend(cache: Cache, k: jax.Array, v: jax.Array, counts: jax.Array) -> Cache:
    """Appends counts[b] tokens of k, v [B, S, H, D] to each row b."""
    if _is_concrete(cache.lengths, counts):
        new = np.asarray(cache.lengths) + np.asarray(counts)
        bad = np.flatnonzero(new > cache.max_len)
        if bad.size:
            raise ValueError(
                f"cache capacity exceeded: max_len={cache.max_len}, but rows {bad.tolist()} "
                f"would hold {new[bad].tolist()} tokens"
            )
    return _extend_jit(cache, k, v, counts)


@jax.jit
def _extend_jit(cache: Cache, k: jax.Array, v: jax.Array, counts: jax.Array) -> Cache:
    old = cache.lengths
    fits = jnp.minimum(counts, cache.max_len - old)
    new = old + fits
    k, v = k.astype(cache.dtype), v.astype(cache.dtype)
    if isinstance(cache, FullCache):
        pos = old[:, None] + jnp.arange(k.shape[1])  # [B, S]
        pos = _drop_unless(pos < new[:, None], pos)
        updates = dict(k=_scatter(cache.k, pos, k, axis=1), v=_scatter(cache.v, pos, v, axis=1))
    else:
        # [B, S, H, D] -> [B, H, S, D], the quantized cache's heads-major order.
        updates = _extend_kivi(cache, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), old, new)
    return dataclasses.replace(
        cache, **updates, lengths=new, overflow=cache.overflow | (fits < counts)
    )


# An index that `_scatter` drops (mode="drop" discards out-of-range writes).
_DROP = np.iinfo(np.int32).max


def _drop_unless(valid: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.where(valid, index, _DROP)


def _scatter(buf: jax.Array, index: jax.Array, values: jax.Array, *, axis: int) -> jax.Array:
    """buf[b, ..., index[b, j], ...] = values[b, ..., j, ...] along `axis` (>= 1) per row b;
    writes at index _DROP are discarded. index [B, J]; values are buf's shape with J at `axis`."""

    def row(x, i, u):
        return x.at[(slice(None),) * (axis - 1) + (i,)].set(
            u, mode="drop", wrap_negative_indices=False
        )

    return jax.vmap(row)(buf, index, values)


def _gather(buf: jax.Array, index: jax.Array) -> jax.Array:
    """buf[b, :, index[b, j]] per row: buf [B, H, N, D], index [B, J] in [0, N) -> [B, H, J, D]."""
    return jnp.take_along_axis(
        buf, index[:, None, :, None], axis=2, mode="promise_in_bounds", wrap_negative_indices=False
    )


def _ring_step(ring, new, start, old, width: int, keep):
    """One pass over a ring (token t at slot t % R): reads the window of tokens
    [start, start + width) (those below `old` from the ring, the rest from the new tokens) and
    writes the new tokens where `keep`, reading the ring once.

    ring [B, H, R, D], new [B, H, S, D] (tokens old, old + 1, ...), start and old [B],
    keep [B, S] -> (window [B, H, width, D], the updated ring).
    """
    j = start[:, None] + jnp.arange(width)  # [B, width] the window's tokens
    t = old[:, None] + jnp.arange(new.shape[2])  # [B, S] the new tokens
    slot = t % ring.shape[2]
    read = _gather(ring, jnp.concatenate([j % ring.shape[2], slot], axis=1))
    from_new = _gather(new, jnp.clip(j - old[:, None], 0, new.shape[2] - 1))
    window = jnp.where((j < old[:, None])[:, None, :, None], read[:, :, :width], from_new)
    # The written values depend on the read (a slot not written keeps its old contents), so
    # XLA orders the read first and updates the ring in place instead of copying it.
    values = jnp.where(keep[:, None, :, None], new, read[:, :, width:])
    return window, _scatter(ring, _drop_unless(keep, slot), values, axis=2)


def _extend_kivi(
    cache: KiviCache,
    k: jax.Array,  # [B, H, S, D]
    v: jax.Array,  # [B, H, S, D]
    old: jax.Array,  # [B] lengths before
    new: jax.Array,  # [B] lengths after
) -> dict[str, jax.Array]:
    """The arrays with the new tokens written: only their entries change (module doc)."""
    cfg = cache.config
    g, r, dtype = cfg.group_size, cfg.residual_length, cache.dtype
    seq = k.shape[2]
    kpb = quantization.codes_per_byte(cfg.k_bits)

    # Both rings take the new tokens that are among the last R, each at its slot t % R.
    t = old[:, None] + jnp.arange(seq)  # [B, seq]
    keep = (t < new[:, None]) & (t >= new[:, None] - r)

    # Keys: the groups from g0, the start of the group the old tokens left open (its first
    # old - g0 < G tokens are in the ring), to `done`, the end of the complete groups.
    g0, done = old - old % g, new - new % g
    width = _round_up(g - 1 + seq, g)
    win, k_ring = _ring_step(cache.k_residual, k, g0, old, width, keep)  # [B, H, width, D]
    codes, k_scale, k_zero = quantization.quantize(win, cfg.k_bits, g, axis=2, dtype=dtype)
    k_codes = quantization.pack_codes(codes, cfg.k_bits, axis=2)  # [B, H, width // kpb, D]
    jb, jg = jnp.arange(width // kpb), jnp.arange(width // g)
    byte_pos = _drop_unless(jb * kpb < (done - g0)[:, None], g0[:, None] // kpb + jb)
    group_pos = _drop_unless(jg * g < (done - g0)[:, None], g0[:, None] // g + jg)

    # Values: the tokens [p0, p1) leave the window (p1 - p0 <= seq), read from the ring before
    # the new tokens take their slots, then from the new tokens.
    p0, p1 = jnp.maximum(old - r, 0), jnp.maximum(new - r, 0)
    win, v_ring = _ring_step(cache.v_residual, v, p0, old, seq, keep)  # [B, H, seq, D]
    codes, v_scale, v_zero = quantization.quantize(win, cfg.v_bits, g, axis=3, dtype=dtype)
    v_codes = quantization.pack_codes(codes, cfg.v_bits, axis=3)  # [B, H, seq, D // vpb]
    pos = p0[:, None] + jnp.arange(seq)
    out = _drop_unless(pos < p1[:, None], pos)

    writes = dict(
        k_codes=(byte_pos, k_codes),
        k_scale=(group_pos, k_scale),
        k_zero=(group_pos, k_zero),
        v_codes=(out, v_codes),
        v_scale=(out, v_scale),
        v_zero=(out, v_zero),
    )
    updated = {name: _scatter(getattr(cache, name), *w, axis=2) for name, w in writes.items()}
    return updated | dict(k_residual=k_ring, v_residual=v_ring)


def dequantized_heads_major(cache: Cache) -> tuple[jax.Array, jax.Array]:
    """What the cache represents, in float32: k, v [B, H, C, D], zero at positions >= length.

    C is the allocated capacity (>= max_len). This is the plain-jnp view that references and
    tests read; kernels read the packed state instead.
    """
    check_cache(cache)
    if isinstance(cache, FullCache):  # [B, T, H, D] -> [B, H, T, D]
        k, v = (jnp.swapaxes(x, 1, 2).astype(jnp.float32) for x in (cache.k, cache.v))
    else:
        cfg = cache.config
        g, r = cfg.group_size, cfg.residual_length
        kq = quantization.dequantize(
            quantization.unpack_codes(cache.k_codes, cfg.k_bits, axis=2),
            cache.k_scale,
            cache.k_zero,
            g,
            axis=2,
        )
        vq = quantization.dequantize(
            quantization.unpack_codes(cache.v_codes, cfg.v_bits, axis=3),
            cache.v_scale,
            cache.v_zero,
            g,
            axis=3,
        )
        t = jnp.arange(kq.shape[2])
        n = cache.lengths[:, None, None, None]
        k_res = jnp.take(cache.k_residual, t % r, axis=2).astype(jnp.float32)
        v_res = jnp.take(cache.v_residual, t % r, axis=2).astype(jnp.float32)
        k = jnp.where(t[:, None] < n - n % r, kq, k_res)
        v = jnp.where(t[:, None] < jnp.maximum(n - r, 0), vq, v_res)
    held = jnp.arange(k.shape[2])[:, None] < cache.lengths[:, None, None, None]
    return jnp.where(held, k, 0.0), jnp.where(held, v, 0.0)


def dequantize(cache: Cache, dtype=None) -> tuple[jax.Array, jax.Array]:
    """What the cache currently represents: (k, v), each [batch, max_len, kv_heads, head_dim].

    Quantized tokens are reconstructed as code * scale + zero; residual tokens are returned as
    stored; positions at or beyond a sequence's length are zero. dtype defaults to the cache
    dtype; pass jnp.float32 for the reconstruction without a final rounding.
    """
    k, v = dequantized_heads_major(cache)
    dtype = cache.dtype if dtype is None else dtype
    # [B, H, C, D] -> [B, max_len, H, D]
    return tuple(jnp.swapaxes(x[:, :, : cache.max_len], 1, 2).astype(dtype) for x in (k, v))
