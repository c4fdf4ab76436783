"""The KIVI streaming state: the paper's rules, exact equivalences and errors."""

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import prefill_then_appends, random_kv, tree_equal
from hypothesis import example, given, settings

import kivi_jax as kj
from kivi_jax import quantization as qz
from kivi_jax.cache import BATCH_AXIS, kv_head_axis


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
    whole, stepped = prefill_then_appends(_cache(cfg, batch=2, heads=2, dtype=dtype), k, v, n, m)
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


@pytest.mark.parametrize(
    "config",
    [
        None,
        kj.KIVI2,
        kj.KIVI4,
        kj.KIVI2_MIX,
        kj.KiviConfig(heavy_tokens=4, selection=kj.Selection.MASS),
        kj.KIVI2_LEAN,
    ],
    ids=["full", "kivi2", "kivi4", "kivi2-mix", "mass", "kivi2-lean"],
)
def test_every_array_has_batch_on_axis_0_and_its_head_axis_in_the_table(config):
    # B = 3 and H = 5 appear in no other dimension, so each axis is identified by its size.
    caches = _cache(config, batch=3, max_len=70, heads=5, head_dim=64, num_layers=2)

    def check(path, x):
        assert x.shape[BATCH_AXIS] == 3, path
        axis = kv_head_axis(path)
        assert [i for i, n in enumerate(x.shape) if n == 5] == ([] if axis is None else [axis])

    jax.tree_util.tree_map_with_path(check, caches)


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


# ---------------------------------------------------------------------------- the API at random

# Each faulty case makes one mistake and must raise this error, naming the argument.
FAULTS = {
    "k_bits": (ValueError, r"KiviConfig\.k_bits must be one of \(2, 4, 8\)"),
    "v_bits": (ValueError, r"KiviConfig\.v_bits must be one of \(2, 4, 8\)"),
    "residual_length": (ValueError, r"KiviConfig\.residual_length must be a positive multiple"),
    "head_dim": (ValueError, r"group_size=\d+ must divide head_dim=\d+"),
    "dtype": (ValueError, "cache dtype must be float32, bfloat16 or float16"),
    "max_len": (ValueError, "max_len must be a positive integer"),
    "lengths": (ValueError, r"prefill: lengths must lie in \[0, seq=\d+\]"),
    "capacity": (ValueError, r"cache capacity exceeded: max_len=\d+"),
    "kv_dtype": (ValueError, "prefill: k must be floating point"),
    "kv_heads": (ValueError, r"prefill: k of shape .* does not match the cache"),
    "num_layers": (TypeError, r"tuple of 2 .* pass one of them, caches\[i\]"),
}


@dataclasses.dataclass(frozen=True)
class ApiCase:
    """init_cache, a prefill of `seq` positions (`lengths` real per row), one append per entry
    of `active` (the rows that take a token), then dequantize; `fault` names its one mistake."""

    config: dict | None  # KiviConfig fields; None: the full-precision cache
    batch: int
    heads: int
    head_dim: int
    dtype: str  # the cache's
    kv_dtype: str  # the keys' and values' (cast to the cache's)
    max_len: object
    seq: int
    lengths: tuple
    active: tuple
    scale: float
    seed: int
    fault: str | None = None


