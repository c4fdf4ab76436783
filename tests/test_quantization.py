"""Group quantization and code packing: hand-computed cases, then properties on random data."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from kivi_jax import quantization as qz


def test_pack_puts_the_first_code_in_the_low_bits():
    # 2-bit codes [1, 2, 3, 0] -> 1 | 2 << 2 | 3 << 4 | 0 << 6 = 1 + 8 + 48 = 57.
    codes = jnp.array([1, 2, 3, 0, 3, 3, 3, 3], jnp.uint8)
    assert qz.pack_codes(codes, 2, axis=0).tolist() == [57, 255]
    # 4-bit codes [5, 12] -> 5 | 12 << 4 = 197.
    assert qz.pack_codes(jnp.array([5, 12], jnp.uint8), 4, axis=0).tolist() == [197]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_unpack_inverts_pack(rng, bits, axis):
    shape = [8, 8, 8]
    codes = jnp.asarray(rng.integers(0, 2**bits, size=shape), jnp.uint8)
    packed = qz.pack_codes(codes, bits, axis)
    assert packed.shape[axis] == 8 * bits // 8 and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(qz.unpack_codes(packed, bits, axis), codes)


def test_pack_rejects_a_partial_byte():
    with pytest.raises(ValueError, match="multiple of 4"):
        qz.pack_codes(jnp.zeros((6,), jnp.uint8), 2, axis=0)


def test_quantize_hand_computed_group():
    # [0, 1, 2, 3] at 2 bits: z = 0, s = (3 - 0) / 3 = 1, codes = the values themselves.
    # [-1, -1, -1, -1]: a constant group, s = 0, reconstructs exactly (no 0 / 0).
    x = jnp.array([[0.0, 1.0, 2.0, 3.0, -1.0, -1.0, -1.0, -1.0]])
    codes, scale, zero = qz.quantize(x, 2, 4, axis=1, dtype=jnp.float32)
    assert codes.tolist() == [[0, 1, 2, 3, 0, 0, 0, 0]]
    assert scale.tolist() == [[1.0, 0.0]] and zero.tolist() == [[0.0, -1.0]]
    np.testing.assert_array_equal(qz.dequantize(codes, scale, zero, 4, axis=1), x)


def test_quantize_rounds_to_nearest_level():
    # [0, 0.4, 0.6, 3]: s = 1, so 0.4 -> 0 and 0.6 -> 1.
    codes, _, _ = qz.quantize(jnp.array([0.0, 0.4, 0.6, 3.0]), 2, 4, axis=0, dtype=jnp.float32)
    assert codes.tolist() == [0, 0, 1, 3]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16bit_scale_is_rounded_up_to_cover_the_group(dtype):
    # (max - min) / 3 is rarely a 16-bit number: the stored scale must not fall below it.
    x = jnp.asarray(np.linspace(-1.3, 2.9, 64).reshape(16, 4), dtype)
    _, scale, zero = qz.quantize(x, 2, 4, axis=1, dtype=dtype)
    top = zero.astype(jnp.float32) + 3 * scale.astype(jnp.float32)
    assert bool(jnp.all(top >= jnp.max(x.astype(jnp.float32), axis=1, keepdims=True)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_as_float32_is_the_exact_value_of_every_16bit_pattern(dtype):
    y = jax.lax.bitcast_convert_type(
        jnp.arange(1 << 16, dtype=jnp.uint32).astype(jnp.uint16), dtype
    )
    got, want = np.asarray(jax.jit(qz.as_float32)(y)), np.asarray(y.astype(jnp.float32))
    assert np.all((got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want)))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("axis", [2, -1])
def test_jitted_on_the_gpu_quantize_stores_the_cpus_scales_and_zeros(rng, dtype, axis):
    # XLA on GPUs folds float32 -> 16-bit -> float32 round trips (excess precision); the
    # scales must still be rounded up. The codes may differ by one near a rounding boundary:
    # on a GPU XLA divides (div.full, within 2 ulp), on the CPU it multiplies by 1 / s.
    x = jnp.asarray(rng.standard_normal((4, 8, 64, 128)) * 3, dtype)
    f = jax.jit(lambda x: qz.quantize(x, 2, 32, axis, dtype))
    gpu = [np.asarray(a) for a in f(x)]
    with jax.default_device(jax.devices("cpu")[0]):
        cpu = [np.asarray(a) for a in f(jax.device_put(x, jax.devices("cpu")[0]))]
    np.testing.assert_array_equal(gpu[1].view(np.uint16), cpu[1].view(np.uint16))
    np.testing.assert_array_equal(gpu[2].view(np.uint16), cpu[2].view(np.uint16))
    off = np.abs(gpu[0].astype(int) - cpu[0].astype(int))
    assert off.max() <= 1 and off.mean() < 1e-3


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    group=st.sampled_from([4, 8, 32]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**31 - 1),
    constant_groups=st.booleans(),
)
def test_every_value_is_within_half_a_step(bits, group, dtype, scale, seed, constant_groups):
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, size=(8, 2 * group)) * scale
    if constant_groups:
        x[::2, :group] = x[::2, :1]
    x = jnp.asarray(x, dtype)
    codes, s, z = qz.quantize(x, bits, group, axis=1, dtype=x.dtype)
    assert int(codes.max()) < 2**bits
    recon = qz.dequantize(codes, s, z, group, axis=1)  # float32
    step = jnp.repeat(s.astype(jnp.float32), group, axis=1)
    err = jnp.abs(recon - x.astype(jnp.float32))
    # Exact arithmetic gives err <= step / 2; float32 evaluation adds a few ulps of |x|.
    slack = 4 * np.finfo(np.float32).eps * (jnp.abs(x.astype(jnp.float32)) + step)
    assert bool(jnp.all(err <= step / 2 + slack)), float(jnp.max(err - step / 2))
    assert not bool(jnp.any(jnp.isnan(recon)))
    # Rounded to the cache dtype (what kivi_jax.dequantize returns), one more ulp of the value.
    out = recon.astype(x.dtype)
    ulp = jnp.abs(jnp.nextafter(out, jnp.asarray(np.inf, x.dtype)) - out).astype(jnp.float32)
    err = jnp.abs(out.astype(jnp.float32) - x.astype(jnp.float32))
    assert bool(jnp.all(err <= step / 2 + slack + ulp))


def test_fake_quantize_keeps_dtype_and_shape(rng):
    x = jnp.asarray(rng.normal(size=(3, 64)), jnp.bfloat16)
    y = qz.fake_quantize(x, 4, 32, axis=1)
    assert y.shape == x.shape and y.dtype == x.dtype
