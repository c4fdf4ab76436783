"""Asymmetric min/max group quantization and the bit packing of its codes.

A group of values X is stored as codes q in [0, 2^B - 1] with a scale s and a zero point z:

    z = min(X),  s >= (max(X) - min(X)) / (2^B - 1),  q = round((X - z) / s),  X ~= q * s + z.

s and z are stored in the cache dtype or in a float8 dtype (kivi_jax.config.Format). In the cache
dtype z is the group minimum, which is exact because X is already in that dtype; in float8, z is
the minimum rounded *down* to it. s is rounded *up* to its dtype from (max(X) - z) / (2^B - 1), so
z + (2^B - 1) * s covers max(X) and every member is within s / 2 of its reconstruction. A
constant group has s = 0 and reconstructs exactly as z where z is exact (the cache dtype).
In float8 the zero is first saturated at +-the format's largest value and the scale at it:
finite groups beyond the format's range get finite, inaccurate parameters.
With an integer zero (`IntZero`: an e4m3 scale s, an int8 zero point n counting units
u = s * 2^shift) both are rounded to nearest instead: s is span / (2^B - 1) rounded to the
nearest e4m3 value (raised where n's range needs it), n = round((mid - (2^B - 1) * s / 2) / u)
centres the grid on the group's mid-range mid, and the zero's value n * u is rounded to the
cache dtype. Members beyond the grid's ends take its end codes: every member is within
s / 2 + (2^B - 1) / 2 * |s - span / (2^B - 1)| + u / 2 of its reconstruction (plus the zero's
rounding to the cache dtype), where rounding s up and z down to cover the range would widen
every step (docs/design.md, "Storage formats").
A group with a non-finite member (NaN, +-inf) stores s = z = NaN (an integer zero: s = NaN,
n = 0) and codes 0: all its members dequantize to NaN. Finite groups anywhere in float32's range
get finite s, z and reconstructions (spans and products beyond the range are taken halved;
docs/design.md, "Non-finite and extreme values").

A range search (`quantize`'s trims, config.Range.SEARCH) quantizes each group over several
candidate ranges [lo + a * span, hi - b * span] (lo, hi the group's minimum and maximum, span
hi - lo, (a, b) from a fixed set holding (0, 0)), each with the scale and zero of the stored
format as above, and keeps the candidate whose reconstructions are of least squared error over
the group's members (summed in a fixed order; the earlier candidate on ties, so min/max unless
another is strictly better). Members beyond a clipped range take its end codes. With 2-bit
codes min/max spends a step's worth of range on a group's two extremes; a clipped range trades
their error for every other member's. The choice is a function of the group alone, like the
parameters, and a non-finite group keeps min/max's NaN parameters and codes 0.

Tokens in int8 (`encode_int8_tokens`, the residual format config.Format.INT8): a token's D
values x (one KV head) as int8 codes q with one power-of-two scale 2^e, e an int8: e is the
least integer with max|x| <= 127 * 2^e (at least the cache dtype's smallest normal exponent),
q = round(x / 2^e), and the token reads as q * 2^e, exact in the cache dtype (q has 7 bits, the
dtype 8 or more; a product past the dtype's largest value is avoided by clipping q; a token of
zeros stores e = 0). Every member is within 2^e / 2 <= max|x| / 127 of its value. A
non-finite member (NaN, +-inf) stores the code -128 and reads as NaN; the token's other members
are encoded as if it were absent. The values are a fixed point of encode and decode
(`int8_token_values(*encode_int8_tokens(y))` is y for y of that form), so a token moved from
one int8 store to another (the ring to the heavy slots) keeps its value.

Packing (the only place that defines the bit order): `8 // bits` codes share one uint8. Along the
packed axis, element i lives in byte i // (8 // bits) at bits [bits * (i % (8 // bits)), +bits),
i.e. the first element in the least significant bits. Keys are packed along tokens and values along
channels (see kivi_jax.cache), so a kernel unpacks a tile with one shift and one mask per code.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
FLOAT8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def is_float8(dtype) -> bool:
    return not isinstance(dtype, IntZero) and jnp.dtype(dtype) in FLOAT8_DTYPES


@dataclasses.dataclass(frozen=True)
class IntZero:
    """Group parameters stored as a float8 e4m3 scale s and an int8 zero point n (module doc):
    the zero's value is n * s * 2^shift rounded to `dtype`, the cache dtype in which it is
    read. Where quantize takes a parameter dtype, an IntZero stands for this storage."""

    dtype: jnp.dtype
    shift: int

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))


def scale_dtype(params) -> jnp.dtype:
    """The dtype of the stored scales for `params` (a dtype or an IntZero)."""
    return jnp.dtype(jnp.float8_e4m3fn) if isinstance(params, IntZero) else jnp.dtype(params)


def zero_dtype(params) -> jnp.dtype:
    """The dtype of the stored zero points for `params` (a dtype or an IntZero)."""
    return jnp.dtype(jnp.int8) if isinstance(params, IntZero) else jnp.dtype(params)


def zero_values(scale: jax.Array, zero: jax.Array, params) -> jax.Array:
    """The zero points' values, float32, from the stored scale and zero (module doc), as the
    readers take them (a float zero widened by a cast)."""
    if not isinstance(params, IntZero):
        return zero.astype(jnp.float32)
    z = zero.astype(jnp.float32) * (as_float32(scale) * jnp.float32(2.0**params.shift))
    return as_float32(z.astype(params.dtype))


def codes_per_byte(bits: int) -> int:
    """How many `bits`-bit codes share one uint8."""
    return 8 // bits


def pack_codes(codes: jax.Array, bits: int, axis: int) -> jax.Array:
    """Packs codes in [0, 2^bits) along `axis` into uint8, shrinking it by 8 // bits.

    codes: any integer array; codes.shape[axis] must be a multiple of 8 // bits.
    """
    n = codes_per_byte(bits)
    c = jnp.moveaxis(codes, axis, -1).astype(jnp.uint8)
    *lead, m = c.shape
    if m % n:
        raise ValueError(f"cannot pack {m} codes of {bits} bits: need a multiple of {n}")
    c = c.reshape(*lead, m // n, n)  # [..., bytes, codes in byte]
    shifts = jnp.arange(n, dtype=jnp.uint8) * jnp.uint8(bits)
    packed = jnp.bitwise_or.reduce(c << shifts, axis=-1) if n > 1 else c[..., 0]
    return jnp.moveaxis(packed.astype(jnp.uint8), -1, axis)


def unpack_codes(packed: jax.Array, bits: int, axis: int) -> jax.Array:
    """Inverse of pack_codes: uint8 codes, `axis` grown by 8 // bits."""
    n = codes_per_byte(bits)
    p = jnp.moveaxis(packed, axis, -1)
    shifts = jnp.arange(n, dtype=jnp.uint8) * jnp.uint8(bits)
    mask = jnp.uint8((1 << bits) - 1)
    c = (p[..., None] >> shifts) & mask  # [..., bytes, codes in byte]
    c = c.reshape(*p.shape[:-1], p.shape[-1] * n)
    return jnp.moveaxis(c, -1, axis)


