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
    overflow   bool  [B]                   a write under jit would have exceeded max_len,
                                           or prefill's lengths lay outside [0, seq]

`dtype` above is the cache dtype unless the config stores a part in 8 bits (KiviConfig's
k_scale_format, v_scale_format, residual_format: config.Format): the key or value scales and
zeros, or the rings (and a mixed state's sinks and heavy tokens), are then float8 arrays; a
float8 residual rounds every token to it as it enters (`entering_tokens`), so the groups are
quantized from the rounded tokens (docs/design.md, "Storage formats"). An INT8 residual
(Format.INT8) holds each token as int8 codes and a power-of-two scale 2^e
(quantization.encode_int8_tokens), the rings' codes in k_residual / v_residual (int8) and
their exponents in

    k_ring_exp int8  [B, H, R]                 e of the token in each key ring slot
    v_ring_exp int8  [B, H, R]                 e of the token in each value ring slot

(None for the other formats; a mixed state's sinks and heavy tokens likewise: extra_k_exp, ...);
every token is rounded to it as it enters, and these values are a fixed point of encoding,
so a token read from the ring and stored again (a heavy token) keeps its value.

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

Mixed precision (`KiviConfig` with sinks, sliding_keys, fine_key_channels or heavy_tokens, e.g.
KIVI2_MIX; plain configs hold `side=None` and are exactly the layout above). S sinks,
F fine key channels, N heavy tokens, b = k_bits; `side` (a `MixedState`) holds

    extra_k, extra_v dtype  [B, H, S + N, D]   the full-precision extras' keys and values:
                                               slots [0, S) the sinks, tokens [0, min(l, S))
                                               as they arrived (slot t); slots [S, S + N) the
                                               heavy tokens, by position (`sink_k`, `heavy_k`,
                                               ... read them apart)
    fine_codes      uint8   [B, H, C // kpb, F] low b bits of the fine channels' codes
    fine_channels   uint8   [B, H, C // G, F]   each key group's F fine channels, ascending
    heavy_pos       int32   [B, H, N]          the heavy tokens' positions, -1 for an empty
                                               slot (at the end)
    heavy_score     float32 [B, H, N]          their scores, -inf for an empty slot
    ring_score      float32 [B, H, R]          (selection MASS) mass received so far by the
                                               ring's tokens, token t in slot t % R

(a part whose size is 0 is None). What attention reads for token t of a sequence of length l:

    t < S                      the sinks (full precision)
    t >= Qk (keys), >= Pv (v)  the rings; with sliding_keys Qk = Pv = max(l - R, 0)
    t in heavy_pos             the heavy tokens (full precision)
    otherwise                  the codes

- Sinks: the first key group's scale and zero are taken over its tokens [S, G) (the sinks'
  own codes in it encode token S and are never read).
- Fine key channels: in every key group, the F channels of widest range (max - min over the
  group's non-sink tokens; ties to the lower channel) are quantized with 2b bits, code
  q = hi * 2^b + lo: hi goes into k_codes, lo into fine_codes, and k_scale holds 2^b * s
  (s the 2b-bit step), so k_codes, k_scale and k_zero alone read as a coarse b-bit key and
  lo * k_scale / 2^b refines it. Dequantized: q * (k_scale / 2^b) + k_zero.
- Heavy tokens: a token t >= S is a candidate when it leaves the value window (when token
  t + R arrives); its full-precision key and value are read from the rings before the slots
  are overwritten. The slots hold the N best candidates so far by (score descending,
  position ascending) in position order; a token pushed out falls back to its codes.
  Its score (config.selection): ERROR, ||k - k'||^2 + ||v - v'||^2 (k' its key as the codes
  read it, v' its 2-bit value), summed in a fixed order; MASS, the attention mass it received
  from its own and the next R - 1 queries, each query's softmax taken over the
  full-precision keys it sees (the sinks and the window [i + 1 - R, i]) and summed over the
  query heads of its KV head. MASS needs the queries: `prefill(..., q=)`, `append(..., q=)`.

With ERROR (or no heavy tokens) every entry is still zero, a constant or a function of the
tokens, and prefill equals appends bit-identically. With MASS the scores are a function of the
tokens and the queries: given the same queries, prefill and appends differ only in the order in
which a token's R contributions are summed (float rounding), so a near tie between two
candidates could go the other way; and in the model a prefill's queries come from the
full-precision prompt pass while decoding's come from the cache, so their scores differ.

`FullCache` stores k, v [B, max_len, H, D], token-major as cuDNN's attention reads them.

Capacity: outside jit, a write past max_len raises ValueError. Under jit the lengths are not known
at trace time: the tokens that do not fit are not stored, the length stops at max_len and the
row's `overflow` flag is set; check `cache.overflow` after a jitted loop (generate checks the
capacity before it runs). Likewise prefill's `lengths`: outside jit a row outside [0, seq]
raises ValueError; under jit it is clipped to [0, seq] and the row's `overflow` is set.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import quantization
from kivi_jax.config import Format, KiviConfig, Range

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "extra_k",
        "extra_v",
        "fine_codes",
        "fine_channels",
        "heavy_pos",
        "heavy_score",
        "ring_score",
        "extra_k_exp",
        "extra_v_exp",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class MixedState:
    """The mixed-precision side storage of one layer's KiviCache (module doc); parts of size 0
    are None. The sinks and the heavy tokens are held in one array each for keys and values
    (the extras: sinks first), so that attention reads them without joining them."""

    extra_k: jax.Array | None
    extra_v: jax.Array | None
    fine_codes: jax.Array | None
    fine_channels: jax.Array | None
    heavy_pos: jax.Array | None
    heavy_score: jax.Array | None
    ring_score: jax.Array | None
    extra_k_exp: jax.Array | None = None  # Format.INT8: [B, H, S + N] int8 exponents
    extra_v_exp: jax.Array | None = None

    @property
    def sinks(self) -> int:
        """S, the extras' first slots."""
        if self.extra_k is None:
            return 0
        return self.extra_k.shape[2] - (0 if self.heavy_pos is None else self.heavy_pos.shape[2])

    def sink_part(self, x: jax.Array | None) -> jax.Array | None:
        """The sinks' slots of an extras array x [B, H, S + N, ...] (None where S = 0)."""
        return None if x is None or not self.sinks else x[:, :, : self.sinks]

    def heavy_part(self, x: jax.Array | None) -> jax.Array | None:
        """The heavy slots of an extras array x [B, H, S + N, ...] (None where N = 0)."""
        return None if x is None or self.heavy_pos is None else x[:, :, self.sinks :]

    sink_k = property(lambda self: self.sink_part(self.extra_k), doc="[B, H, S, D] or None")
    sink_v = property(lambda self: self.sink_part(self.extra_v), doc="[B, H, S, D] or None")
    heavy_k = property(lambda self: self.heavy_part(self.extra_k), doc="[B, H, N, D] or None")
    heavy_v = property(lambda self: self.heavy_part(self.extra_v), doc="[B, H, N, D] or None")


# A KiviCache's per-head arrays (its layout: the module doc).
_KIVI_ARRAYS = (
    "k_codes",
    "k_scale",
    "k_zero",
    "v_codes",
    "v_scale",
    "v_zero",
    "k_residual",
    "v_residual",
)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[*_KIVI_ARRAYS, "lengths", "overflow", "side", "k_ring_exp", "v_ring_exp"],
    meta_fields=["config", "max_len", "dtype"],
)
@dataclasses.dataclass(frozen=True)
class KiviCache:
    """KIVI quantized KV state of one layer; layout: module doc. `side` is None for a plain
    config and the MixedState of a mixed-precision one. `dtype` is the cache dtype (init_cache's),
    in which tokens enter and the parts in Format.CACHE are stored."""

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
    dtype: jnp.dtype
    side: MixedState | None = None
    k_ring_exp: jax.Array | None = None  # Format.INT8: [B, H, R] int8 exponents
    v_ring_exp: jax.Array | None = None

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


# The layout invariant that slot insertion (kivi_jax.serving) and sharding rely on: every array
# of a cache, MixedState included, holds one row per sequence on axis BATCH_AXIS (a
# kivi_jax.paged pool: one page), and its KV-head axis is the one named here (None: the array
# has no head axis). A layout change updates this
# table, and tests/test_cache.py checks it against every kind of cache.
BATCH_AXIS = 0
KV_HEAD_AXIS: dict[str, int | None] = {
    **dict.fromkeys([*_KIVI_ARRAYS, "k_ring_exp", "v_ring_exp"], 1),
    **dict.fromkeys([f.name for f in dataclasses.fields(MixedState)], 1),
    "k": 2,  # FullCache, token-major
    "v": 2,
    "lengths": None,
    "overflow": None,
    "table": None,  # kivi_jax.paged.PagedCache's page table [B, max_pages]
}


def kv_head_axis(path) -> int | None:
    """The KV-head axis of the cache array at `path` (a key path of
    `jax.tree_util.tree_map_with_path` over a cache or a tuple of caches), None if it has none."""
    return KV_HEAD_AXIS[path[-1].name]


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
        kp = config.k_scale_format.params(dtype, config.k_bits)
        vp = config.v_scale_format.params(dtype, config.v_bits)
        ring = config.residual_format.dtype(dtype)
        shapes = dict(
            k_codes=((*lead, cap // kpb, head_dim), jnp.uint8),
            k_scale=((*lead, cap // g, head_dim), quantization.scale_dtype(kp)),
            k_zero=((*lead, cap // g, head_dim), quantization.zero_dtype(kp)),
            v_codes=((*lead, cap, head_dim // vpb), jnp.uint8),
            v_scale=((*lead, cap, head_dim // g), quantization.scale_dtype(vp)),
            v_zero=((*lead, cap, head_dim // g), quantization.zero_dtype(vp)),
            k_residual=((*lead, r, head_dim), ring),
            v_residual=((*lead, r, head_dim), ring),
        )
        if config.residual_format is Format.INT8:
            shapes |= dict(k_ring_exp=((*lead, r), jnp.int8), v_ring_exp=((*lead, r), jnp.int8))
    shapes.update(lengths=((batch,), jnp.int32), overflow=((batch,), jnp.bool_))
    side_shapes = {} if config is None else _side_shapes(config, lead, cap, head_dim, ring)

    def one():
        arrays = {name: jnp.zeros(shape, dt) for name, (shape, dt) in shapes.items()}
        if config is None:
            return FullCache(**arrays, max_len=max_len)
        side = None
        if config.mixed:
            fill = dict(heavy_pos=-1, heavy_score=-jnp.inf)
            parts = {
                name: None if spec is None else jnp.full(spec[0], fill.get(name, 0), spec[1])
                for name, spec in side_shapes.items()
            }
            side = MixedState(**parts)
        return KiviCache(**arrays, config=config, max_len=max_len, dtype=dtype, side=side)

    return one() if num_layers is None else tuple(one() for _ in range(num_layers))


def _side_shapes(config: KiviConfig, lead, cap: int, head_dim: int, dtype) -> dict:
    """{MixedState field: (shape, dtype) or None where that part has size 0}; the sinks and
    heavy tokens in `dtype`, the rings' (they hold tokens as the rings do)."""
    s, f, n = config.sinks, config.fine_key_channels, config.heavy_tokens
    exp = config.residual_format is Format.INT8  # the tokens' exponents
    if f and head_dim > 256:
        raise ValueError(f"fine_key_channels needs head_dim <= 256 (uint8 indices), got {head_dim}")
    kpb = quantization.codes_per_byte(config.k_bits)
    g, r = config.group_size, config.residual_length
    some = lambda cond, shape, dt: (shape, dt) if cond else None
    e = s + n  # the extras: the sinks, then the heavy slots
    return dict(
        extra_k=some(e, (*lead, e, head_dim), dtype),
        extra_v=some(e, (*lead, e, head_dim), dtype),
        fine_codes=some(f, (*lead, cap // kpb, f), jnp.uint8),
        fine_channels=some(f, (*lead, cap // g, f), jnp.uint8),
        heavy_pos=some(n, (*lead, n), jnp.int32),
        heavy_score=some(n, (*lead, n), jnp.float32),
        ring_score=some(config.needs_queries, (*lead, r), jnp.float32),
        extra_k_exp=some(e and exp, (*lead, e), jnp.int8),
        extra_v_exp=some(e and exp, (*lead, e), jnp.int8),
    )


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


def _as_array(what: str, name: str, x) -> jax.Array:
    """x as an array (a nested list or a numpy array is taken), or TypeError naming it."""
    if isinstance(x, jax.Array | np.ndarray):
        return x
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: {name} must be an array, got {type(x).__name__} ({e})") from None


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
    cache: Cache,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array | None = None,
    *,
    q: jax.Array | None = None,
) -> Cache:
    """Adds a chunk of tokens to every sequence.

    Args:
      cache: one layer's cache, empty or already holding tokens.
      k, v: [batch, seq, kv_heads, head_dim], cast to the cache dtype.
      lengths: [batch] ints, how many of the `seq` positions of each row are real (right padding);
        default: all of them.
      q: [batch, seq, q_heads, head_dim], the tokens' queries: needed by a mixed-precision
        cache whose heavy tokens are chosen by attention mass (`config.needs_queries`),
        ignored otherwise.

    Returns:
      The cache holding the new tokens after the old ones: exactly the state that appending them
      one at a time would give (chunked prefill, multi-turn chat); with heavy tokens chosen by
      MASS, up to the rounding of the scores (module doc).
    """
    check_cache(cache)
    k, v = _as_array("prefill", "k", k), _as_array("prefill", "v", v)
    _check_kv(cache, k, v, step=False)
    q = _check_q(cache, q, k, step=False)
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
        # Under jit the values are not known: a row outside [0, seq] is clipped and flagged.
        outside = (counts < 0) | (counts > seq)
        counts = jnp.clip(counts.astype(jnp.int32), 0, seq)
        out = _extend(cache, k, v, counts, q)
        return dataclasses.replace(out, overflow=out.overflow | outside)
    return _extend(cache, k, v, counts, q)


def append(
    cache: Cache,
    k: jax.Array,
    v: jax.Array,
    active: jax.Array | None = None,
    *,
    q: jax.Array | None = None,
) -> Cache:
    """Adds one decode step's key and value to every active sequence.

    Args:
      cache: one layer's cache.
      k, v: [batch, kv_heads, head_dim].
      active: [batch] bools; rows that are False are left untouched. Default: all rows.
      q: [batch, q_heads, head_dim], this step's query: needed when `config.needs_queries`
        (heavy tokens chosen by attention mass; the mass of this query is added to the window's
        tokens), ignored otherwise.

    Returns:
      The updated cache, any flush included (the order of KIVI's Algorithm 1: decode_attention
      afterwards reads the state that holds the new token).
    """
    check_cache(cache)
    k, v = _as_array("append", "k", k), _as_array("append", "v", v)
    _check_kv(cache, k, v, step=True)
    q = _check_q(cache, q, k, step=True)
    if q is not None:
        q = q[:, None]
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
    return _extend(cache, k[:, None], v[:, None], counts, q)


def _check_q(cache: Cache, q, k: jax.Array, *, step: bool):
    """The queries if the cache needs them (checked), else None."""
    if not (isinstance(cache, KiviCache) and cache.config.needs_queries):
        return None
    what = "append" if step else "prefill"
    if q is None:
        raise ValueError(
            f"{what}: this cache chooses its heavy tokens by attention mass "
            f"(selection=Selection.MASS): pass the queries, {what}(..., q=q)"
        )
    want = k.shape[:-2]
    if q.ndim != k.ndim or q.shape[:-2] != want or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{what}: q of shape {q.shape} does not match k of shape {k.shape} (expected "
            f"[{', '.join(map(str, want))}, q_heads, {k.shape[-1]}])"
        )
    if q.shape[-2] % cache.num_kv_heads:
        raise ValueError(
            f"{what}: q_heads={q.shape[-2]} must be a multiple of kv_heads={cache.num_kv_heads}"
        )
    return q


def _extend(cache: Cache, k: jax.Array, v: jax.Array, counts: jax.Array, q=None) -> Cache:
    """Appends counts[b] tokens of k, v [B, S, H, D] (queries q [B, S, N, D]) to each row b."""
    if _is_concrete(cache.lengths, counts):
        new = np.asarray(cache.lengths) + np.asarray(counts)
        bad = np.flatnonzero(new > cache.max_len)
        if bad.size:
            raise ValueError(
                f"cache capacity exceeded: max_len={cache.max_len}, but rows {bad.tolist()} "
                f"would hold {new[bad].tolist()} tokens"
            )
    return _extend_jit(cache, k, v, counts, q)


@jax.jit
def _extend_jit(cache: Cache, k: jax.Array, v: jax.Array, counts: jax.Array, q) -> Cache:
    old = cache.lengths
    fits = jnp.minimum(counts, cache.max_len - old)
    new = old + fits
    if isinstance(cache, KiviCache):
        k, v = (entering_tokens(cache.config, x, cache.dtype) for x in (k, v))
    else:
        k, v = k.astype(cache.dtype), v.astype(cache.dtype)
    if isinstance(cache, FullCache):
        pos = old[:, None] + jnp.arange(k.shape[1])  # [B, S]
        pos = _drop_unless(pos < new[:, None], pos)
        updates = dict(k=_scatter(cache.k, pos, k, axis=1), v=_scatter(cache.v, pos, v, axis=1))
    elif k.shape[1] == 1 and _append_kernel_applies(cache):
        updates = _append_with_kernel(cache, k[:, 0], v[:, 0], old, fits)
    else:
        # [B, S, H, D] -> [B, H, S, D], the quantized cache's heads-major order.
        swap = lambda x: None if x is None else jnp.swapaxes(x, 1, 2)
        updates = _extend_kivi(cache, swap(k), swap(v), old, new, swap(q))
    return dataclasses.replace(
        cache, **updates, lengths=new, overflow=cache.overflow | (fits < counts)
    )


def entering_tokens(cfg: KiviConfig, x: jax.Array, dtype) -> jax.Array:
    """Keys or values [..., D] as a KIVI cache of `dtype` takes them in: cast to `dtype`, and
    rounded to the residual format where it is an 8-bit one (config.Format; exact in `dtype`: a
    float8 value decoded from its bits so that no compiler folds the round trip away, an INT8
    token's codes times its power of two)."""
    x = x.astype(dtype)
    if cfg.residual_format is Format.INT8:
        return quantization.int8_token_values(*quantization.encode_int8_tokens(x, dtype), dtype)
    ring = cfg.residual_format.dtype(dtype)
    if not quantization.is_float8(ring):
        return x
    return quantization.as_float32(quantization.round_to_float8(x, ring)).astype(dtype)


# A decode step's append on a GPU: one Pallas kernel per layer (pallas_kernels/append/gpu.py)
# in place of ~11 XLA kernels; the XLA append stays the reference and the path elsewhere.
_APPEND_FIELDS = (
    "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_residual", "v_residual"
)  # fmt: skip


# The most heavy slots the append kernel merges into: it shifts them in registers (every slot
# loaded before any is stored), 255 registers a thread at 32 (KIVI2_MIX) on sm_90a.
_KERNEL_HEAVY_TOKENS = 32


def _append_kernel_supports(cache: KiviCache) -> bool:
    """Every float in the cache dtype, 2/4-bit codes, min/max ranges (Range.MINMAX: the kernel
    searches no range), power-of-two head_dim, G and R; plain
    KIVI, or a mixed state whose parts the kernel writes: S sinks a power of two, F fine key
    channels a multiple of 16, heavy tokens chosen by ERROR (scored and merged by the kernel:
    a power of two up to _KERNEL_HEAVY_TOKENS) or none."""
    cfg, d = cache.config, cache.head_dim
    pow2 = lambda x: (x & (x - 1)) == 0
    plain = (
        cfg.plain_formats
        and cfg.k_bits in (2, 4)
        and cfg.v_bits in (2, 4)
        and cfg.k_range is Range.MINMAX
        and cfg.v_range is Range.MINMAX
        and all(pow2(x) for x in (d, cfg.group_size, cfg.residual_length))
    )
    if cache.side is None:
        return plain
    return (
        plain
        and cfg.sinks > 0
        and pow2(cfg.sinks)
        and cfg.fine_key_channels >= 16
        and pow2(cfg.fine_key_channels)
        and (cfg.heavy_tokens == 0 or pow2(cfg.heavy_tokens))
        and cfg.heavy_tokens <= _KERNEL_HEAVY_TOKENS
        and not cfg.needs_queries
    )


def _append_kernel_applies(cache: KiviCache) -> bool:
    return jax.default_backend() == "gpu" and _append_kernel_supports(cache)


# The mixed state's parts the append kernel writes (and heavy_pos, heavy_score where it has
# heavy tokens).
_APPEND_SIDE_FIELDS = ("extra_k", "extra_v", "fine_codes", "fine_channels")
_APPEND_HEAVY_FIELDS = ("heavy_pos", "heavy_score")


def _append_with_kernel(cache: KiviCache, k, v, old, fits, *, interpret: bool = False) -> dict:
    """The arrays after one token per row (k, v [B, H, D]; fits [B] in {0, 1}): the append
    kernel (for a mixed state with heavy tokens, the leaving token's score and its merge into
    the heavy slots too)."""
    from kivi_jax.pallas_kernels.append.gpu import append_kernel

    cfg, side = cache.config, cache.side
    arrays = [getattr(cache, n) for n in _APPEND_FIELDS]
    config = dict(
        k_bits=cfg.k_bits, v_bits=cfg.v_bits, group_size=cfg.group_size,
        residual_length=cfg.residual_length, interpret=interpret,
    )  # fmt: skip
    if side is None:
        out = append_kernel(*arrays, old, fits, k, v, **config)
        return dict(zip(_APPEND_FIELDS, out, strict=True))
    fields = _APPEND_SIDE_FIELDS + (_APPEND_HEAVY_FIELDS if cfg.heavy_tokens else ())
    parts = tuple(getattr(side, n) for n in fields)
    out = append_kernel(*arrays, old, fits, k, v, parts, sinks=cfg.sinks, **config)
    updated = dict(zip(_APPEND_FIELDS + fields, out, strict=True))
    parts = {n: updated.pop(n) for n in fields}
    return updated | dict(side=dataclasses.replace(side, **parts))


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


def _ring_step(ring, new, windows, old, keep):
    """One pass over a ring (token t at slot t % R): reads windows of tokens
    [start, start + width) (those below `old` from the ring, the rest from the new tokens) and
    writes the new tokens where `keep`, reading the ring once.

    ring [B, H, R, D], new [B, H, S, D] (tokens old, old + 1, ...; exact in the ring's dtype),
    windows a list of (start [B], width, aligned), old [B], keep [B, S] -> ([window [B, H,
    width, D] in new's dtype, ...], the updated ring). `aligned`: every start is a multiple
    of width, width divides R and the window holds the new tokens; an aligned window alone
    is read as one slice per row (with several windows, all are gathered in one read). Window
    tokens below 0 read whatever their slot holds (the caller masks them).
    """
    r = ring.shape[2]
    js = [start[:, None] + jnp.arange(width) for start, width, _ in windows]  # [B, width]
    t = old[:, None] + jnp.arange(new.shape[2])  # [B, S] the new tokens
    slot = t % r
    if len(windows) == 1 and windows[0][2]:
        # One contiguous run of slots, read as one slice per row (XLA's gather of single
        # slots, fused with a key group's min and max, read them at ~0.5 TB/s on an H200);
        # it holds the new tokens' slots.
        start, width, _ = windows[0]
        win = jax.vmap(lambda x, i: jax.lax.dynamic_slice_in_dim(x, i, width, axis=1))(
            ring, start % r
        )
        raw, previous = [win], _gather(win, t - start[:, None])
    else:
        read = _gather(ring, jnp.concatenate([j % r for j in js] + [slot], axis=1))
        ends = np.cumsum([width for _, width, _ in windows])
        raw = [read[:, :, e - w : e] for e, (_, w, _) in zip(ends, windows, strict=True)]
        previous = read[:, :, ends[-1] :]
    outs = []
    for win, j in zip(raw, js, strict=True):
        from_new = _gather(new, jnp.clip(j - old[:, None], 0, new.shape[2] - 1))
        outs.append(
            jnp.where((j < old[:, None])[:, None, :, None], win.astype(new.dtype), from_new)
        )
    # The written values depend on the one read (a slot not written keeps its old contents),
    # so XLA orders the read first and updates the ring in place instead of copying it.
    values = jnp.where(keep[:, None, :, None], new.astype(ring.dtype), previous)
    return outs, _scatter(ring, _drop_unless(keep, slot), values, axis=2)


def _put_channels(x: jax.Array, channels: jax.Array, d: int) -> jax.Array:
    """[..., F] values (bool or unsigned) at distinct channel indices [..., F] -> [..., d], zero
    elsewhere; by comparison with every channel (elementwise, no scatter)."""
    at = channels.astype(jnp.int32)[..., None] == jnp.arange(d)  # [..., F, d]
    return jnp.max(jnp.where(at, x[..., None], jnp.zeros((), x.dtype)), axis=-2)


def _quantize_keys(win: jax.Array, cfg: KiviConfig, g0: jax.Array, dtype):
    """Key groups of a window win [B, H, W, D] (tokens g0 + j, groups aligned to g0) of a cache
    of `dtype` (the scales and zeros in the keys' scale format).

    Returns (codes [B, H, W, D] uint8 unpacked, scale, zero [B, H, W // G, D], fine_lo
    [B, H, W, F] uint8 or None, fine_channels [B, H, W // G, F] uint8 or None): plain KIVI
    group quantization, with the mixed layout's sinks and fine channels (module doc).
    """
    b, g, f = cfg.k_bits, cfg.group_size, cfg.fine_key_channels
    params = cfg.k_scale_format.params(dtype, b)  # the key scales' and zeros' storage
    w = win.shape[2]
    if cfg.sinks:  # the sinks take token S's key: the first group's range is over [S, G)
        j = jnp.arange(w)
        src = jnp.where(g0[:, None] + j < cfg.sinks, cfg.sinks - g0[:, None], j)
        win = _gather(win, jnp.clip(src, 0, w - 1))
    codes, scale, zero = quantization.quantize(
        win, b, g, axis=2, dtype=params, trims=cfg.k_range.trims
    )
    if not f:
        return codes, scale, zero, None, None
    # An integer zero counts steps of the stored scale, 2^b times the fine step.
    fine_params = params
    if isinstance(params, quantization.IntZero):
        fine_params = dataclasses.replace(params, shift=params.shift + b)
    fine, fine_scale, fine_zero = quantization.quantize(win, 2 * b, g, axis=2, dtype=fine_params)
    grouped = win.astype(jnp.float32).reshape(*win.shape[:2], w // g, g, win.shape[3])
    spread = jnp.max(grouped, axis=3) - jnp.min(grouped, axis=3)  # [B, H, W // G, D]
    # is_fine [B, H, W // G, D], channels [B, H, W // G, F]
    is_fine, channels = quantization.widest_channels(spread, f)
    per_token = lambda x: jnp.repeat(x, g, axis=2)
    codes = jnp.where(per_token(is_fine), fine >> b, codes)
    dtype = quantization.scale_dtype(params)
    if quantization.is_float8(dtype):  # exact below the format's largest value, saturated there
        top = float(jnp.finfo(dtype).max)
        coarse = jnp.minimum(quantization.as_float32(fine_scale) * (1 << b), top).astype(dtype)
    else:
        coarse = fine_scale * (1 << b)  # exact: a power of two
    scale = jnp.where(is_fine, coarse, scale)
    zero = jnp.where(is_fine, fine_zero, zero)  # the same but for an integer zero
    lo = jnp.take_along_axis(fine & ((1 << b) - 1), per_token(channels), axis=3)
    return codes, scale, zero, lo, channels.astype(jnp.uint8)


def _keys_at(cfg: KiviConfig, arrays: dict, pos: jax.Array, dtype) -> jax.Array:
    """The keys at positions pos [B, J] as the codes of a cache of `dtype` read them: float32
    [B, H, J, D]."""
    b, g = cfg.k_bits, cfg.group_size
    kpb = quantization.codes_per_byte(b)
    mask = (1 << b) - 1
    byte, group = pos // kpb, pos // g
    shift = ((pos % kpb) * b).astype(jnp.uint8)[:, None, :, None]
    code = (_gather(arrays["k_codes"], byte) >> shift) & mask  # [B, H, J, D]
    stored_scale = _gather(arrays["k_scale"], group)
    params = cfg.k_scale_format.params(dtype, b)
    zero = quantization.zero_values(stored_scale, _gather(arrays["k_zero"], group), params)
    scale = stored_scale.astype(jnp.float32)
    if arrays.get("fine_codes") is None:
        return quantization.affine(code.astype(jnp.float32), scale, zero)
    lo = (_gather(arrays["fine_codes"], byte) >> shift) & mask  # [B, H, J, F]
    channels = _gather(arrays["fine_channels"], group)
    d = scale.shape[-1]
    return _fine_dequantize(code, scale, zero, lo, channels, b, d)


def _fine_dequantize(code, scale, zero, lo, channels, bits: int, d: int) -> jax.Array:
    """code * scale + zero, the fine channels as (code * 2^b + lo) * (scale / 2^b) + zero."""
    is_fine = _put_channels(jnp.ones(channels.shape, bool), channels, d)
    lo_full = _put_channels(lo, channels, d).astype(jnp.int32)
    full = jnp.where(is_fine, code.astype(jnp.int32) * (1 << bits) + lo_full, code)
    step = jnp.where(is_fine, scale / (1 << bits), scale)
    return quantization.affine(full.astype(jnp.float32), step, zero)


def _window_mass(cfg, q, k_band, sink_k, old, new):
    """The attention mass the new queries give the tokens of their windows (Selection.MASS).

    q [B, N, S, D] (queries of tokens old + m), k_band [B, H, R + S, D] (tokens old - R + e),
    sink_k [B, H, S_sinks, D] or None -> float32 [B, H, R + S]: for token old - R + e, the sum
    over the real queries i that see it in their window [i + 1 - R, i] of the query's softmax
    over the full-precision keys it sees (the sinks and the window), summed over query heads.
    Queries go in blocks of min(S, R), each against the R + block band of keys it can see.
    """
    r = cfg.residual_length
    bsz, n, seq, d = q.shape
    h = k_band.shape[1]
    rep = n // h
    bq = max(min(seq, r), 1)
    nb = max(-(-seq // bq), 1)
    pad = nb * bq - seq
    qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
    qf = qf.reshape(bsz, h, rep, nb, bq, d)
    kf = jnp.pad(k_band.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
    idx = jnp.arange(nb)[:, None] * bq + jnp.arange(r + bq)  # [nb, R + bq] band positions
    kb = jnp.take(kf, idx, axis=2)  # [B, H, nb, R + bq, D]
    hi = jax.lax.Precision.HIGHEST
    scale = 1.0 / np.sqrt(d)
    logits = jnp.einsum("bhrnqd,bhnkd->bhrnqk", qf, kb, precision=hi) * scale
    m = jnp.arange(nb)[:, None] * bq + jnp.arange(bq)  # [nb, bq] query offsets
    e = idx[:, None, :]  # [nb, 1, R + bq]
    real = (old[:, None, None] + m[None] < new[:, None, None])[:, :, :, None]  # [B, nb, bq, 1]
    seen = (e >= m[:, :, None] + 1) & (e <= m[:, :, None] + r)  # [nb, bq, R + bq]
    seen = seen[None] & (old[:, None, None, None] - r + e[None] >= 0) & real  # [B, nb, bq, K]
    seen = seen[:, None, None]  # [B, 1, 1, nb, bq, R + bq]
    parts = [jnp.where(seen, logits, -jnp.inf)]
    if sink_k is not None:
        sl = jnp.einsum("bhrnqd,bhsd->bhrnqs", qf, sink_k.astype(jnp.float32), precision=hi)
        i = old[:, None, None, None] + m[None, :, :, None]  # [B, nb, bq, 1] query tokens
        s_ = jnp.arange(sink_k.shape[2])
        sink_seen = (s_ <= i) & (s_ < i + 1 - r) & real  # not already in the window
        parts.append(jnp.where(sink_seen[:, None, None], sl * scale, -jnp.inf))
    top = functools.reduce(jnp.maximum, [jnp.max(x, axis=-1, keepdims=True) for x in parts])
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    exps = [jnp.exp(x - top) for x in parts]
    denom = sum(jnp.sum(x, axis=-1, keepdims=True) for x in exps)
    p = exps[0] / jnp.where(denom > 0, denom, 1.0)  # [B, H, rep, nb, bq, R + bq]
    per_block = jnp.sum(p, axis=(2, 4))  # [B, H, nb, R + bq]
    out = jnp.zeros((bsz, h, r + nb * bq), jnp.float32).at[:, :, idx].add(per_block)
    return out[:, :, : r + seq]


def _merge_heavy(side: MixedState, cand_k, cand_v, cand_pos, cand_score, valid, n: int):
    """The N best of the heavy slots and the candidates, in position order (module doc).

    cand_* [B, H, J(, D)] the candidates (positions above every slot's), valid [B, H, J]. A NaN
    score (a non-finite key or value) counts as +inf: such a token is kept in full precision
    before any other, and the order stays total, so prefill and appends choose alike.
    """
    cand_score = jnp.where(jnp.isnan(cand_score), jnp.inf, cand_score)
    pos = jnp.concatenate([side.heavy_pos, cand_pos], axis=2)  # [B, H, N + J]
    score = jnp.concatenate([side.heavy_score, cand_score], axis=2)
    ok = jnp.concatenate([side.heavy_pos >= 0, valid], axis=2)
    kk = jnp.concatenate([side.heavy_k, cand_k.astype(side.heavy_k.dtype)], axis=2)
    vv = jnp.concatenate([side.heavy_v, cand_v.astype(side.heavy_v.dtype)], axis=2)
    iota = jnp.broadcast_to(jnp.arange(pos.shape[2], dtype=jnp.int32), pos.shape)
    big = np.iinfo(np.int32).max
    # Best first: valid, then score descending, then position ascending.
    *_, ranked = jax.lax.sort(
        ((~ok).astype(jnp.int32), jnp.where(ok, -score, 0.0), jnp.where(ok, pos, big), iota),
        dimension=2,
        num_keys=3,
    )
    best = ranked[:, :, :n]
    kept = _put_channels(jnp.ones(best.shape, bool), best, pos.shape[2]) & ok
    # The kept ones in position order (the concatenation is in position order).
    order = jnp.argsort(~kept, axis=2, stable=True)[:, :, :n]  # [B, H, N]
    filled = jnp.arange(n) < jnp.sum(kept, axis=2, keepdims=True)
    take = lambda x: jnp.take_along_axis(x, order, axis=2)
    take_rows = lambda x: jnp.take_along_axis(x, order[..., None], axis=2)
    return dict(
        heavy_pos=jnp.where(filled, take(pos), -1),
        heavy_score=jnp.where(filled, take(score), -jnp.inf),
        heavy_k=jnp.where(filled[..., None], take_rows(kk), 0),
        heavy_v=jnp.where(filled[..., None], take_rows(vv), 0),
    )


def _merge_one_heavy(side: MixedState, cand_k, cand_v, cand_pos, cand_score, valid, n: int):
    """`_merge_heavy` for one candidate per row (J = 1, a decode step), as selects over the N
    slots (no sort, no gather): the candidate takes the first empty slot; if none is empty
    and it scores above the worst slot (lowest score, of equal ones the latest position),
    the slots after the worst move down one and the candidate takes the last."""
    score = jnp.where(jnp.isnan(cand_score), jnp.inf, cand_score)  # [B, H, 1]
    held = side.heavy_pos >= 0  # [B, H, N], the held ones first
    count = jnp.sum(held, axis=2, keepdims=True)
    worst = jnp.min(jnp.where(held, side.heavy_score, jnp.inf), axis=2, keepdims=True)
    i = jnp.arange(n)
    last_worst = jnp.max(jnp.where(held & (side.heavy_score == worst), i, -1), axis=2)
    full = count == n
    enters = valid & (~full | (score > worst))  # [B, H, 1]
    shift_from = jnp.where(full, last_worst[..., None], n)  # slots from here take the next one's
    write_at = jnp.where(full, n - 1, count)

    def merged(x, cand):  # x [B, H, N(, D)], cand [B, H, 1(, D)]
        lift = lambda m: m.reshape(m.shape + (1,) * (x.ndim - 3))
        nxt = jnp.concatenate([x[:, :, 1:], x[:, :, -1:]], axis=2)  # slot i: slot i + 1's
        x = jnp.where(lift(enters & (i >= shift_from)), nxt, x)
        return jnp.where(lift(enters & (i == write_at)), cand, x)

    return dict(
        heavy_pos=merged(side.heavy_pos, cand_pos),
        heavy_score=merged(side.heavy_score, score),
        heavy_k=merged(side.heavy_k, cand_k.astype(side.heavy_k.dtype)),
        heavy_v=merged(side.heavy_v, cand_v.astype(side.heavy_v.dtype)),
    )


def _extend_kivi(
    cache: KiviCache,
    k: jax.Array,  # [B, H, S, D]
    v: jax.Array,  # [B, H, S, D]
    old: jax.Array,  # [B] lengths before
    new: jax.Array,  # [B] lengths after
    q: jax.Array | None = None,  # [B, N, S, D] queries (config.needs_queries)
) -> dict[str, jax.Array]:
    """The arrays with the new tokens written: only their entries change (module doc)."""
    cfg = cache.config
    g, r, dtype = cfg.group_size, cfg.residual_length, cache.dtype
    seq = k.shape[2]
    kpb = quantization.codes_per_byte(cfg.k_bits)
    side = cache.side
    heavy = cfg.heavy_tokens > 0
    int8 = cfg.residual_format is Format.INT8  # rings step as codes and exponents (_ring_and_new)

    # Both rings take the new tokens that are among the last R, each at its slot t % R.
    t = old[:, None] + jnp.arange(seq)  # [B, seq]
    keep = (t < new[:, None]) & (t >= new[:, None] - r)
    # Values: the tokens [p0, p1) leave the window (p1 - p0 <= seq).
    p0, p1 = jnp.maximum(old - r, 0), jnp.maximum(new - r, 0)

    # Keys: the groups from g0, the start of the group the old tokens left open (its first
    # old - g0 < G tokens are in the ring), to `done`, the end of the complete groups.
    # A mixed cache also reads the leaving tokens' keys and the window the queries see.
    g0, done = old - old % g, new - new % g
    width = _round_up(g - 1 + seq, g)
    windows = [(g0, width, width == g)]  # one step's group: aligned (G divides R)
    if heavy:
        windows.append((p0, seq, False))
    if cfg.needs_queries:
        windows.append((old - r, r + seq, False))
    k_wins, k_ring = _ring_step(*_ring_and_new(cache, "k", k), windows, old, keep)
    if int8:
        k_wins = [_decoded(w, dtype) for w in k_wins]
    codes, k_scale, k_zero, fine_lo, fine_channels = _quantize_keys(k_wins[0], cfg, g0, dtype)
    k_codes = quantization.pack_codes(codes, cfg.k_bits, axis=2)  # [B, H, width // kpb, D]
    jb, jg = jnp.arange(width // kpb), jnp.arange(width // g)
    byte_pos = _drop_unless(jb * kpb < (done - g0)[:, None], g0[:, None] // kpb + jb)
    group_pos = _drop_unless(jg * g < (done - g0)[:, None], g0[:, None] // g + jg)

    # Values leaving the window, read from the ring before the new tokens take their slots,
    # then from the new tokens.
    (v_win,), v_ring = _ring_step(*_ring_and_new(cache, "v", v), [(p0, seq, False)], old, keep)
    if int8:
        v_win = _decoded(v_win, dtype)
    v_params = cfg.v_scale_format.params(dtype, cfg.v_bits)
    codes, v_scale, v_zero = quantization.quantize(
        v_win, cfg.v_bits, g, axis=3, dtype=v_params, trims=cfg.v_range.trims
    )
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
    if int8:
        updated |= dict(
            k_residual=k_ring[..., :-1], k_ring_exp=k_ring[..., -1],
            v_residual=v_ring[..., :-1], v_ring_exp=v_ring[..., -1],
        )  # fmt: skip
    else:
        updated |= dict(k_residual=k_ring, v_residual=v_ring)
    if side is None:
        return updated

    parts = {}
    if cfg.sinks:  # the new tokens below S, at slot t: sink s takes new token s - old
        j = jnp.arange(cfg.sinks) - old[:, None]  # [B, S]
        takes = ((j >= 0) & (j < new[:, None] - old[:, None]))[:, None, :, None]
        at = jnp.clip(j, 0, seq - 1)
        for name, x in (("k", k), ("v", v)):
            extras = f"extra_{name}"
            old_sinks, new_sinks = side.sink_part(getattr(side, extras)), _gather(x, at)
            if int8:
                new_sinks, e = quantization.encode_int8_tokens(new_sinks, dtype)
                old_e = side.sink_part(getattr(side, f"{extras}_exp"))
                parts[f"sink_{name}_exp"] = jnp.where(takes[..., 0], e, old_e)
            parts[f"sink_{name}"] = jnp.where(takes, new_sinks.astype(old_sinks.dtype), old_sinks)
    if fine_lo is not None:
        parts |= dict(
            fine_codes=_scatter(
                side.fine_codes,
                byte_pos,
                quantization.pack_codes(fine_lo, cfg.k_bits, axis=2),
                axis=2,
            ),
            fine_channels=_scatter(side.fine_channels, group_pos, fine_channels, axis=2),
        )
    if heavy:
        k_leave = k_wins[1].astype(jnp.float32)  # [B, H, seq, D] tokens p0 + j
        v_leave = v_win.astype(jnp.float32)
        leaving = (pos < p1[:, None]) & (pos >= cfg.sinks)  # [B, seq]
        if cfg.needs_queries:
            sink_k = parts.get("sink_k")
            if int8 and sink_k is not None:
                sink_k = quantization.int8_token_values(sink_k, parts["sink_k_exp"], dtype)
            mass = _window_mass(cfg, q, k_wins[2], sink_k, old, new)  # [B, H, R + S]
            slot_old = jnp.take_along_axis(side.ring_score, pos[:, None, :] % r, axis=2)
            from_old = jnp.where((pos < old[:, None])[:, None], slot_old, 0.0)
            e = pos - old[:, None] + r  # band index of the leaving tokens (in [0, R + S))
            score = from_old + jnp.take_along_axis(mass, jnp.clip(e, 0, r + seq - 1)[:, None], 2)
            # The ring's tokens after the call: slot s holds token ts (if ts >= 0).
            ts = new[:, None] - 1 - (new[:, None] - 1 - jnp.arange(r)) % r  # [B, R]
            kept_old = jnp.where((ts < old[:, None])[:, None], side.ring_score, 0.0)
            added = jnp.take_along_axis(
                mass, jnp.clip(ts - old[:, None] + r, 0, r + seq - 1)[:, None], 2
            )
            parts["ring_score"] = jnp.where((ts >= 0)[:, None], kept_old + added, 0.0)
        else:
            arrays = {**updated, **parts}
            at = jnp.clip(pos, 0, cache.k_codes.shape[2] * kpb - 1)
            k_hat = _keys_at(cfg, arrays, at, dtype)
            v_hat = quantization.dequantize(codes, v_scale, v_zero, g, axis=3, params=v_params)
            error = lambda x, y: quantization.ordered_sum((x - y) ** 2)  # the kernel's order too
            score = error(k_leave, k_hat) + error(v_leave, v_hat)
        h = k.shape[1]
        merge = _merge_one_heavy if seq == 1 else _merge_heavy
        merged = merge(
            side_values(side, dtype) if int8 else side,  # merged as values, then encoded
            k_leave,
            v_leave,
            jnp.broadcast_to(pos[:, None], (pos.shape[0], h, seq)),
            score,
            jnp.broadcast_to(leaving[:, None], (pos.shape[0], h, seq)),
            cfg.heavy_tokens,
        )
        if int8:
            for name in ("heavy_k", "heavy_v"):
                merged[name], merged[f"{name}_exp"] = quantization.encode_int8_tokens(
                    merged[name], dtype
                )
        parts |= merged
    return updated | dict(side=dataclasses.replace(side, **_into_extras(side, parts)))


def _into_extras(side: MixedState, parts: dict) -> dict:
    """`parts` with its sinks' and heavy tokens' entries (sink_k, heavy_k, sink_k_exp, ... of
    the sinks' or the heavy slots' size) written into the extras arrays they are part of."""
    parts = dict(parts)
    for kv in ("k", "v"):
        for suffix in ("", "_exp"):
            name = f"extra_{kv}{suffix}"
            x = getattr(side, name)
            for start, key in ((0, f"sink_{kv}{suffix}"), (side.sinks, f"heavy_{kv}{suffix}")):
                if key in parts:
                    x = jax.lax.dynamic_update_slice_in_dim(x, parts.pop(key), start, axis=2)
            if x is not getattr(side, name):
                parts[name] = x
    return parts


def _ring_and_new(cache: KiviCache, kv: str, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The `kv` ("k" or "v") ring and the new tokens x [B, H, S, D] (entering values) as
    `_ring_step` takes them: as they are, or for an INT8 residual, each as one int8 array of
    the tokens' codes and exponents, [B, H, R or S, D + 1] (a token's codes and exponent move
    together; `_decoded` reads a window of it)."""
    ring = getattr(cache, f"{kv}_residual")
    if cache.config.residual_format is not Format.INT8:
        return ring, x
    exp = getattr(cache, f"{kv}_ring_exp")
    codes, e = quantization.encode_int8_tokens(x, cache.dtype)
    joined = lambda c, ee: jnp.concatenate([c, ee[..., None]], axis=-1)
    return joined(ring, exp), joined(codes, e)


def _decoded(x: jax.Array, dtype) -> jax.Array:
    """An INT8 store's tokens [..., D + 1] (codes, then the exponent) as values of `dtype`."""
    return quantization.int8_token_values(x[..., :-1], x[..., -1], dtype)


def ring_values(cache: KiviCache) -> tuple[jax.Array, jax.Array]:
    """The rings' tokens as values of the cache dtype: (keys, values [B, H, R, D]); a float8
    ring widened exactly, an INT8 ring decoded (exact)."""
    if cache.config.residual_format is Format.INT8:
        return tuple(
            quantization.int8_token_values(c, e, cache.dtype)
            for c, e in ((cache.k_residual, cache.k_ring_exp), (cache.v_residual, cache.v_ring_exp))
        )
    wide = lambda x: x if x.dtype == cache.dtype else x.astype(cache.dtype)
    return wide(cache.k_residual), wide(cache.v_residual)


def side_values(side: MixedState, dtype) -> MixedState:
    """`side` with an INT8 residual's sinks and heavy tokens decoded to values of `dtype`
    (their exponents None); any other side as it is."""
    parts = {}
    for name in ("extra_k", "extra_v"):
        exp = getattr(side, f"{name}_exp")
        if exp is not None:
            parts |= {name: quantization.int8_token_values(getattr(side, name), exp, dtype),
                      f"{name}_exp": None}  # fmt: skip
    return dataclasses.replace(side, **parts)


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
        side = cache.side
        kp = cfg.k_scale_format.params(cache.dtype, cfg.k_bits)
        vp = cfg.v_scale_format.params(cache.dtype, cfg.v_bits)
        if side is not None and side.fine_codes is not None:
            rep = lambda x: jnp.repeat(x, g, axis=2)
            kq = _fine_dequantize(
                quantization.unpack_codes(cache.k_codes, cfg.k_bits, axis=2),
                rep(cache.k_scale.astype(jnp.float32)),
                rep(quantization.zero_values(cache.k_scale, cache.k_zero, kp)),
                quantization.unpack_codes(side.fine_codes, cfg.k_bits, axis=2),
                rep(side.fine_channels),
                cfg.k_bits,
                cache.head_dim,
            )
        else:
            kq = quantization.dequantize(
                quantization.unpack_codes(cache.k_codes, cfg.k_bits, axis=2),
                cache.k_scale,
                cache.k_zero,
                g,
                axis=2,
                params=kp,
            )
        vq = quantization.dequantize(
            quantization.unpack_codes(cache.v_codes, cfg.v_bits, axis=3),
            cache.v_scale,
            cache.v_zero,
            g,
            axis=3,
            params=vp,
        )
        t = jnp.arange(kq.shape[2])
        n = cache.lengths[:, None, None, None]
        k_ring, v_ring = ring_values(cache)
        k_res = jnp.take(k_ring, t % r, axis=2).astype(jnp.float32)
        v_res = jnp.take(v_ring, t % r, axis=2).astype(jnp.float32)
        pv = jnp.maximum(n - r, 0)
        qk = pv if cfg.sliding_keys else n - n % r
        k = jnp.where(t[:, None] < qk, kq, k_res)
        v = jnp.where(t[:, None] < pv, vq, v_res)
        if side is not None:
            k, v = _side_overrides(side_values(side, cache.dtype), k, v, t)
    held = jnp.arange(k.shape[2])[:, None] < cache.lengths[:, None, None, None]
    return jnp.where(held, k, 0.0), jnp.where(held, v, 0.0)


def _side_overrides(side: MixedState, k, v, t):
    """k, v [B, H, C, D] with the sinks' and heavy tokens' full-precision entries put in."""
    if side.heavy_pos is not None:
        c = k.shape[2]
        at = jnp.where(side.heavy_pos >= 0, side.heavy_pos, c)  # [B, H, N]; c: dropped

        def put(x, rows):  # per (b, h): x [C, D], rows [N, D] at `at`
            return jax.vmap(jax.vmap(lambda xx, ii, rr: xx.at[ii].set(rr, mode="drop")))(
                x, at, rows.astype(jnp.float32)
            )

        k, v = put(k, side.heavy_k), put(v, side.heavy_v)
    if side.sink_k is not None:
        s = min(side.sink_k.shape[2], k.shape[2])
        pad = ((0, 0), (0, 0), (0, k.shape[2] - s), (0, 0))
        is_sink = (t < s)[:, None]
        for_t = lambda x: jnp.pad(x[:, :, :s].astype(jnp.float32), pad)
        k = jnp.where(is_sink, for_t(side.sink_k), k)
        v = jnp.where(is_sink, for_t(side.sink_v), v)
    return k, v


def dequantize(cache: Cache, dtype=None) -> tuple[jax.Array, jax.Array]:
    """What the cache currently represents: (k, v), each [batch, max_len, kv_heads, head_dim].

    Quantized tokens are reconstructed as code * scale + zero; residual tokens are returned as
    stored; positions at or beyond a sequence's length are zero. dtype defaults to the cache
    dtype; pass jnp.float32 for the reconstruction without a final rounding.
    """
    k, v = dequantized_heads_major(cache)
    dtype = jnp.dtype(cache.dtype if dtype is None else dtype)
    # A reconstruction of finite tokens stays finite in `dtype`: at most its largest value.
    if jnp.issubdtype(dtype, jnp.floating):
        top = float(jnp.finfo(dtype).max)
        cast = lambda x: jnp.where(jnp.isinf(x), x, jnp.clip(x, -top, top)).astype(dtype)
    else:
        cast = lambda x: x.astype(dtype)
    # [B, H, C, D] -> [B, max_len, H, D]
    return tuple(cast(jnp.swapaxes(x[:, :, : cache.max_len], 1, 2)) for x in (k, v))
