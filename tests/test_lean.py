"""Fewer bits per value (issue 61): float8 scales and zeros, int8 zero points, a float8 or
int8 residual, kivi2-lean.

The cache-wide properties (prefill = appends bit-identical, non-finite values confined to their
group, finite tokens giving a finite state) run on a float8 config in tests/test_properties.py;
the GPU kernels over kivi2-lean's state in tests/test_decode_attention_mixed.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import prefill_then_appends, random_kv, tree_equal

import kivi_jax as kj
from kivi_jax import quantization as qz
from kivi_jax.cache import entering_tokens
from kivi_jax.config import Format

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_as_float32_decodes_every_float8_bit_pattern(dtype):
    y = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), dtype)
    np.testing.assert_array_equal(qz.as_float32(y), np.asarray(y, np.float32))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_float8_zero_is_the_minimum_rounded_down_and_every_member_within_half_a_step(dtype):
    # Groups of 32 of spreads 1e-3 ... 1e1 around offsets of either sign, within e4m3's +-448.
    rng = np.random.default_rng(0)
    spread = 10.0 ** rng.uniform(-3, 1, size=(400, 1))
    x = rng.normal(size=(400, 32)) * spread + rng.normal(size=(400, 1)) * 5 * spread
    x = jnp.asarray(x, jnp.float32)
    codes, scale, zero = qz.quantize(x, 2, 32, axis=1, dtype=dtype)
    assert scale.dtype == zero.dtype == dtype
    s, z = qz.as_float32(scale), qz.as_float32(zero)
    assert bool(jnp.all(z <= x.min(axis=1, keepdims=True)))
    err = jnp.abs(qz.dequantize(codes, scale, zero, 32, axis=1) - x)
    assert bool(jnp.all(err <= s / 2 * (1 + 2**-20)))


def test_float8_parameters_saturate_finite_beyond_the_format():
    # e4m3's largest value is 448: a group at 1e4 and one spanning -1e30 .. 1e30 stay finite.
    x = jnp.asarray([[1e4] * 4, [-1e30, 0.0, 1.0, 1e30]], jnp.float32)
    codes, scale, zero = qz.quantize(x, 2, 4, axis=1, dtype=E4M3)
    assert qz.as_float32(zero).tolist() == [[448.0], [-448.0]]
    assert bool(jnp.all(jnp.isfinite(qz.dequantize(codes, scale, zero, 4, axis=1))))


def test_round_to_float8_saturates_finite_values_and_keeps_non_finite_ones():
    x = jnp.asarray([1000.0, -1000.0, 0.3, jnp.nan, jnp.inf], jnp.float32)
    got = np.asarray(qz.as_float32(qz.round_to_float8(x, E4M3)))
    np.testing.assert_array_equal(got[:3], [448.0, -448.0, 0.3125])
    assert np.isnan(got[3:]).all()  # e4m3fn has no inf


def test_an_int8_zero_centres_the_grid_in_units_of_a_64th_of_the_range():
    # [10.0, 10.3, 10.6, 10.9], 2 bits: s = 0.3 to the nearest e4m3 value, 0.3125 (5 / 16);
    # the unit u = s * 2^2 / 64 = 0.01953125; n = round((10.45 - 1.5 * 0.3125) / u) =
    # round(511.04) is beyond 127, so s rises to what n's range needs, 10.45 / (127 / 16
    # + 1.5) = 1.1045, up to e4m3's 1.125 (an offset of 9 steps costs step width here);
    # u = 0.0703125, n = round(8.7625 / u) = round(124.6) = 125, z = 8.7890625: the grid
    # 8.79, 9.91, 11.04, 12.16 and the codes 1, 1, 2, 2.
    x = jnp.asarray([[10.0, 10.3, 10.6, 10.9]], jnp.float32)
    params = qz.IntZero(jnp.float32, 2 - 6)
    codes, scale, zero = qz.quantize(x, 2, 4, axis=1, dtype=params)
    assert scale.dtype == E4M3 and zero.dtype == jnp.int8
    assert (qz.as_float32(scale).item(), zero.item()) == (1.125, 125)
    assert qz.zero_values(scale, zero, params).item() == 8.7890625
    assert codes.tolist() == [[1, 1, 2, 2]]


@pytest.mark.parametrize("bits", [2, 4])
def test_an_int8_zero_keeps_members_within_its_bound_and_beats_e4m3_zeros(bits):
    # Groups of 32 of spreads 1e-3 ... 1e1 around offsets of up to ~15 spreads (the keys'
    # offset channels), in a float32 cache.
    rng = np.random.default_rng(0)
    spread = 10.0 ** rng.uniform(-3, 1, size=(400, 1))
    x = rng.normal(size=(400, 32)) * spread + rng.normal(size=(400, 1)) * 5 * spread
    x = jnp.asarray(x, jnp.float32)
    levels = 2**bits - 1
    params = qz.IntZero(jnp.float32, bits - 6)
    codes, scale, zero = qz.quantize(x, bits, 32, axis=1, dtype=params)
    s, step = qz.as_float32(scale), (x.max(axis=1) - x.min(axis=1))[:, None] / levels
    err = jnp.abs(qz.dequantize(codes, scale, zero, 32, axis=1, params=params) - x)
    bound = s / 2 + levels / 2 * jnp.abs(s - step) + s * 2.0**bits / 64 / 2
    assert bool(jnp.all(err <= bound * (1 + 2**-20)))
    # The mean error below that of e4m3 zeros rounded down with scales rounded up.
    c8, s8, z8 = qz.quantize(x, bits, 32, axis=1, dtype=E4M3)
    err8 = jnp.abs(qz.dequantize(c8, s8, z8, 32, axis=1) - x)
    assert float(jnp.mean(err / step)) < float(jnp.mean(err8 / step))


def test_an_int8_token_takes_the_least_power_of_two_that_fits_its_largest_member():
    # max |x| = 3 = 0.75 * 2^2: 127 * 2^-5 = 3.97 holds it, 127 * 2^-6 = 1.98 does not; the
    # codes round(x * 32): 96, -32, round(3.2) = 3, 0; the values 3, -1, 0.09375, 0.
    # A NaN or inf member takes the code -128 (read as NaN), the rest as without it: max 2.
    x = jnp.asarray([[3.0, -1.0, 0.1, 0.0], [jnp.nan, jnp.inf, 2.0, -1.0]], jnp.float32)
    codes, exp = qz.encode_int8_tokens(x, jnp.float32)
    assert codes.dtype == exp.dtype == jnp.int8
    assert exp.tolist() == [-5, -5] and codes.tolist() == [[96, -32, 3, 0], [-128, -128, 64, -32]]
    got = np.asarray(qz.int8_token_values(codes, exp, jnp.float32))
    np.testing.assert_array_equal(got[0], [3.0, -1.0, 0.09375, 0.0])
    assert np.isnan(got[1, :2]).all() and got[1, 2:].tolist() == [2.0, -1.0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_int8_tokens_are_within_a_127th_of_their_largest_member_and_a_fixed_point(dtype):
    # Tokens of 64 values at magnitudes 1e-2 ... 1e3 (float16: its normal range), zeros, and
    # float16's largest value (the code clipped so that q * 2^e stays finite).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 64)) * 10.0 ** rng.uniform(-2, 3, size=(300, 1))
    x = jnp.asarray(np.concatenate([x, np.zeros((1, 64))]), jnp.float32).astype(dtype)
    values = qz.int8_token_values(*qz.encode_int8_tokens(x, dtype), dtype)
    assert values.dtype == dtype
    xf, vf = x.astype(jnp.float32), values.astype(jnp.float32)
    assert bool(jnp.all(jnp.abs(vf - xf) <= jnp.max(jnp.abs(xf), axis=1, keepdims=True) / 127))
    again = qz.int8_token_values(*qz.encode_int8_tokens(values, dtype), dtype)
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(vf))
    if dtype == jnp.float16:
        top = jnp.asarray([[65504.0, -65504.0]], jnp.float16)
        got = qz.int8_token_values(*qz.encode_int8_tokens(top, dtype), dtype)
        assert got.astype(jnp.float32).tolist() == [[64512.0, -64512.0]]


SMALL_LEAN = dataclasses.replace(
    kj.KIVI2_LEAN, group_size=4, residual_length=8, sinks=1, fine_key_channels=2, heavy_tokens=2
)


def test_a_float8_residual_holds_the_tokens_rounded_as_they_entered(rng):
    cfg = dataclasses.replace(SMALL_LEAN, residual_format=Format.E4M3)
    cache = kj.init_cache(cfg, batch=1, max_len=20, num_kv_heads=1, head_dim=8, dtype=jnp.bfloat16)
    assert cache.dtype == jnp.bfloat16
    assert cache.k_scale.dtype == cache.v_scale.dtype == cache.k_residual.dtype == E4M3
    assert cache.k_zero.dtype == cache.v_zero.dtype == jnp.int8
    assert cache.side.sink_k.dtype == cache.side.heavy_v.dtype == E4M3
    k, v = random_kv(rng, 1, 20, 1, 8)
    cache = kj.prefill(cache, k, v)
    dk, dv = kj.dequantize(cache, jnp.float32)
    rounded = lambda x: qz.as_float32(qz.round_to_float8(x.astype(jnp.bfloat16), E4M3))
    # l = 20, R = 8, sliding keys: tokens 12-19 in the rings, token 0 a sink.
    np.testing.assert_array_equal(dk[0, 12:], rounded(k[0, 12:]))
    np.testing.assert_array_equal(dv[0, 12:], rounded(v[0, 12:]))
    np.testing.assert_array_equal(dk[0, 0], rounded(k[0, 0]))


def test_an_int8_residual_holds_the_tokens_as_codes_and_exponents(rng):
    cfg = SMALL_LEAN  # kivi2-lean's formats: an INT8 residual
    cache = kj.init_cache(cfg, batch=1, max_len=20, num_kv_heads=1, head_dim=8, dtype=jnp.bfloat16)
    assert cache.k_residual.dtype == cache.side.sink_k.dtype == cache.side.heavy_v.dtype == jnp.int8
    assert cache.k_ring_exp.shape == cache.v_ring_exp.shape == (1, 1, 8)  # [B, H, R]
    assert cache.side.extra_v_exp.shape == (1, 1, 3)  # [B, H, S + N]: 1 sink, 2 heavy slots
    k, v = random_kv(rng, 1, 20, 1, 8)
    cache = kj.prefill(cache, k, v)
    dk, dv = kj.dequantize(cache, jnp.float32)
    rounded = lambda x: entering_tokens(cfg, x, jnp.bfloat16).astype(jnp.float32)
    # l = 20, R = 8, sliding keys: tokens 12-19 in the rings, token 0 a sink.
    np.testing.assert_array_equal(dk[0, 12:], rounded(k[0, 12:]))
    np.testing.assert_array_equal(dv[0, 12:], rounded(v[0, 12:]))
    np.testing.assert_array_equal(dk[0, 0], rounded(k[0, 0]))
    heavy = np.asarray(cache.side.heavy_pos[0, 0])  # the heavy tokens keep their ring values
    assert (heavy >= 0).all()
    np.testing.assert_array_equal(dv[0, heavy], rounded(v[0, heavy]))


@pytest.mark.parametrize(
    "formats",
    [
        dict(k_scale_format=Format.E5M2, v_scale_format=Format.E4M3),
        dict(residual_format=Format.E5M2),
        dict(residual_format=Format.INT8),
        dict(k_scale_format=Format.E4M3_INT8, v_scale_format=Format.E4M3_INT8),
    ],
)
def test_plain_float8_formats_prefill_equals_appends(rng, formats):
    """(kivi2-lean's formats with every mixed part: tests/test_properties.py's "lean".)"""
    cfg = kj.KiviConfig(group_size=4, residual_length=8, **formats)
    fresh = kj.init_cache(cfg, batch=2, max_len=21, num_kv_heads=2, head_dim=8, dtype=jnp.float16)
    k, v = random_kv(rng, 2, 21, 2, 8)
    whole, stepped = prefill_then_appends(fresh, k, v, 5, 16)
    assert tree_equal(whole, stepped)


def _hand_counted_lean_bits(d):
    """kivi2-lean at 4096 tokens (R 160, sliding keys: 3936 keys and values quantized; no
    heavy tokens), head_dim d."""
    q = 4096 - 160
    codes = 2 * q * 2 * d
    scales = 2 * q * 2 * 8 * d // 32  # e4m3 scale and int8 zero per 32 values, keys and values
    token = d * 8 + 8  # an int8 token: its codes and its exponent
    ring = 2 * 160 * token  # both rings
    fine = q * 16 * 2 + 8 * 16 * q // 32  # 16 low 2-bit planes, a uint8 index per group
    sinks = 4 * 2 * token
    return codes + scales + ring + fine + sinks


@pytest.mark.parametrize("d", [64, 128])
def test_held_bits_counts_the_float8_parts_and_kivi2_lean_holds_at_most_3_bits(d):
    got = kj.held_bits("kivi2-lean", length=4096, head_dim=d)
    assert got.total_bits == _hand_counted_lean_bits(d)  # d 64: 1,571,776 bits, 2.998 a value
    worst = max(
        kj.held_bits(kj.KIVI2_LEAN, length=n, head_dim=d).bits_per_value
        for n in range(4096, 4096 + 161)
    )
    assert worst <= 3.0


def test_held_bits_counts_an_int8_residual_and_its_exponents():
    # KIVI-2 + int8 residual at 4096 tokens, d 64: keys flushed (4096 quantized), 3968
    # values quantized, 128 values in the ring at 8 bits each and 8 bits a token.
    cfg = dataclasses.replace(kj.KIVI2, residual_format=Format.INT8)
    got = kj.held_bits(cfg, length=4096, head_dim=64)
    assert got.residual_bits == 128 * (64 * 8 + 8)
    assert got.total_bits == (4096 + 3968) * 64 * 2 + (4096 + 3968) * 64 // 32 * 32 + 128 * 520


def test_memory_report_counts_float8_arrays_at_one_byte():
    cfg = kj.KiviConfig(k_scale_format=Format.E4M3, v_scale_format=Format.E5M2)
    shape = dict(batch=1, max_len=256, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    lean, plain = (
        kj.memory_report(kj.init_cache(cfg, **shape)),
        kj.memory_report(kj.init_cache(kj.KIVI2, **shape)),
    )
    assert 2 * lean.scales_zeros_bytes == plain.scales_zeros_bytes == 2 * 2 * 2 * 256 * 2 * 2
    assert lean.residual_bytes == plain.residual_bytes
    int8 = dataclasses.replace(cfg, k_scale_format=Format.E4M3_INT8)
    assert kj.memory_report(kj.init_cache(int8, **shape)).scales_zeros_bytes == (
        lean.scales_zeros_bytes
    )  # an e4m3 scale and an int8 zero: 2 bytes a group, as two float8s
    ring = dataclasses.replace(cfg, residual_format=Format.INT8)
    # Two rings of R = 128 tokens x 2 heads: 64 codes and an exponent a token, one byte each.
    assert kj.memory_report(kj.init_cache(ring, **shape)).residual_bytes == 2 * 128 * 2 * 65


def test_kivi2_lean_is_a_kv_name_everywhere():
    from kivi_jax.cli import KV_CHOICES
    from kivi_jax.generate import KV_PRESETS, resolve_kv

    assert KV_CHOICES == tuple(KV_PRESETS)  # one list of names: the CLIs' and the engine's
    assert resolve_kv("kivi2-lean") is kj.KIVI2_LEAN
    assert not kj.KIVI2_LEAN.plain_formats and kj.KIVI2.plain_formats


def test_a_format_must_be_a_format():
    with pytest.raises(ValueError, match="residual_format must be a Format"):
        kj.KiviConfig(residual_format="e4m3")
    with pytest.raises(ValueError, match=r"residual_format cannot be Format\.E4M3_INT8"):
        kj.KiviConfig(residual_format=Format.E4M3_INT8)
    with pytest.raises(ValueError, match=r"k_scale_format cannot be Format\.INT8"):
        kj.KiviConfig(k_scale_format=Format.INT8)


def test_mass_scores_read_int8_sinks_as_their_values(rng):
    # Heavy tokens by attention mass see the sinks' keys: an INT8 residual's scores are the
    # bfloat16-residual ones up to the int8 rounding (1/127 of a token's largest member).
    k, v = random_kv(rng, 1, 30, 2, 8)
    q = jnp.asarray(rng.normal(size=(1, 30, 4, 8)), jnp.float32)
    scores = []
    for fmt in (Format.CACHE, Format.INT8):
        cfg = kj.KiviConfig(
            group_size=4, residual_length=8, sinks=2, heavy_tokens=3,
            selection=kj.Selection.MASS, residual_format=fmt,
        )  # fmt: skip
        cache = kj.init_cache(cfg, batch=1, max_len=30, num_kv_heads=2, head_dim=8)
        cache = kj.prefill(cache, k, v, q=q)
        scores.append(np.asarray(cache.side.heavy_score))
    np.testing.assert_allclose(scores[1], scores[0], rtol=0.03)
