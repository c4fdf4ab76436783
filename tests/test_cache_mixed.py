"""The mixed-precision KIVI state: sinks, sliding keys, fine key channels, heavy tokens."""

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import prefill_then_appends, random_kv, tree_equal
from hypothesis import given, settings

import kivi_jax as kj
from kivi_jax import quantization as qz

ERROR, MASS = kj.Selection.ERROR, kj.Selection.MASS
SMALL = dict(group_size=4, residual_length=8)


def _cache(config, batch=1, max_len=48, heads=1, head_dim=8, dtype=jnp.float32, **kw):
    shape = dict(batch=batch, max_len=max_len, num_kv_heads=heads, head_dim=head_dim)
    return kj.init_cache(config, **shape, dtype=dtype, **kw)


def _queries(rng, batch, seq, heads, d):
    return jnp.asarray(rng.normal(size=(batch, seq, heads, d)), jnp.float32)


def test_plain_configs_hold_no_side_storage():
    assert not kj.KIVI2.mixed and not kj.KIVI4.mixed and kj.KIVI2_MIX.mixed
    cache = _cache(kj.KIVI2, head_dim=64)
    assert cache.side is None
    assert len(jax.tree.leaves(cache)) == 10  # the plain layout's arrays, nothing added


def test_sinks_are_kept_and_left_out_of_the_first_key_group(rng):
    # G = 4, S = 1: token 0's key is an outlier (100 in every channel). The first group's scale
    # and zero come from tokens 1-3 alone, so they keep their resolution.
    cfg = kj.KiviConfig(**SMALL, sinks=1)
    k, v = random_kv(rng, 1, 12, 1, 8)
    k = k.at[0, 0].set(100.0)
    cache = kj.prefill(_cache(cfg), k, v)
    lo, hi = jnp.min(k[0, 1:4, 0], axis=0), jnp.max(k[0, 1:4, 0], axis=0)
    np.testing.assert_array_equal(cache.k_zero[0, 0, 0], lo)
    np.testing.assert_allclose(cache.k_scale[0, 0, 0], (hi - lo) / 3, rtol=1e-6)
    np.testing.assert_array_equal(cache.side.sink_k[0, 0, 0], k[0, 0, 0])
    np.testing.assert_array_equal(cache.side.sink_v[0, 0, 0], v[0, 0, 0])
    dk, dv = kj.dequantize(cache)  # l = 12, R = 8: tokens 0-3 quantized, but token 0 is a sink
    np.testing.assert_array_equal(dk[0, 0], k[0, 0])
    np.testing.assert_array_equal(dv[0, 0], v[0, 0])
    assert not np.array_equal(dk[0, 1], k[0, 1])


def test_sliding_keys_read_the_last_r_keys_from_the_ring(rng):
    # l = 11, R = 8: plain KIVI reads keys [8, 11) from the ring (l mod R = 3), sliding keys
    # read [3, 11), like the values.
    k, v = random_kv(rng, 1, 11, 1, 8)

    def exact(cfg):
        dk, _ = kj.dequantize(kj.prefill(_cache(cfg, max_len=11), k, v))
        return np.all(np.asarray(dk[0]) == np.asarray(k[0]), axis=(1, 2)).tolist()

    assert exact(kj.KiviConfig(**SMALL)) == [False] * 8 + [True] * 3
    assert exact(kj.KiviConfig(**SMALL, sliding_keys=True)) == [False] * 3 + [True] * 8


def test_fine_channels_are_the_widest_and_read_as_a_code_of_twice_the_bits(rng):
    # One group of 4 tokens, 8 channels; channels 2 and 5 have the widest ranges.
    cfg = kj.KiviConfig(group_size=4, residual_length=4, fine_key_channels=2)
    k, v = random_kv(rng, 1, 8, 1, 8)
    k = k.at[0, :4, 0, 2].multiply(30.0).at[0, :4, 0, 5].multiply(20.0)
    cache = kj.prefill(_cache(cfg, max_len=8), k, v)
    assert cache.side.fine_channels[0, 0, 0].tolist() == [2, 5]
    dk, _ = kj.dequantize(cache)
    dk = np.asarray(dk[0, :4, 0])  # [token, channel]
    group = k[:, :4].astype(jnp.float32)  # [1, 4, 1, 8]
    four_bit = np.asarray(qz.fake_quantize(group, 4, 4, axis=1)[0, :, 0])  # per channel
    two_bit = np.asarray(qz.fake_quantize(group, 2, 4, axis=1)[0, :, 0])
    fine, others = [2, 5], [0, 1, 3, 4, 6, 7]
    np.testing.assert_allclose(dk[:, fine], four_bit[:, fine], rtol=1e-6)
    np.testing.assert_array_equal(dk[:, others], two_bit[:, others])
    # k_codes, k_scale, k_zero alone read as a coarse 2-bit key: the fine code's high bits
    # (a floor of the fine code: at most 3 fine steps below it).
    coarse = qz.dequantize(qz.unpack_codes(cache.k_codes, 2, axis=2), cache.k_scale,
                           cache.k_zero, 4, axis=2)[0, 0, :4]  # fmt: skip
    step = np.asarray(cache.k_scale[0, 0, 0])[fine] / 4
    err = np.asarray(coarse)[:, fine] - four_bit[:, fine]
    assert np.all((err <= 1e-5) & (err >= -3 * step - 1e-5))


