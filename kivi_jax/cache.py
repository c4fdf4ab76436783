"""The KV state: a KIVI quantized cache and a full-precision cache with the same interface.

Both are pytrees of fixed-shape arrays plus static fields, so every function here traces once under
jit and the decode loop never reallocates. Functions take and return one layer's cache; with
`num_layers`, `init_cache` stacks every array on a leading layer axis for `lax.scan`.

Layout of `KiviCache` (one layer). B batch, H kv heads, D head_dim, G group_size,
R residual_length, C = capacity = max_len rounded up to a multiple of G, kpb = 8 // k_bits and
vpb = 8 // v_bits codes per byte (bit order: kivi_jax.quantization):

    k_codes    uint8 [B, H, C // kpb, D]   key codes, packed along tokens
    k_scale    dtype [B, H, C // G, D]     one (scale, zero) per channel per G tokens
    k_zero     dtype [B, H, C // G, D]
    v_codes    uint8 [B, H, C, D // vpb]   value codes, packed along channels
    v_scale    dtype [B, H, C, D // G]     one (scale, zero) per token per G channels
    v_zero     dtype [B, H, C, D // G]
    k_residual dtype [B, H, R, D]          full-precision keys, token t in slot t % R
    v_residual dtype [B, H, R, D]          full-precision values, token t in slot t % R
    lengths    int32 [B]                   tokens held per sequence (l)
    overflow   bool  [B]                   a write under jit would have exceeded max_len

For a sequence of length l (KIVI.md, Algorithm 1):

    keys   [0, Qk) quantized per channel, Qk = l - l % R;   keys   [Qk, l) in k_residual
    values [0, Pv) quantized per token,   Pv = max(l - R, 0); values [Pv, l) in v_residual

so keys flush R at a time and values slide one token at a time. Pv <= Qk, so a token can have a
quantized key and a full-precision value. Entries outside these ranges are zero (the state depends
only on the tokens held, not on how they arrived); readers still mask by length. Key groups start
at token 0 of each sequence, and every quantized group consists of that sequence's own tokens
(padding of a ragged batch never enters a min or max).

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
    """KIVI quantized KV state of one layer (or all layers, stacked); layout: module doc."""

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
    """Full-precision KV state of one layer (or stacked): k, v [B, H, max_len, D], lengths [B]."""

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
        return self.k.shape[-3]

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
) -> Cache:
    """An empty cache holding up to `max_len` tokens per sequence.

    Args:
      config: a KiviConfig for the quantized cache, or None for the full-precision cache.
      batch, max_len, num_kv_heads, head_dim: the fixed shape.
      dtype: dtype of the full-precision residual, the scales and zero points (float32, bfloat16
        or float16). Keys and values are cast to it on the way in.
      num_layers: if given, every array gains a leading axis of this size (one cache per layer).
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
            k=((*lead, max_len, head_dim), dtype),
            v=((*lead, max_len, head_dim), dtype),
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
    layer = () if num_layers is None else (num_layers,)
    arrays = {name: jnp.zeros(layer + shape, dt) for name, (shape, dt) in shapes.items()}
    if config is None:
        return FullCache(**arrays, max_len=max_len)
    return KiviCache(**arrays, config=config, max_len=max_len)


def layer(cache: Cache, index) -> Cache:
    """The cache of one layer from a cache stacked with `num_layers`."""
    _check_stacked(cache, stacked=True)
    return jax.tree.map(lambda x: x[index], cache)


def _check_stacked(cache: Cache, *, stacked: bool) -> None:
    if not isinstance(cache, KiviCache | FullCache):
        raise TypeError(f"expected a KiviCache or FullCache, got {type(cache).__name__}")
    ndim = cache.lengths.ndim
    if stacked and ndim != 2:
        raise ValueError("this cache has no layer axis (it was made without num_layers)")
    if not stacked and ndim != 1:
        raise ValueError(
            f"this cache has a leading layer axis of size {cache.lengths.shape[0]}; pass one "
            f"layer's cache (kivi_jax.layer(cache, i), or lax.scan over the layers)"
        )


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


def prefill(
    cache: Cache, k: jax.Array, v: jax.Array, lengths: jax.Array | None = None, *, layer=None
) -> Cache:
    """Adds a chunk of tokens to every sequence.

    Args:
      cache: one layer's cache, empty or already holding tokens (with `layer`: a stacked cache).
      k, v: [batch, seq, kv_heads, head_dim], cast to the cache dtype.
      lengths: [batch] ints, how many of the `seq` positions of each row are real (right padding);
        default: all of them.
      layer: optional int (may be traced). The cache is then stacked (made with num_layers) and
        only this layer is written, in place under jit: a model's layer scan can carry the whole
        stacked cache and update it without copying it.

    Returns:
      The cache holding the new tokens after the old ones: exactly the state that appending them
      one at a time would give (chunked prefill, multi-turn chat).
    """
    _check_stacked(cache, stacked=layer is not None)
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
    return _extend(cache, k, v, counts, layer)


