"""Memory accounting: allocated bytes and the bits each held value costs."""

import jax
import jax.numpy as jnp
import pytest

import kivi_jax as kj


def test_report_counts_every_allocated_byte():
    cache = kj.init_cache(
        kj.KIVI2, batch=2, max_len=1000, num_kv_heads=3, head_dim=64, num_layers=4
    )
    report = kj.memory_report(cache)
    assert report.total_bytes == sum(x.nbytes for x in jax.tree.leaves(cache))
    # C = 1024 positions; codes: 2 bits for K and V; scales and zeros: 2 x 16 bits per 32 values.
    values = 2 * 4 * 2 * 3 * 1024 * 64
    assert report.capacity_values == values
    assert report.codes_bytes == values * 2 // 8
    assert report.scales_zeros_bytes == values // 32 * 2 * 2
    assert report.residual_bytes == 2 * 4 * 2 * 3 * 128 * 64 * 2
    assert report.full_precision_bytes == values * 2


def test_full_cache_report():
    cache = kj.init_cache(None, batch=1, max_len=10, num_kv_heads=2, head_dim=8, dtype=jnp.float32)
    report = kj.memory_report(cache)
    assert report.residual_bytes == report.full_precision_bytes == 2 * 10 * 2 * 8 * 4
    assert report.bits_per_value_allocated == pytest.approx(32 + 8 * 5 * 1 / 320)


@pytest.mark.parametrize(
    "length, bits",
    [
        # Keys: 1024 quantized at 3 bits. Values: 896 quantized at 3 bits, 128 at 16 bits.
        # (1024 * 3 + 896 * 3 + 128 * 16) / 2048 = 7808 / 2048 = 3.8125
        (1024, 3.8125),
        # (4096 * 3 + 3968 * 3 + 128 * 16) / 8192 = 26240 / 8192
        (4096, 3.203125),
        # (32768 * 3 + 32640 * 3 + 2048) / 65536
        (32768, 3.025390625),
        # 100 tokens: all in the residual, nothing quantized: 16 bits.
        (100, 16.0),
    ],
)
def test_held_bits_per_value_at_g32_r128(length, bits):
    held = kj.held_bits(kj.KIVI2, length=length, head_dim=128, dtype=jnp.bfloat16)
    assert held.bits_per_value == pytest.approx(bits)
    assert held.compression == pytest.approx(16 / bits)


def test_quantized_part_alone_costs_three_bits():
    # 256 tokens, R = 128: keys 256 quantized; values 128 quantized, 128 residual.
    held = kj.held_bits(kj.KIVI2, length=256, head_dim=128)
    assert held.code_bits + held.scale_zero_bits == (256 + 128) * 128 * 3