@st.composite
def api_cases(draw):
    fault = draw(st.none() | st.sampled_from(sorted(FAULTS)))
    g = draw(st.sampled_from([4, 8, 16, 32]))
    r = g * draw(st.integers(1, 3))
    config = None
    if fault in ("k_bits", "v_bits", "residual_length", "head_dim") or draw(st.integers(0, 3)):
        bits = lambda name: draw(st.sampled_from([1, 3, 16] if fault == name else [2, 4, 8]))
        config = dict(k_bits=bits("k_bits"), v_bits=bits("v_bits"), group_size=g,
                      residual_length=r + g // 2 * (fault == "residual_length"))  # fmt: skip
    batch = draw(st.integers(1, 3))
    seq = draw(st.integers(2 if fault == "capacity" else 1, 2 * r + g + 1))  # past 2 flushes
    lengths = draw(st.lists(st.integers(0, seq), min_size=batch, max_size=batch))
    if fault == "lengths":
        lengths[draw(st.integers(0, batch - 1))] = draw(st.sampled_from([-1, seq + 1]))
    if fault == "capacity":
        lengths[0] = seq
    active = draw(st.lists(st.tuples(*[st.booleans()] * batch), max_size=2))
    held = max(n + sum(a[b] for a in active) for b, n in enumerate(lengths))
    if fault == "max_len":
        max_len = draw(st.sampled_from([0, -3, 2.5]))
    elif fault == "capacity":
        max_len = held - 1
    else:
        max_len = max(held, 1) + draw(st.integers(0, 40))
    floats = st.sampled_from(["float32", "bfloat16", "float16"])
    return ApiCase(
        config=config,
        batch=batch,
        heads=draw(st.integers(1, 2)),
        head_dim=g * draw(st.integers(1, 2)) + g // 2 * (fault == "head_dim"),
        dtype=draw(st.sampled_from(["int8", "float64"])) if fault == "dtype" else draw(floats),
        kv_dtype="int32" if fault == "kv_dtype" else draw(floats),
        max_len=max_len,
        seq=seq,
        lengths=tuple(lengths),
        active=tuple(active),
        scale=draw(st.sampled_from([0.01, 1.0, 30.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
        fault=fault,
    )


def _run(case: ApiCase):
    """The calls of `case`: (the cache, k, v [batch, seq + appends, heads, head_dim])."""
    config = None if case.config is None else kj.KiviConfig(**case.config)
    cache = kj.init_cache(
        config, batch=case.batch, max_len=case.max_len, num_kv_heads=case.heads,
        head_dim=case.head_dim, dtype=case.dtype,
        num_layers=2 if case.fault == "num_layers" else None,
    )  # fmt: skip
    rng = np.random.default_rng(case.seed)
    shape = (case.batch, case.seq + len(case.active), case.heads + (case.fault == "kv_heads"))
    k, v = (case.scale * rng.normal(size=(*shape, case.head_dim)) for _ in range(2))
    k[..., ::4] *= 10  # outlier channels, as real keys have
    k, v = (jnp.asarray(x, case.kv_dtype) for x in (k, v))
    cache = kj.prefill(cache, k[:, : case.seq], v[:, : case.seq], lengths=jnp.array(case.lengths))
    for j, active in enumerate(case.active):
        t = case.seq + j
        cache = kj.append(cache, k[:, t], v[:, t], active=jnp.array(active))
    return cache, k, v


def _check_round_trip(case: ApiCase) -> None:
    cache, k, v = _run(case)
    # Each row holds its prefilled tokens, then the appended ones it was active for.
    rows = [
        list(range(n)) + [case.seq + j for j, a in enumerate(case.active) if a[b]]
        for b, n in enumerate(case.lengths)
    ]
    assert cache.lengths.tolist() == [len(t) for t in rows]  # never a silent no-op
    assert not cache.overflow.any()
    dk, dv = (np.asarray(x) for x in kj.dequantize(cache, dtype=jnp.float32))
    assert dk.shape == (case.batch, case.max_len, case.heads, case.head_dim)
    # What the cache stores: the tokens cast to its dtype.
    k, v = (np.asarray(x.astype(case.dtype).astype(jnp.float32)) for x in (k, v))
    for b, tokens in enumerate(rows):
        n, kb, vb = len(tokens), k[b, tokens], v[b, tokens]  # [n, H, D]
        assert not dk[b, n:].any() and not dv[b, n:].any()  # past the length: zero
        if case.config is None:
            np.testing.assert_array_equal(dk[b, :n], kb)
            np.testing.assert_array_equal(dv[b, :n], vb)
            continue
        g, r = case.config["group_size"], case.config["residual_length"]
        qk, pv = n - n % r, max(n - r, 0)  # keys [0, qk) and values [0, pv) are quantized
        np.testing.assert_array_equal(dk[b, qk:n], kb[qk:])  # the full-precision window
        np.testing.assert_array_equal(dv[b, pv:n], vb[pv:])
        # A key's step is its channel's per G tokens, a value's its token's per G channels.
        k_step = np.repeat(np.asarray(cache.k_scale[b], np.float32), g, axis=1)  # [H, C, D]
        v_step = np.repeat(np.asarray(cache.v_scale[b], np.float32), g, axis=2)  # [H, C, D]
        k_step, v_step = (np.swapaxes(x, 0, 1) for x in (k_step, v_step))  # [C, H, D]
        for name, got, want, step, m in (
            ("key", dk, kb, k_step, qk),
            ("value", dv, vb, v_step, pv),
        ):
            slack = 1e-6 * (1 + np.abs(want[:m]))  # float32 rounding of code * scale + zero
            excess = np.abs(got[b, :m] - want[:m]) - (step[:m] / 2 + slack)
            assert excess.max(initial=0) <= 0, f"row {b}: a {name} {excess.max()} past half a step"


@settings(max_examples=12, deadline=None)  # about half faulty (no compilation), half compiled
@given(case=api_cases())
# KIVI-2 at its defaults, float32 tokens into a bfloat16 cache, both windows flushed past
@example(
    ApiCase(
        config=dict(k_bits=2, v_bits=2, group_size=32, residual_length=128),
        batch=2,
        heads=2,
        head_dim=64,
        dtype="bfloat16",
        kv_dtype="float32",
        max_len=300,
        seq=270,
        lengths=(270, 17),
        active=((True, False),),
        scale=1.0,
        seed=0,
    )
)
# The full-precision cache: stored as is
@example(
    ApiCase(
        config=None,
        batch=1,
        heads=1,
        head_dim=8,
        dtype="float16",
        kv_dtype="float16",
        max_len=20,
        seq=9,
        lengths=(9,),
        active=((True,),),
        scale=1.0,
        seed=1,
    )
)
def test_the_api_round_trips_within_the_bound_or_names_the_bad_argument(case):
    """Random configs, shapes, dtypes, lengths and capacities: the state dequantizes to the
    tokens it holds (quantized ones within half their group's step, the window exact, zeros past
    the length), or the one mistake raises a ValueError or TypeError that names it."""
    if case.fault is None:
        _check_round_trip(case)
    else:
        error, match = FAULTS[case.fault]
        with pytest.raises(error, match=match):
            _run(case)