def append(
    cache: Cache, k: jax.Array, v: jax.Array, active: jax.Array | None = None, *, layer=None
) -> Cache:
    """Adds one decode step's key and value to every active sequence.

    Args:
      cache: one layer's cache (with `layer`: a stacked cache).
      k, v: [batch, kv_heads, head_dim].
      active: [batch] bools; rows that are False are left untouched. Default: all rows.
      layer: optional int (may be traced): update only this layer of a stacked cache, in place
        (see `prefill`).

    Returns:
      The updated cache, any flush included (the order of KIVI's Algorithm 1: decode_attention
      afterwards reads the state that holds the new token).
    """
    _check_stacked(cache, stacked=layer is not None)
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
    return _extend(cache, k[:, None], v[:, None], counts, layer)


def _extend(cache: Cache, k: jax.Array, v: jax.Array, counts: jax.Array, layer) -> Cache:
    """Appends counts[b] tokens of k, v [B, S, H, D] to each row b (of one layer if given)."""
    old = cache.lengths if layer is None else cache.lengths[layer]
    if _is_concrete(old, counts):
        new = np.asarray(old) + np.asarray(counts)
        bad = np.flatnonzero(new > cache.max_len)
        if bad.size:
            raise ValueError(
                f"cache capacity exceeded: max_len={cache.max_len}, but rows {bad.tolist()} "
                f"would hold {new[bad].tolist()} tokens"
            )
    return _extend_jit(cache, k, v, counts, layer)


@jax.jit
def _extend_jit(cache: Cache, k: jax.Array, v: jax.Array, counts: jax.Array, layer) -> Cache:
    read = (lambda x: x) if layer is None else (lambda x: x[layer])
    old = read(cache.lengths)
    fits = jnp.minimum(counts, cache.max_len - old)
    new = old + fits
    # [B, S, H, D] -> [B, H, S, D], the cache's heads-major order.
    k = jnp.swapaxes(k, 1, 2).astype(cache.dtype)
    v = jnp.swapaxes(v, 1, 2).astype(cache.dtype)
    if isinstance(cache, FullCache):
        pos = old[:, None] + jnp.arange(k.shape[2])  # [B, S]
        pos = _drop_unless(pos < new[:, None], pos)
        scatters, replaced = dict(k=(pos, k), v=(pos, v)), {}
    else:
        scatters, replaced = _extend_kivi(cache, read, k, v, old, new)
    replaced.update(lengths=new, overflow=read(cache.overflow) | (fits < counts))
    updates = {name: _scatter(getattr(cache, name), *w, layer) for name, w in scatters.items()}
    for name, value in replaced.items():
        updates[name] = value if layer is None else getattr(cache, name).at[layer].set(value)
    return dataclasses.replace(cache, **updates)


# An index that `_scatter` drops (mode="drop" discards out-of-range writes).
_DROP = np.iinfo(np.int32).max


