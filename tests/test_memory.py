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
    # The baseline: FullCaches of max_len = 1000 (not C) tokens in bfloat16, counters included.
    full = kj.init_cache(None, batch=2, max_len=1000, num_kv_heads=3, head_dim=64, num_layers=4)
    assert report.full_precision_bytes == kj.memory_report(full).total_bytes
    assert report.full_precision_bytes == 2 * 4 * 2 * 3 * 1000 * 64 * 2 + report.counters_bytes


def test_full_cache_report():
    cache = kj.init_cache(None, batch=1, max_len=10, num_kv_heads=2, head_dim=8, dtype=jnp.float32)
    report = kj.memory_report(cache)
    assert report.residual_bytes == 2 * 10 * 2 * 8 * 4
    assert report.full_precision_bytes == report.total_bytes
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


def test_the_readmes_savings_figures():
    """README, "Install and generate": from what length KIVI-2 (G=32, R=128) saves memory."""
    held = lambda n, d=128: kj.held_bits(kj.KIVI2, length=n, head_dim=d, dtype=jnp.bfloat16)
    assert held(127).compression == 1.0 < held(128).compression  # nothing quantized below R
    assert round(held(1024).compression, 1) == 4.2 and round(held(4096).compression, 1) == 5.0
    mib = lambda bits, layers, heads: bits * layers * heads / 8 / 2**20
    assert round(mib(held(4096, 64).total_bits, 30, 3), 1) == 18.0  # SmolLM2-135M
    assert mib(held(4096, 64).fp_bits, 30, 3) == 90
    assert mib(held(4096).total_bits, 32, 32) == 410 and mib(held(4096).fp_bits, 32, 32) == 2048

    def allocated_vs_full(max_len, dtype):
        cache = kj.init_cache(
            kj.KIVI2, batch=1, max_len=max_len, num_kv_heads=3, head_dim=64, dtype=dtype
        )
        report = kj.memory_report(cache)
        return report.total_bytes / report.full_precision_bytes

    for dtype, last in ((jnp.bfloat16, 158), (jnp.float32, 148)):  # no smaller up to `last`
        assert allocated_vs_full(last, dtype) >= 1 > allocated_vs_full(last + 1, dtype)
