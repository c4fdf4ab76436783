"""Prompt-attention views: one causal pass equals decoding through the streaming cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_kv

import kivi_jax as kj
from kivi_jax.analysis import Grouping
from kivi_jax.eval import views

SEARCH = kj.Range.SEARCH
MIXED = dict(group_size=4, residual_length=8, sinks=2, fine_key_channels=3, heavy_tokens=3)
STREAMING_CONFIGS = [
    kj.KiviConfig(group_size=4, residual_length=8),
    kj.KiviConfig(k_bits=4, v_bits=2, group_size=4, residual_length=4),
    kj.KiviConfig(**MIXED, sliding_keys=True, selection=kj.Selection.MASS),
    kj.KiviConfig(**MIXED, selection=kj.Selection.ERROR),
    kj.KiviConfig(group_size=4, residual_length=8, k_range=SEARCH, v_range=SEARCH),
    kj.KiviConfig(**MIXED, selection=kj.Selection.ERROR, k_range=SEARCH, v_range=SEARCH),
]


@pytest.mark.parametrize("config", STREAMING_CONFIGS)
def test_streaming_view_equals_teacher_forced_decode_through_the_cache(rng, config):
    seq, heads, rep, d = 29, 2, 2, 8
    k, v = random_kv(rng, 1, seq, heads, d, outliers=True)
    q = jnp.asarray(rng.normal(size=(1, seq, heads * rep, d)), jnp.float32)
    view = views.StreamingAttention(config)(q, k, v, jnp.array([seq]))
    cache = kj.init_cache(
        config, batch=1, max_len=seq, num_kv_heads=heads, head_dim=d, dtype=jnp.float32
    )
    for i in range(seq):
        cache = kj.append(cache, k[:, i], v[:, i], q=q[:, i])
        step = kj.decode_attention(q[:, i], cache, impl="reference")
        np.testing.assert_allclose(view[:, i], step, rtol=1e-5, atol=1e-5, err_msg=f"query {i}")
    if config.heavy_tokens:  # 29 - R - S = 19 candidates for 3 slots: some were pushed out
        assert np.all(np.asarray(cache.side.heavy_pos) >= config.sinks)


def test_full_view_is_causal_attention_and_ignores_padding(rng):
    k, v = random_kv(rng, 2, 12, 2, 8)
    q = jnp.asarray(rng.normal(size=(2, 12, 6, 8)), jnp.float32)
    lengths = jnp.array([12, 7])
    out = views.FullAttention()(q, k, v, lengths)
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
    np.testing.assert_allclose(out[0], expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[1, :7], expected[1, :7], rtol=1e-5, atol=1e-5)
    unquantized = views.FakeQuantAttention(None, None, bits=2)(q, k, v, lengths)
    np.testing.assert_array_equal(unquantized, out)


def test_per_channel_grouping_of_a_partial_group_uses_only_real_tokens():
    # 6 tokens, G = 4: the second group holds tokens 4-5 only (padding repeats token 5).
    x = jnp.arange(6.0).reshape(1, 6, 1, 1) * jnp.ones((1, 1, 1, 4))
    out = views.quantize_tokens(x, 2, 4, Grouping.PER_CHANNEL, jnp.float32)
    np.testing.assert_array_equal(out[0, 4:, 0, 0], [4.0, 5.0])  # exact: range [4, 5]


def test_shared_prefix_view_reads_the_prefix_as_its_sealed_pages_hold_it(rng):
    """Queries from the split on see the prefix's keys and values as a cache holding R tokens
    past it stores them (quantized: what the engine's shared pages hold), the rest in full
    precision; queries before the split see full precision."""
    config, seq, split = kj.KiviConfig(group_size=4, residual_length=8), 20, 8
    k, v = random_kv(rng, 1, seq, 2, 8, outliers=True)
    q = jnp.asarray(rng.normal(size=(1, seq, 4, 8)), jnp.float32)
    out = views.SharedPrefixAttention(config, split)(q, k, v, jnp.array([seq]))
    full = views.FullAttention()(q, k, v, jnp.array([seq]))
    np.testing.assert_array_equal(out[:, :split], full[:, :split])
    cache = kj.init_cache(config, batch=1, max_len=seq, num_kv_heads=2, head_dim=8,
                          dtype=jnp.float32)  # fmt: skip
    kq, vq = kj.dequantize(kj.prefill(cache, k[:, : split + 8], v[:, : split + 8]))
    seen_k = jnp.concatenate([kq[:, :split], k[:, split:]], axis=1)
    seen_v = jnp.concatenate([vq[:, :split], v[:, split:]], axis=1)
    expected = views.FullAttention()(q, seen_k, seen_v, jnp.array([seq]))
    np.testing.assert_allclose(out[:, split:], expected[:, split:], rtol=1e-5, atol=1e-5)