def as_float32(y: jax.Array) -> jax.Array:
    """y's values in float32, decoded from y's bits. XLA on GPUs folds a float32 -> bfloat16
    -> float32 round trip into the float32 value it started from (excess precision), so
    `y.astype(float32)` may not be y; quantization must compute with the s and z it stores."""
    if y.dtype == jnp.float32:
        return y
    if y.dtype == jnp.float8_e5m2:  # float16's top byte
        b8 = lax.bitcast_convert_type(y, jnp.uint8).astype(jnp.uint16)
        return as_float32(lax.bitcast_convert_type(b8 << 8, jnp.float16))
    if y.dtype == jnp.float8_e4m3fn:
        b = lax.bitcast_convert_type(y, jnp.uint8).astype(jnp.uint32)
        sign, exp, mant = (b >> 7) << 31, (b >> 3) & 0xF, b & 0x7
        normal = lax.bitcast_convert_type(sign | ((exp + 120) << 23) | (mant << 20), jnp.float32)
        subnormal = mant.astype(jnp.float32) * 2.0**-9  # exact
        value = jnp.where(exp == 0, jnp.where(sign > 0, -subnormal, subnormal), normal)
        return jnp.where((b & 0x7F) == 0x7F, jnp.nan, value)  # e4m3fn: NaN, no inf
    if y.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"as_float32 takes float32, bfloat16, float16 or float8, got {y.dtype}")
    b = lax.bitcast_convert_type(y, jnp.uint16).astype(jnp.uint32)
    if y.dtype == jnp.bfloat16:
        return lax.bitcast_convert_type(b << 16, jnp.float32)
    sign, exp, mant = (b >> 15) << 31, (b >> 10) & 0x1F, b & 0x3FF
    normal = sign | (jnp.where(exp == 0x1F, 0xFF, exp + 112) << 23) | (mant << 13)
    subnormal = mant.astype(jnp.float32) * 2.0**-24  # exact: mant < 2^10
    return jnp.where(
        exp == 0,
        jnp.where(sign > 0, -subnormal, subnormal),
        lax.bitcast_convert_type(normal, jnp.float32),
    )


