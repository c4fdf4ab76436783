"""The KIVI streaming state: the paper's rules, exact equivalences and errors."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_kv, tree_equal
from hypothesis import given, settings

import kivi_jax as kj
from kivi_jax import quantization as qz


def _cache(config, batch=1, max_len=64, heads=1, head_dim=8, dtype=jnp.float32, **kw):
    shape = dict(batch=batch, max_len=max_len, num_kv_heads=heads, head_dim=head_dim)
    return kj.init_cache(config, **shape, dtype=dtype, **kw)


def _held_exactly(x, ref):
    """[seq] bools: which token positions of x [seq, H, D] equal ref exactly."""
    return np.all(np.asarray(x) == np.asarray(ref), axis=(1, 2))


def test_paper_example_g4_r8_d8(rng):
    # KIVI.md's worked example: G = 4, R = 8, d = 8, a 10-token prompt, then 6 decode steps.
    cfg = kj.KiviConfig(k_bits=2, v_bits=2, group_size=4, residual_length=8)
    k, v = random_kv(rng, 1, 16, 1, 8)
    cache = kj.prefill(_cache(cfg, max_len=16), k[:, :10], v[:, :10])
    # Keys: r = 10 mod 8 = 2, tokens 0-7 quantized as 2 groups of 4, tokens 8-9 in the residual.
    np.testing.assert_array_equal(cache.k_residual[0, 0, np.arange(2, 10) % 8], k[0, 2:10, 0])
    assert np.all(np.asarray(cache.k_scale[0, 0, :2]) > 0)  # groups 0 and 1 formed
    assert np.all(np.asarray(cache.k_scale[0, 0, 2:]) == 0)  # tokens 8-9: no complete group
    # Values: tokens 0-1 quantized per token (2 groups of 4 channels each), tokens 2-9 residual.
    assert np.all(np.asarray(cache.v_scale[0, 0, :2]) > 0)
    assert np.all(np.asarray(cache.v_scale[0, 0, 2:]) == 0)
    np.testing.assert_array_equal(cache.v_residual[0, 0, np.arange(2, 10) % 8], v[0, 2:10, 0])
    dk, dv = kj.dequantize(cache)
    assert _held_exactly(dk[0, :10], k[0, :10]).tolist() == [False] * 8 + [True] * 2
    assert _held_exactly(dv[0, :10], v[0, :10]).tolist() == [False] * 2 + [True] * 8

    for t in range(10, 16):
        cache = kj.append(cache, k[:, t], v[:, t])
        dk, dv = kj.dequantize(cache)
        keys_quantized = 16 if t == 15 else 8  # the key residual fills at t = 15 and flushes
        assert _held_exactly(dk[0, : t + 1], k[0, : t + 1]).tolist() == (
            [False] * keys_quantized + [True] * (t + 1 - keys_quantized)
        )
        # Each step quantizes one more value: t + 1 - 8 of them.
        assert _held_exactly(dv[0, : t + 1], v[0, : t + 1]).tolist() == (
            [False] * (t + 1 - 8) + [True] * 8
        )
    assert np.all(np.asarray(cache.k_scale[0, 0, 2:4]) > 0)  # tokens 8-15: 2 new key groups
    # The rings hold the last R = 8 tokens, 8-15, at slots t % 8 (the flushed keys included).
    np.testing.assert_array_equal(cache.k_residual[0, 0, np.arange(8, 16) % 8], k[0, 8:16, 0])


def test_key_groups_are_per_channel_over_tokens(rng):
    cfg = kj.KiviConfig(group_size=4, residual_length=4)
    k, v = random_kv(rng, 1, 4, 1, 8)
    cache = kj.prefill(_cache(cfg, max_len=8), k, v)
    # One group of 4 tokens: per channel, the zero point is the min over those tokens.
    np.testing.assert_array_equal(cache.k_zero[0, 0, 0], jnp.min(k[0, :, 0], axis=0))
    np.testing.assert_allclose(
        cache.k_scale[0, 0, 0], (jnp.max(k[0, :, 0], axis=0) - jnp.min(k[0, :, 0], axis=0)) / 3
    )


def test_value_groups_are_per_token_over_channels(rng):
    cfg = kj.KiviConfig(group_size=4, residual_length=4)
    k, v = random_kv(rng, 1, 5, 1, 8)
    cache = kj.prefill(_cache(cfg, max_len=8), k, v)
    # Token 0 left the value window: two groups of 4 channels, zero point = min of each.
    expected = jnp.min(v[0, 0, 0].reshape(2, 4), axis=1)
    np.testing.assert_array_equal(cache.v_zero[0, 0, 0], expected)


CONFIGS = [
    kj.KiviConfig(k_bits=2, v_bits=2, group_size=4, residual_length=8),
    kj.KiviConfig(k_bits=4, v_bits=2, group_size=4, residual_length=12),
    kj.KiviConfig(k_bits=2, v_bits=4, group_size=8, residual_length=8),
    kj.KiviConfig(k_bits=8, v_bits=8, group_size=4, residual_length=4),
]


@settings(max_examples=25, deadline=None)
@given(
    cfg=st.sampled_from(CONFIGS),
    n=st.integers(0, 30),
    m=st.integers(0, 20),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_prefill_then_appends_equals_one_prefill(cfg, n, m, dtype, seed):
    rng = np.random.default_rng(seed)
    # One padded shape for every example (fewer compilations); `lengths` marks the real tokens.
    k, v = random_kv(rng, 2, 50, 2, 8, dtype)
    fresh = _cache(cfg, batch=2, heads=2, dtype=dtype)
    whole = kj.prefill(fresh, k, v, lengths=jnp.full((2,), n + m))
    stepped = kj.prefill(fresh, k, v, lengths=jnp.full((2,), n))
    for t in range(n, n + m):
        stepped = kj.append(stepped, k[:, t], v[:, t])
    assert tree_equal(whole, stepped)


@settings(max_examples=15, deadline=None)
@given(
    cfg=st.sampled_from(CONFIGS),
    chunks=st.lists(st.integers(0, 13), min_size=1, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunked_prefill_equals_one_prefill(cfg, chunks, seed):
    rng = np.random.default_rng(seed)
    k, v = random_kv(rng, 1, 4 * 13, 1, 8)
    whole = kj.prefill(_cache(cfg), k, v, lengths=jnp.array([sum(chunks)]))
    chunked, start = _cache(cfg), 0
    for n in chunks:  # each chunk padded to 13 positions, n of them real
        chunk = slice(start, start + 13)
        chunked = kj.prefill(chunked, k[:, chunk], v[:, chunk], lengths=jnp.array([n]))
        start += n
    assert tree_equal(whole, chunked)


@pytest.mark.parametrize("cfg", CONFIGS[:2])
def test_each_row_of_a_ragged_batch_is_quantized_as_if_alone(rng, cfg):
    lengths = [0, 3, 8, 13, 21]
    k, v = random_kv(rng, len(lengths), 24, 2, 8)
    # Padding with huge values would wreck any group it entered.
    pad = np.arange(24)[None, :, None, None] >= np.array(lengths)[:, None, None, None]
    k, v = jnp.where(pad, 1e4, k), jnp.where(pad, -1e4, v)
    batch = kj.prefill(_cache(cfg, batch=5, heads=2), k, v, lengths=jnp.array(lengths))
    for b, n in enumerate(lengths):
        alone = kj.prefill(_cache(cfg, heads=2), k[b : b + 1, :n], v[b : b + 1, :n])
        assert tree_equal(jax.tree.map(lambda x, b=b: x[b : b + 1], batch), alone)


def test_inactive_rows_are_left_untouched(rng):
    cfg = CONFIGS[0]
    k, v = random_kv(rng, 3, 9, 1, 8)
    cache = kj.prefill(_cache(cfg, batch=3), k[:, :8], v[:, :8], lengths=jnp.array([8, 7, 0]))
    after = kj.append(cache, k[:, 8], v[:, 8], active=jnp.array([False, True, False]))
    assert after.lengths.tolist() == [8, 8, 0]
    for field in ("k_codes", "k_scale", "v_codes", "v_scale", "k_residual", "v_residual"):
        np.testing.assert_array_equal(getattr(after, field)[0], getattr(cache, field)[0])
        np.testing.assert_array_equal(getattr(after, field)[2], getattr(cache, field)[2])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("cfg", [kj.KiviConfig(group_size=4, residual_length=8), kj.KIVI4])
def test_dequantize_error_is_bounded_and_padding_is_zero(rng, dtype, cfg):
    d = max(cfg.group_size, 8)
    k, v = random_kv(rng, 2, 40, 1, d, dtype, outliers=True)
    cache = kj.prefill(
        _cache(cfg, batch=2, max_len=48, head_dim=d, dtype=dtype), k, v, lengths=jnp.array([40, 17])
    )
    dk, dv = kj.dequantize(cache, dtype=jnp.float32)
    assert dk.shape == (2, 48, 1, d) and dv.dtype == jnp.float32
    assert not np.any(np.asarray(dk[1, 17:])) and not np.any(np.asarray(dv[1, 17:]))
    # Every key is within half its group's step (key steps: per channel per G tokens).
    k_step = jnp.repeat(cache.k_scale.astype(jnp.float32), cfg.group_size, axis=2)  # [B,H,C,D]
    k_step = jnp.swapaxes(k_step, 1, 2)[:, :40]
    err = jnp.abs(dk[:, :40] - k.astype(jnp.float32))
    held = (jnp.arange(40)[None, :] < jnp.array([40, 17])[:, None])[:, :, None, None]
    slack = 1e-6 * (1 + jnp.abs(k.astype(jnp.float32)))
    assert bool(jnp.all(jnp.where(held, err <= k_step / 2 + slack, True)))
    # Values within half a step of their token's channel group.
    v_step = jnp.repeat(cache.v_scale.astype(jnp.float32), cfg.group_size, axis=3)
    v_step = jnp.swapaxes(v_step, 1, 2)[:, :40]
    err = jnp.abs(dv[:, :40] - v.astype(jnp.float32))
    assert bool(jnp.all(jnp.where(held, err <= v_step / 2 + slack, True)))


def test_constant_groups_dequantize_exactly():
    cfg = kj.KiviConfig(group_size=4, residual_length=4)
    k = jnp.full((1, 12, 1, 8), 0.375)
    cache = kj.prefill(_cache(cfg, max_len=12), k, -k)
    dk, dv = kj.dequantize(cache)
    np.testing.assert_array_equal(dk, k)
    np.testing.assert_array_equal(dv, -k)


def test_append_compiles_once(rng):
    traces = []

    def step(cache, k, v):
        traces.append(1)
        return kj.append(cache, k, v)

    step = jax.jit(step, donate_argnums=0)
    cache = _cache(CONFIGS[0], batch=2)
    k, v = random_kv(rng, 2, 20, 1, 8)
    for t in range(20):  # crosses several key flushes and the start of the value window
        cache = step(cache, k[:, t], v[:, t])
    assert len(traces) == 1
    assert cache.lengths.tolist() == [20, 20]


def test_num_layers_gives_one_cache_per_layer():
    caches = _cache(kj.KIVI2, batch=2, max_len=100, heads=3, head_dim=64, num_layers=4)
    assert isinstance(caches, tuple) and len(caches) == 4
    one = _cache(kj.KIVI2, batch=2, max_len=100, heads=3, head_dim=64)
    assert all(tree_equal(c, one) for c in caches)
    # Separate buffers: a step reads and writes each layer's arrays without slicing.
    leaves = [x.unsafe_buffer_pointer() for c in caches for x in jax.tree.leaves(c)]
    assert len(set(leaves)) == len(leaves)
    # C = max_len rounded up to G = 32: 128 token positions, 2-bit keys packed 4 per byte.
    assert one.k_codes.shape == (2, 3, 32, 64) and one.v_codes.shape == (2, 3, 128, 16)
    assert one.k_scale.shape == (2, 3, 4, 64) and one.v_scale.shape == (2, 3, 128, 2)


def test_a_tuple_of_caches_or_a_layer_index_is_a_clear_error():
    # The layers are a tuple of caches: a function of one layer's cache names the mistake, and
    # the removed `layer=` argument is Python's unexpected keyword, never a silent no-op.
    caches = _cache(CONFIGS[0], batch=2, heads=2, num_layers=2)
    k = jnp.zeros((2, 3, 2, 8))
    calls = [
        lambda: kj.prefill(caches, k, k),
        lambda: kj.append(caches, k[:, 0], k[:, 0]),
        lambda: kj.dequantize(caches),
        lambda: kj.decode_attention(jnp.zeros((2, 2, 8)), caches),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"tuple of 2 .* pass one of them, caches\[i\]"):
            call()
    with pytest.raises(TypeError, match="unexpected keyword argument 'layer'"):
        kj.prefill(caches[0], k, k, layer=5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'layer'"):
        kj.append(caches[0], k[:, 0], k[:, 0], layer=7)
    assert not hasattr(kj, "layer")


@pytest.mark.parametrize("config", [None, CONFIGS[0]])
def test_keys_and_values_of_another_float_dtype_are_cast_to_the_cache_dtype(rng, config):
    k, v = random_kv(rng, 1, 9, 1, 8)  # float32 into a bfloat16 cache
    cache = _cache(config, dtype=jnp.bfloat16)
    got = kj.prefill(cache, k, v)
    want = kj.prefill(cache, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    assert tree_equal(got, want) and got.dtype == jnp.bfloat16


def test_a_key_group_is_quantized_when_its_last_token_arrives(rng):
    # G = 4, R = 8: the group of tokens 4-7 gets its codes at token 7, before the flush at 8
    # moves Qk; attention reads those keys from the ring until then.
    cfg = kj.KiviConfig(group_size=4, residual_length=8)
    k, v = random_kv(rng, 1, 8, 1, 8)
    cache = kj.prefill(_cache(cfg, max_len=16), k[:, :7], v[:, :7])
    assert np.all(np.asarray(cache.k_scale[0, 0, :1]) > 0)  # tokens 0-3
    assert not np.any(np.asarray(cache.k_scale[0, 0, 1:]))
    cache = kj.append(cache, k[:, 7], v[:, 7])
    assert np.all(np.asarray(cache.k_scale[0, 0, :2]) > 0)  # tokens 4-7 now too
    dk, _ = kj.dequantize(cache)
    assert _held_exactly(dk[0, :8], k[0, :8]).tolist() == [False] * 8  # Qk = 8: all quantized


def test_full_cache_stores_tokens_verbatim(rng):
    k, v = random_kv(rng, 2, 9, 2, 8, jnp.bfloat16)
    cache = kj.prefill(
        _cache(None, batch=2, max_len=12, heads=2, dtype=jnp.bfloat16),
        k[:, :8],
        v[:, :8],
        lengths=jnp.array([8, 5]),
    )
    cache = kj.append(cache, k[:, 8], v[:, 8])
    dk, dv = kj.dequantize(cache)
    np.testing.assert_array_equal(dk[0, :9], k[0])
    np.testing.assert_array_equal(dk[1, :5], k[1, :5])
    np.testing.assert_array_equal(dv[1, 5], v[1, 8])  # row 1's step lands after its 5 tokens
    assert not np.any(np.asarray(dk[1, 6:]))
    assert cache.k.shape == (2, 12, 2, 8)  # token-major [B, T, H, D], as cuDNN reads it
    np.testing.assert_array_equal(cache.k[0, :9], k[0])


@pytest.mark.parametrize("config", [None, CONFIGS[0]])
def test_capacity_is_checked_outside_jit(rng, config):
    k, v = random_kv(rng, 1, 10, 1, 8)
    cache = kj.prefill(_cache(config, max_len=10), k, v)
    with pytest.raises(ValueError, match="capacity exceeded: max_len=10"):
        kj.append(cache, k[:, 0], v[:, 0])
    with pytest.raises(ValueError, match="capacity exceeded"):
        kj.prefill(_cache(config, max_len=9), k, v)


def test_overflow_under_jit_is_flagged_not_stored(rng):
    k, v = random_kv(rng, 2, 10, 1, 8)
    cache = kj.prefill(_cache(CONFIGS[0], batch=2, max_len=10), k, v, lengths=jnp.array([10, 4]))
    after = jax.jit(kj.append)(cache, k[:, 0], v[:, 0])
    assert after.lengths.tolist() == [10, 5] and after.overflow.tolist() == [True, False]
    assert tree_equal(jax.tree.map(lambda x: x[:1], after.k_codes), cache.k_codes[:1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(k_bits=3), "k_bits must be one of"),
        (dict(v_bits=1), "v_bits must be one of"),
        (dict(group_size=6), "multiple of 4"),
        (dict(group_size=32, residual_length=48), "multiple of group_size=32"),
        (dict(residual_length=0), "positive multiple"),
    ],
)
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kj.KiviConfig(**kwargs)


def test_config_is_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        kj.KiviConfig(2, 2)
    with pytest.raises(AttributeError):
        kj.KIVI2.k_bits = 4


def test_bad_cache_arguments_are_rejected():
    with pytest.raises(ValueError, match="group_size=32 must divide head_dim=48"):
        _cache(kj.KIVI2, head_dim=48)
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        _cache(kj.KIVI2, max_len=0)
    with pytest.raises(ValueError, match="cache dtype must be"):
        _cache(kj.KIVI2, head_dim=32, dtype=jnp.int8)


def test_bad_prefill_and_append_inputs_are_rejected():
    cache = _cache(CONFIGS[0], batch=2, heads=2)
    ok = jnp.zeros((2, 3, 2, 8))
    with pytest.raises(ValueError, match=r"k must be \[batch, seq, kv_heads, head_dim\]"):
        kj.prefill(cache, ok[0], ok)
    with pytest.raises(ValueError, match="does not match the cache"):
        kj.prefill(cache, ok[:, :, :1], ok[:, :, :1])
    with pytest.raises(ValueError, match="k and v shapes differ"):
        kj.prefill(cache, ok, ok[:, :2])
    with pytest.raises(ValueError, match="must be floating point"):
        kj.prefill(cache, ok.astype(jnp.int32), ok.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, seq=3\]; rows \[1\]"):
        kj.prefill(cache, ok, ok, lengths=jnp.array([3, 4]))
    with pytest.raises(ValueError, match="lengths must be integers of shape"):
        kj.prefill(cache, ok, ok, lengths=jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="active must be bools"):
        kj.append(cache, ok[:, 0], ok[:, 0], active=jnp.array([1, 0]))
    with pytest.raises(ValueError, match=r"k must be \[batch, kv_heads, head_dim\]"):
        kj.append(cache, ok, ok)


def test_packed_layout_matches_the_documented_bit_order(rng):
    # Keys pack 4 tokens per byte along tokens: byte 0 of channel d holds tokens 0..3.
    cfg = kj.KiviConfig(group_size=4, residual_length=4)
    k, v = random_kv(rng, 1, 8, 1, 8)
    cache = kj.prefill(_cache(cfg, max_len=8), k, v)
    codes, _, _ = qz.quantize(jnp.swapaxes(k, 1, 2)[:, :, :4], 2, 4, axis=2, dtype=jnp.float32)
    byte0 = sum(codes[0, 0, i].astype(jnp.int32) << (2 * i) for i in range(4))
    np.testing.assert_array_equal(cache.k_codes[0, 0, 0], byte0)


@pytest.mark.parametrize("config", [None, kj.KIVI2])
def test_a_jitted_append_does_not_copy_the_cache(config):
    # With the cache donated, a step's scratch memory is what it writes (a token, the group it
    # may complete, the value leaving the window), whatever the capacity.
    # (float32: XLA on the CPU widens bfloat16 scatters to float32, a CPU-only copy.)
    def scratch_bytes(max_len):
        cache = _cache(config, batch=2, max_len=max_len, heads=2, head_dim=64)
        k = jnp.ones((2, 2, 64))
        step = jax.jit(kj.append, donate_argnums=0)
        return step.lower(cache, k, k).compile().memory_analysis().temp_size_in_bytes

    small = scratch_bytes(4096)
    assert small == scratch_bytes(32768)
    assert small < 2 * 2 * 128 * 64 * 4  # less than one ring: no array of the cache is copied