@pytest.mark.parametrize("selection", [ERROR, MASS])
def test_the_most_important_token_stays_in_full_precision(rng, selection):
    # Token 13 is the one every query attends to (MASS) and the one whose value 2 bits
    # represent worst (ERROR); after it leaves the window it is a heavy token.
    cfg = kj.KiviConfig(**SMALL, sinks=1, sliding_keys=True, heavy_tokens=1, selection=selection)
    k, v = random_kv(rng, 1, 40, 1, 8)
    k = k.at[0, 13, 0].set(jnp.linspace(-3, 3, 8))
    v = v.at[0, 13, 0, :3].set(jnp.array([9.0, -9.0, 5.0]))
    q = jnp.broadcast_to(8.0 * k[:, 13:14], (1, 40, 1, 8))
    cache = kj.prefill(_cache(cfg), k, v, q=q)
    assert cache.side.heavy_pos[0, 0].tolist() == [13]
    dk, dv = kj.dequantize(cache)
    np.testing.assert_array_equal(dk[0, 13], k[0, 13])
    np.testing.assert_array_equal(dv[0, 13], v[0, 13])


MIXED_CONFIGS = [
    kj.KiviConfig(**SMALL, sinks=2, sliding_keys=True, fine_key_channels=3, heavy_tokens=3,
                  selection=ERROR),
    kj.KiviConfig(k_bits=4, v_bits=2, group_size=4, residual_length=12, sinks=1,
                  fine_key_channels=1, heavy_tokens=2, selection=ERROR),
]  # fmt: skip