def round_up_to_dtype(x: jax.Array, dtype) -> jax.Array:
    """Non-negative float32 x cast to `dtype`, rounded towards +inf (never below x; a float8
    dtype saturates at its largest value)."""
    if is_float8(dtype):
        x = jnp.minimum(x, float(jnp.finfo(dtype).max))
    y = x.astype(dtype)
    if jnp.dtype(dtype) == jnp.float32:
        return y
    uint = _UINT_OF_WIDTH[jnp.dtype(dtype).itemsize]
    bumped = lax.bitcast_convert_type(lax.bitcast_convert_type(y, uint) + uint(1), dtype)
    return jnp.where(as_float32(y) < x, bumped, y)


def round_down_to_float8(x: jax.Array, dtype) -> jax.Array:
    """Finite float32 x with |x| <= the float8 `dtype`'s largest value, cast to it rounded
    towards -inf (never above x)."""
    y = x.astype(dtype)
    yf, b = as_float32(y), lax.bitcast_convert_type(y, jnp.uint8)
    # One step towards -inf: magnitude down for y > 0, up for y < 0, the negative subnormal
    # nearest 0 for y = +-0.
    down = jnp.where(yf > 0, b - 1, jnp.where(yf < 0, b + 1, jnp.uint8(0x81)))
    return jnp.where(yf > x, lax.bitcast_convert_type(down, dtype), y)


def round_to_float8(x: jax.Array, dtype) -> jax.Array:
    """x (any float dtype) rounded to the float8 `dtype` (to nearest), finite values saturated
    at its largest value (a plain cast would give NaN or inf); NaN stays NaN, +-inf becomes
    the format's NaN or inf."""
    top = float(jnp.finfo(dtype).max)
    xf = x.astype(jnp.float32)
    return jnp.where(is_finite(xf), jnp.clip(xf, -top, top), xf).astype(dtype)


_F32_MAX = float(jnp.finfo(jnp.float32).max)


def is_finite(x: jax.Array) -> jax.Array:
    """Whether float32 x is finite (|x| <= max is False for inf and NaN; lowers everywhere)."""
    return jnp.abs(x) <= _F32_MAX


def scale_and_zero(lo, hi, finite, bits: int, dtype) -> tuple[jax.Array, jax.Array]:
    """The stored scale and zero (`dtype`) of groups with float32 minimum lo and maximum hi.

    scale = round_up((hi - lo) * (1 / levels)), zero = lo; a span beyond float32's range (finite
    members near -max and +max) is taken halved, so finite groups get finite parameters. In a
    float8 dtype zero = lo rounded down and scale = round_up((hi - zero) / levels), both
    saturated at the dtype's largest value (module doc). Groups
    that are not `finite` (a member is NaN or +-inf) get NaN for both: every member of such a
    group dequantizes to NaN, never to a finite number.
    """
    levels = (1 << bits) - 1
    if isinstance(dtype, IntZero):
        return _int_zero_scale_and_zero(lo, hi, finite, levels, dtype)
    nan = jnp.array(jnp.nan, dtype)
    if is_float8(dtype):  # zero rounded down, the scale over the span from it (module doc)
        top = float(jnp.finfo(dtype).max)
        zero = round_down_to_float8(jnp.clip(jnp.where(finite, lo, 0.0), -top, top), dtype)
        step = (jnp.where(finite, hi, 0.0) - as_float32(zero)) * jnp.float32(1.0 / levels)
        scale = round_up_to_dtype(step, dtype)
        return jnp.where(finite, scale, nan), jnp.where(finite, zero, nan)
    span = hi - lo
    halved = (hi * 0.5 - lo * 0.5) * jnp.float32(2.0 / levels)
    step = jnp.where(jnp.isinf(span), halved, span * jnp.float32(1.0 / levels))
    scale = jnp.where(finite, round_up_to_dtype(jnp.where(finite, step, 0.0), dtype), nan)
    return scale, jnp.where(finite, lo.astype(dtype), nan)