def _drop_unless(valid: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.where(valid, index, _DROP)


def _scatter(buf: jax.Array, index: jax.Array, values: jax.Array, layer=None) -> jax.Array:
    """buf[b, :, index[b, j]] = values[b, :, j] per row b; writes at index _DROP are discarded.

    buf [B, H, N, ...] (or [L, B, H, N, ...], written at `layer` only), index [B, J],
    values [B, H, J, ...].
    """
    if layer is None:
        row = lambda x, i, u: x.at[:, i].set(u, mode="drop")
        return jax.vmap(row)(buf, index, values)
    rows = jnp.arange(index.shape[0])[:, None]
    # Advanced indices (layer, rows, index) around a slice: the update is [B, J, H, ...].
    return buf.at[layer, rows, :, index].set(jnp.moveaxis(values, 2, 1), mode="drop")


def _gather(buf: jax.Array, index: jax.Array) -> jax.Array:
    """buf[b, :, index[b, j]] per row: buf [B, H, N, D], index [B, J] -> [B, H, J, D]."""
    return jnp.take_along_axis(buf, index[:, None, :, None], axis=2)


def _window(
    residual: jax.Array, res_index: jax.Array, n_res: jax.Array, new: jax.Array, width: int
) -> jax.Array:
    """Per row, the old residual tokens (n_res of them, read at res_index) followed by new tokens.

    residual [B, H, R, D], res_index [B, width], n_res [B], new [B, H, S, D] -> [B, H, width, D].
    """
    j = jnp.arange(width)
    from_new = jnp.clip(j[None, :] - n_res[:, None], 0, new.shape[2] - 1)  # [B, width]
    use_res = (j[None, :] < n_res[:, None])[:, None, :, None]
    return jnp.where(use_res, _gather(residual, res_index), _gather(new, from_new))


def _residual(win: jax.Array, index: jax.Array, held: jax.Array) -> jax.Array:
    """The new residual: slot s = win[b, :, index[b, s]] where held[b, s], else zero.

    Rewriting every slot (stale ones as zero) makes the state a function of the tokens alone, so
    prefill and token-by-token appends give bit-identical caches.
    win [B, H, W, D], index and held [B, R] -> [B, H, R, D].
    """
    index = jnp.clip(index, 0, win.shape[2] - 1)
    return jnp.where(held[:, None, :, None], _gather(win, index), jnp.zeros((), win.dtype))


def _extend_kivi(
    cache: KiviCache,
    read,  # one layer's view of a cache array
    k: jax.Array,  # [B, H, S, D]
    v: jax.Array,  # [B, H, S, D]
    old: jax.Array,  # [B] lengths before
    new: jax.Array,  # [B] lengths after
):
    """The writes that add the new tokens: (scatters {field: (index, values)}, {field: value})."""
    cfg = cache.config
    g, r, dtype = cfg.group_size, cfg.residual_length, cache.dtype
    seq = k.shape[2]

    # Keys. The window starts at the old quantized count q0 (a multiple of R), holds the old key
    # residual (tokens [q0, old), slots 0..) and then the new tokens; tokens [q0, q1) are flushed.
    q0, q1 = old - old % r, new - new % r
    width = r + _round_up(seq, g)
    j = jnp.arange(width)
    slot = jnp.broadcast_to(j % r, (cache.batch, width))
    win = _window(read(cache.k_residual), slot, old - q0, k, width)  # [B, H, width, D]
    codes, scale, zero = quantization.quantize(win, cfg.k_bits, g, axis=2, dtype=dtype)
    packed = quantization.pack_codes(codes, cfg.k_bits, axis=2)  # [B, H, width // kpb, D]
    kpb = quantization.codes_per_byte(cfg.k_bits)
    jb, jg = jnp.arange(width // kpb), jnp.arange(width // g)
    byte_pos = _drop_unless(jb[None] * kpb < (q1 - q0)[:, None], q0[:, None] // kpb + jb[None])
    group_pos = _drop_unless(jg[None] * g < (q1 - q0)[:, None], q0[:, None] // g + jg[None])
    scatters = dict(
        k_codes=(byte_pos, packed), k_scale=(group_pos, scale), k_zero=(group_pos, zero)
    )
    # Slot s now holds token q1 + s (window index q1 - q0 + s) while that token is held.
    s = jnp.arange(r)
    k_residual = _residual(win, (q1 - q0)[:, None] + s, s < (new - q1)[:, None])

    # Values. The window starts at the old residual start p0 and holds min(old, R) residual tokens
    # then the new ones; tokens [p0, p1) leave the window quantized, [p1, new) stay in it.
    p0, p1 = jnp.maximum(old - r, 0), jnp.maximum(new - r, 0)
    width = r + seq
    j = jnp.arange(width)
    pos = p0[:, None] + j[None]  # [B, width] absolute token positions
    win = _window(read(cache.v_residual), pos % r, old - p0, v, width)
    codes, scale, zero = quantization.quantize(win, cfg.v_bits, g, axis=3, dtype=dtype)
    packed = quantization.pack_codes(codes, cfg.v_bits, axis=3)  # [B, H, width, D // vpb]
    out = _drop_unless(pos < p1[:, None], pos)
    # Slot s now holds the token t in [p1, p1 + R) with t % R == s, while t < new.
    t = p1[:, None] + (s[None] - p1[:, None]) % r  # [B, R]
    v_residual = _residual(win, t - p0[:, None], t < new[:, None])
    scatters.update(v_codes=(out, packed), v_scale=(out, scale), v_zero=(out, zero))
    return scatters, dict(k_residual=k_residual, v_residual=v_residual)


def dequantized_heads_major(cache: Cache) -> tuple[jax.Array, jax.Array]:
    """What the cache represents, in float32: k, v [B, H, C, D], zero at positions >= length.

    C is the allocated capacity (>= max_len). This is the plain-jnp view that references and
    tests read; kernels read the packed state instead.
    """
    _check_stacked(cache, stacked=False)
    if isinstance(cache, FullCache):
        k, v = cache.k.astype(jnp.float32), cache.v.astype(jnp.float32)
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