@settings(max_examples=4, deadline=None)
@given(
    cfg=st.sampled_from(MIXED_CONFIGS),
    n=st.integers(0, 30),
    m=st.integers(0, 14),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_prefill_then_appends_equals_one_prefill_with_error_scores(cfg, n, m, dtype, seed):
    rng = np.random.default_rng(seed)
    k, v = random_kv(rng, 2, 44, 2, 8, dtype, outliers=True)
    whole, stepped = prefill_then_appends(_cache(cfg, batch=2, heads=2, dtype=dtype), k, v, n, m)
    assert tree_equal(whole, stepped)


def test_prefill_then_appends_with_mass_scores_differ_only_in_rounding(rng):
    cfg = dataclasses.replace(MIXED_CONFIGS[0], selection=MASS)
    k, v = random_kv(rng, 2, 40, 2, 8, outliers=True)
    q = _queries(rng, 2, 40, 4, 8)
    lengths = jnp.array([40, 27])
    whole = kj.prefill(_cache(cfg, batch=2, heads=2), k, v, lengths=lengths, q=q)
    stepped = kj.prefill(_cache(cfg, batch=2, heads=2), k[:, :9], v[:, :9], q=q[:, :9])
    for t in range(9, 40):
        active = jnp.asarray(t < lengths)
        stepped = kj.append(stepped, k[:, t], v[:, t], active=active, q=q[:, t])
    scores = ("heavy_score", "ring_score")
    for name in scores:  # the same R contributions, summed in another order
        a, b = getattr(whole.side, name), getattr(stepped.side, name)
        np.testing.assert_allclose(np.where(np.isfinite(a), a, 0), np.where(np.isfinite(b), b, 0),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    strip = lambda c: dataclasses.replace(
        c, side=dataclasses.replace(c.side, **{n: None for n in scores})
    )
    assert tree_equal(strip(whole), strip(stepped))  # same tokens chosen, everything else exact
    assert np.all(np.asarray(whole.side.heavy_pos) >= cfg.sinks)  # every slot filled


def test_mass_scores_need_the_queries(rng):
    cfg = dataclasses.replace(MIXED_CONFIGS[0], selection=MASS)
    k, v = random_kv(rng, 1, 4, 1, 8)
    with pytest.raises(ValueError, match=r"pass the queries, prefill\(\.\.\., q=q\)"):
        kj.prefill(_cache(cfg), k, v)
    with pytest.raises(ValueError, match=r"q_heads=3 must be a multiple of kv_heads=2"):
        kj.prefill(_cache(cfg, heads=2), *random_kv(rng, 1, 4, 2, 8), q=_queries(rng, 1, 4, 3, 8))
    with pytest.raises(ValueError, match=r"pass the queries, append"):
        kj.append(_cache(cfg), k[:, 0], v[:, 0])


@pytest.mark.parametrize("selection", [ERROR, MASS])
def test_each_row_of_a_ragged_batch_is_as_if_alone(rng, selection):
    cfg = dataclasses.replace(MIXED_CONFIGS[0], selection=selection)
    lengths = [0, 5, 13, 30]
    k, v = random_kv(rng, len(lengths), 32, 2, 8, outliers=True)
    q = _queries(rng, len(lengths), 32, 4, 8)
    pad = np.arange(32)[None, :, None, None] >= np.array(lengths)[:, None, None, None]
    k, v, q = jnp.where(pad, 1e4, k), jnp.where(pad, -1e4, v), jnp.where(pad, 1e2, q)
    batch = kj.prefill(_cache(cfg, batch=4, heads=2), k, v, lengths=jnp.array(lengths), q=q)
    for b, n in enumerate(lengths):
        alone = kj.prefill(_cache(cfg, heads=2), k[b : b + 1, :n], v[b : b + 1, :n],
                           q=q[b : b + 1, :n])  # fmt: skip
        row = jax.tree.map(lambda x, b=b: x[b : b + 1], batch)
        if selection is ERROR:
            assert tree_equal(row, alone)
        else:  # the row's mass sums run over a padded band: equal up to rounding
            for x, y in zip(jax.tree.leaves(row), jax.tree.leaves(alone), strict=True):
                np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                           rtol=1e-5, atol=1e-6)  # fmt: skip


def test_memory_report_counts_the_side_storage():
    caches = _cache(kj.KIVI2_MIX, batch=2, max_len=2048, heads=3, head_dim=64, num_layers=2)
    report = kj.memory_report(caches)
    assert report.total_bytes == sum(x.nbytes for x in jax.tree.leaves(caches))
    # Per layer and sequence and KV head, float32: sinks 2 x 4 x 64 x 4 = 2048; fine planes
    # 2048 x 16 x 2 / 8 = 8192 and channel indices 64 groups x 16 = 1024; 32 heavy slots of
    # 2 x 64 x 4 + 4 + 4 = 520 bytes (scores by ERROR: no ring scores).
    assert report.side_bytes == 2 * 2 * 3 * (2048 + 8192 + 1024 + 32 * 520)
    plain = kj.memory_report(_cache(kj.KIVI2, batch=2, max_len=2048, heads=3, head_dim=64,
                                    num_layers=2))  # fmt: skip
    assert report.total_bytes - report.side_bytes == plain.total_bytes
    assert report.total_bytes <= 1.15 * plain.total_bytes  # the target at 2k tokens


def test_held_bits_count_the_side_storage():
    # l = 1000, R = 128, sliding keys: 872 tokens quantized for keys and values.
    held = kj.held_bits(kj.KIVI2_MIX, length=1000, head_dim=64, dtype=jnp.float32)
    plain = kj.held_bits(kj.KIVI2, length=1000, head_dim=64, dtype=jnp.float32)
    assert held.code_bits == 2 * 872 * 2 * 64
    assert held.residual_bits == 2 * 128 * 64 * 32
    assert plain.residual_bits == (104 + 128) * 64 * 32  # keys: l mod R = 104
    side = 872 * 16 * 2 + 8 * 16 * 872 // 32 + 4 * 2 * 64 * 32 + 32 * (2 * 64 * 32 + 64)
    assert held.side_bits == side
    mass = dataclasses.replace(kj.KIVI2_MIX, selection=kj.Selection.MASS)
    ring_scores = 128 * 32  # a float32 score per token in the window
    assert kj.held_bits(mass, length=1000, head_dim=64, dtype=jnp.float32).side_bits == (
        side + ring_scores
    )
    assert held.total_bits == held.code_bits + held.scale_zero_bits + held.residual_bits + side


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sinks=32), "sinks=32 must be below group_size=32"),
        (dict(heavy_tokens=-1), "heavy_tokens must be a non-negative int"),
        (dict(k_bits=8, fine_key_channels=4), "needs k_bits of 2 or 4"),
        (dict(selection="mass"), "selection must be a Selection"),
    ],
)
def test_bad_mixed_configs_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kj.KiviConfig(**kwargs)
    with pytest.raises(ValueError, match="fine_key_channels=64 must be below head_dim=64"):
        _cache(kj.KiviConfig(fine_key_channels=64), head_dim=64)