def _int_zero_scale_and_zero(lo, hi, finite, levels: int, params: IntZero):
    """scale_and_zero for an IntZero (module doc): the e4m3 scale and the int8 zero point."""
    e4m3 = jnp.dtype(jnp.float8_e4m3fn)
    top = float(jnp.finfo(e4m3).max)
    unit = 2.0**params.shift  # the zero's unit, in scales
    lo, hi = jnp.where(finite, lo, 0.0), jnp.where(finite, hi, 0.0)
    step = (hi * 0.5 - lo * 0.5) * jnp.float32(2.0 / levels)  # span / levels, no overflow
    mid = lo * 0.5 + hi * 0.5
    # n = round((mid - levels * s / 2) / (s * unit)) lies in [-128, 127] for s >= need.
    need = jnp.where(mid > 0, mid / (127 * unit + levels / 2), -mid / (128 * unit - levels / 2))
    nearest = round_to_float8(step, e4m3)
    least = round_up_to_dtype(jnp.minimum(need, top), e4m3)
    scale = jnp.where(as_float32(least) > as_float32(nearest), least, nearest)
    u = as_float32(scale) * jnp.float32(unit)
    n = jnp.round((mid - as_float32(scale) * (levels / 2)) / jnp.where(u > 0, u, 1.0))
    zero = jnp.clip(n, -128, 127).astype(jnp.int8)
    nan = jnp.array(jnp.nan, e4m3)
    return jnp.where(finite, scale, nan), jnp.where(finite, zero, jnp.int8(0))


def codes_of(x, scale, zero, finite, bits: int, round_fn=jnp.round) -> jax.Array:
    """uint8 codes round((x - zero) / scale) in [0, levels] of float32 x against its group's
    stored scale and zero (broadcastable); 0 in groups that are not `finite`. A scale of 2^64
    or more (a group spanning a good part of float32's range) divides x - zero scaled by 2^-64:
    x - zero may overflow there, and XLA, which divides by multiplying by 1 / scale, would flush
    that reciprocal to zero."""
    levels = (1 << bits) - 1
    s, z = as_float32(scale), as_float32(zero)
    s = jnp.where(s == 0, 1.0, s)
    tiny = jnp.float32(2.0**-64)
    q = jnp.where(s >= 2.0**64, (x * tiny - z * tiny) / (s * tiny), (x - z) / s)
    return jnp.where(finite, jnp.clip(round_fn(q), 0, levels), 0).astype(jnp.uint8)


# quantize's trims (module doc): min/max alone, and the search's candidates (config.Range).
MINMAX = ((0.0, 0.0),)
SEARCH_TRIMS = tuple((a, b) for a in (0.0, 0.1, 0.2) for b in (0.0, 0.1, 0.2))  # (0, 0) first


def ordered_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a fixed tree of pairwise adds (the same rounding whatever the
    other axes: prefill and appends score a token identically)."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x, jnp.zeros_like(x[..., :1])], axis=-1)
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def _group_parameters(g, finite, bits: int, dtype, trims):
    """(codes [..., groups, G], scale, zero [..., groups]) of groups g: for each candidate
    range of `trims` (module doc), the group's parameters and codes in the stored format, and
    per group the candidate of least squared error after dequantization (the first on ties)."""
    lo, hi = jnp.min(g, axis=-1), jnp.max(g, axis=-1)

    def candidate(lo_c, hi_c):
        scale, zero = scale_and_zero(lo_c, hi_c, finite, bits, dtype)
        z = zero_values(scale, zero, dtype) if isinstance(dtype, IntZero) else zero
        codes = codes_of(g, scale[..., None], z[..., None], finite[..., None], bits)
        return codes, scale, zero, z

    codes, scale, zero, z = candidate(lo, hi)  # min/max: trims[0] is (0, 0)
    if len(trims) == 1:
        return codes, scale, zero

    def squared_error(codes, scale, z):  # NaN in groups that are not finite: never better
        y = affine(
            codes.astype(jnp.float32), as_float32(scale)[..., None], as_float32(z)[..., None]
        )
        return ordered_sum((y - g) ** 2)

    half_span = hi * 0.5 - lo * 0.5  # finite for finite groups

    def step(best, trim):  # one candidate at a time: the graph holds one
        codes, scale, zero, z = candidate(
            lo + 2 * trim[0] * half_span, hi - 2 * trim[1] * half_span
        )
        error = squared_error(codes, scale, z)
        better = error < best[3]
        new = (codes, scale, zero, error)
        keep = lambda a, b: jnp.where(
            better.reshape(better.shape + (1,) * (a.ndim - better.ndim)), a, b
        )
        return jax.tree.map(keep, new, best), None

    best = (codes, scale, zero, squared_error(codes, scale, z))
    best, _ = lax.scan(step, best, jnp.asarray(trims[1:], jnp.float32))
    return best[:3]


def quantize(
    x: jax.Array, bits: int, group_size: int, axis: int, dtype, trims=MINMAX
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantizes x in groups of `group_size` consecutive elements along `axis`.

    Args:
      x: values already representable in `dtype` (cast them first); G divides x.shape[axis].
      bits: code width B.
      group_size: G.
      axis: the axis along which groups are formed.
      dtype: the dtype of the returned scale and zero point, or an IntZero (an e4m3 scale and
        an int8 zero point).
      trims: the candidate ranges (module doc): (a, b) pairs, the range [lo + a * span,
        hi - b * span] of a group of minimum lo, maximum hi and span hi - lo; MINMAX (the one
        pair (0, 0)) is min/max quantization.

    Returns:
      codes: uint8, same shape as x, unpacked, in [0, 2^B - 1].
      scale, zero: x.shape with `axis` shrunk by G; x ~= codes * scale + zero_values(scale,
        zero, dtype).
    """
    xf = jnp.moveaxis(x, axis, -1).astype(jnp.float32)
    *lead, m = xf.shape
    if m % group_size:
        raise ValueError(f"axis of length {m} is not a multiple of group_size={group_size}")
    g = xf.reshape(*lead, m // group_size, group_size)  # [..., groups, G]
    finite = jnp.all(is_finite(g), axis=-1)
    trims = tuple(tuple(float(t) for t in trim) for trim in trims)
    if not trims or trims[0] != (0.0, 0.0) or not all(0 <= a + b < 1 for a, b in trims):
        raise ValueError(
            f"trims must start with (0, 0) (min/max) and cut less than the span, got {trims}"
        )
    codes, scale, zero = _group_parameters(g, finite, bits, dtype, trims)
    codes = codes.reshape(*lead, m)
    return (
        jnp.moveaxis(codes, -1, axis),
        jnp.moveaxis(scale, -1, axis),
        jnp.moveaxis(zero, -1, axis),
    )


def dequantize(
    codes: jax.Array, scale: jax.Array, zero: jax.Array, group_size: int, axis: int, params=None
) -> jax.Array:
    """codes * scale + zero in float32, the scale and zero repeated over each group along `axis`
    (`params`: an IntZero where the zero is one, read by zero_values)."""
    s = jnp.repeat(scale.astype(jnp.float32), group_size, axis=axis)
    z = jnp.repeat(zero_values(scale, zero, params), group_size, axis=axis)
    return affine(codes.astype(jnp.float32), s, z)


def _total_order_key(x: jax.Array) -> jax.Array:
    """float32 x -> int32 keys in the floats' total order (lax.top_k's and lax.sort's: -NaN <
    -inf < ... < -0 < +0 < ... < +inf < +NaN)."""
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def widest_channels(spread: jax.Array, f: int) -> tuple[jax.Array, jax.Array]:
    """The F channels of largest spread [..., D] float32, as lax.top_k picks them (the floats'
    total order, ties to the lower channel): (is_fine bool [..., D], channels int32 [..., F]
    ascending). By counting comparisons (D x D per group), not by a sort, so that the fused
    append kernel (pallas_kernels/append/gpu.py) picks them with the same code."""
    key = _total_order_key(spread)
    c = jnp.arange(spread.shape[-1])
    kc, ko = key[..., :, None], key[..., None, :]  # [..., D (channel), D (other)]
    ahead = (ko > kc) | ((ko == kc) & (c[None, :] < c[:, None]))
    is_fine = jnp.sum(ahead, axis=-1) < f  # fewer than F channels rank ahead
    below = jnp.sum(is_fine[..., None, :] & (c[None, :] < c[:, None]), axis=-1)  # [..., D]
    nth = is_fine[..., None, :] & (below[..., None, :] == jnp.arange(f)[:, None])  # [..., F, D]
    return is_fine, jnp.sum(jnp.where(nth, c, 0), axis=-1)


def affine(c: jax.Array, s: jax.Array, z: jax.Array) -> jax.Array:
    """c * s + z in float32, finite wherever s and z are: where the product overflows (a group
    spanning most of float32's range) it is taken halved, and the result clipped to the range."""
    y = c * s + z
    half = jnp.clip(c * (s * 0.5) + z * 0.5, -_F32_MAX / 2, _F32_MAX / 2)
    return jnp.where(jnp.isinf(y) & is_finite(s) & is_finite(z), half * 2, y)


def fake_quantize(
    x: jax.Array, bits: int, group_size: int, axis: int, params_dtype=None, trims=MINMAX
) -> jax.Array:
    """Quantize-dequantize x along `axis` in groups of G, returned in x's dtype (for analyses);
    the scales and zeros in `params_dtype` (default x's dtype; an IntZero too), the range
    chosen among `trims` (quantize)."""
    params = x.dtype if params_dtype is None else params_dtype
    codes, scale, zero = quantize(x, bits, group_size, axis, params, trims)
    return dequantize(codes, scale, zero, group_size, axis, params).astype(x.dtype)


# Format.INT8's code of a non-finite member (NaN, +-inf): it reads as NaN.
INT8_NAN = -128


def _pow2(e: jax.Array) -> jax.Array:
    """2^e in float32 for integer e in [-126, 127], from its bits (exact on every backend)."""
    return lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, jnp.float32)