def test_a_jitted_mixed_append_does_not_copy_the_cache():
    def scratch_bytes(max_len):
        cache = _cache(kj.KIVI2_MIX, batch=2, max_len=max_len, heads=2, head_dim=64)
        k, q = jnp.ones((2, 2, 64)), jnp.ones((2, 4, 64))
        step = jax.jit(lambda c, k, v, q: kj.append(c, k, v, q=q), donate_argnums=0)
        return step.lower(cache, k, k, q).compile().memory_analysis().temp_size_in_bytes

    small = scratch_bytes(4096)
    assert small == scratch_bytes(32768)  # a step's scratch does not grow with the capacity


def test_the_widest_channels_are_top_ks_in_the_floats_total_order():
    # spreads drawn from a few values (ties go to the lower channel), +-0, +-inf and NaNs of
    # either sign (lax.top_k's order: -NaN < -inf < -0 < +0 < +inf < +NaN)
    rng = np.random.default_rng(0)
    pool = np.array([0.0, -0.0, 1.0, 2.0, 3.5, np.inf, -np.inf, np.nan, -np.nan], np.float32)
    for d, f in [(8, 3), (16, 1), (64, 16), (64, 63)]:
        spread = jnp.asarray(rng.choice(pool, size=(50, d)))
        is_fine, channels = qz.widest_channels(spread, f)
        want = jnp.sort(jax.lax.top_k(spread, f)[1], axis=-1)
        np.testing.assert_array_equal(channels, want)
        assert bool(jnp.all(jnp.sum(is_fine, axis=-1) == f))
        np.testing.assert_array_equal(jnp.take_along_axis(is_fine, want, axis=-1), True)


def _heavy_slots(rng, batch, heads, n, d, sinks=0):
    """Heavy slots [batch, heads, n] filled to random counts with sorted positions below 100
    and scores from {0, 1, 2, +inf} (ties), after `sinks` random sinks in the extras, and
    candidates at position 100 whose scores tie, beat or lose to the slots' (NaN among them),
    some not candidates."""
    pos = np.full((batch, heads, n), -1, np.int32)
    score = np.full((batch, heads, n), -np.inf, np.float32)
    hk, hv = np.zeros((2, batch, heads, n, d), np.float32)
    for b in range(batch):
        for h in range(heads):
            c = rng.integers(0, n + 1) if b % 2 else n  # even rows full
            pos[b, h, :c] = np.sort(rng.choice(100, c, replace=False))
            score[b, h, :c] = rng.choice([0.0, 1.0, 2.0, np.inf], c)
            hk[b, h, :c], hv[b, h, :c] = rng.normal(size=(2, c, d))
    extra_k, extra_v = (
        jnp.asarray(np.concatenate([rng.normal(size=(batch, heads, sinks, d)), x], axis=2))
        for x in (hk, hv)
    )  # the sinks, then the heavy slots
    side = kj.MixedState(extra_k, extra_v, None, None, jnp.asarray(pos), jnp.asarray(score), None)
    cand = dict(
        k=jnp.asarray(rng.normal(size=(batch, heads, 1, d)), jnp.float32),
        v=jnp.asarray(rng.normal(size=(batch, heads, 1, d)), jnp.float32),
        pos=jnp.full((batch, heads, 1), 100, jnp.int32),
        score=jnp.asarray(rng.choice([0.0, 1.0, 2.0, 3.0, np.inf, np.nan], (batch, heads, 1))),
        valid=jnp.asarray(np.repeat(rng.random((batch, 1, 1)) < 0.8, heads, axis=1)),
    )
    return side, cand


def test_a_decode_steps_heavy_merge_keeps_the_slots_the_sort_keeps():
    from kivi_jax import cache as kc

    side, c = _heavy_slots(np.random.default_rng(1), 64, 2, 4, 3)
    args = (side, c["k"], c["v"], c["pos"], c["score"], c["valid"], 4)
    want, got = kc._merge_heavy(*args), kc._merge_one_heavy(*args)
    assert tree_equal(got, want)