def encode_int8_tokens(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Tokens x [..., D] (values of the cache dtype `dtype`) as int8 codes [..., D] and int8
    exponents [...] (module doc: x ~= codes * 2^exponent)."""
    xf = x.astype(jnp.float32)
    finite = is_finite(xf)
    m = jnp.max(jnp.where(finite, jnp.abs(xf), 0.0), axis=-1)
    frac, k = jnp.frexp(m)  # m = frac * 2^k, frac in [0.5, 1) (0 for m = 0)
    e = jnp.where(frac * 128 <= 127, k - 7, k - 6)  # least e with m <= 127 * 2^e
    e = jnp.where(m > 0, jnp.maximum(e, jnp.finfo(dtype).minexp), 0)  # zeros: e = 0
    top = float(jnp.finfo(dtype).max)
    limit = jnp.minimum(127.0, jnp.floor(top * _pow2(-e)))[..., None]  # q 2^e within dtype
    q = jnp.clip(jnp.round(jnp.where(finite, xf, 0.0) * _pow2(-e)[..., None]), -limit, limit)
    return jnp.where(finite, q, INT8_NAN).astype(jnp.int8), e.astype(jnp.int8)


def int8_token_values(codes: jax.Array, exponent: jax.Array, dtype) -> jax.Array:
    """The tokens int8 codes [..., D] with exponents [...] hold, in `dtype` (exact)."""
    x = codes.astype(jnp.float32) * _pow2(exponent)[..., None]
    return jnp.where(codes == INT8_NAN, jnp.nan, x).astype(dtype)
