"""Property tests of the public API (hypothesis, bounded): random valid inputs agree with the
reference path, random invalid ones raise ValueError or TypeError naming the argument, and
planted NaN, inf and extreme values follow docs/design.md's "Non-finite and extreme values":

- finite tokens anywhere in the cache dtype's range give a finite state and a finite
  `dequantize`;
- a non-finite key or value makes its own quantization group non-finite (never a finite
  number) and no other entry;
- prefill and token-by-token appends stay bit-identical (NaN equal to NaN);
- decode attention is finite wherever the reference's is.
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import prefill_then_appends, tree_equal
from hypothesis import example, given, settings
from tiny_model import tiny_params

import kivi_jax as kj

# Four configs (plain; every mixed-precision part with ERROR selection, for which prefill
# equals appends bit-identically; the same in kivi2-lean's 8-bit formats, and with the range
# search for keys and values), one shape: few compilations.
_MIXED = kj.KiviConfig(
    k_bits=2, v_bits=2, group_size=4, residual_length=8, sinks=1, sliding_keys=True,
    fine_key_channels=2, heavy_tokens=2, selection=kj.Selection.ERROR,
)  # fmt: skip
_LEAN = dataclasses.replace(
    _MIXED, k_scale_format=kj.KIVI2_LEAN.k_scale_format,
    v_scale_format=kj.KIVI2_LEAN.v_scale_format, residual_format=kj.KIVI2_LEAN.residual_format,
)  # fmt: skip
CONFIGS = {
    "plain": kj.KiviConfig(k_bits=2, v_bits=4, group_size=4, residual_length=8),
    "mixed": _MIXED,
    "lean": _LEAN,
    "search": dataclasses.replace(_LEAN, k_range=kj.Range.SEARCH, v_range=kj.Range.SEARCH),
}
B, T, H, D = 2, 21, 2, 8  # T tokens: two flushes of R = 8 and a partial window


def _planted(seed, dtype, plants):
    """Random keys and values [B, T, H, D] in `dtype` with `plants` written in:
    (which, b, t, h, d, value)."""
    rng = np.random.default_rng(seed)
    kv = [rng.normal(size=(B, T, H, D)).astype(np.float32) for _ in range(2)]
    for which, b, t, h, d, value in plants:
        kv[which][b, t, h, d] = value
    return [jnp.asarray(x, dtype) for x in kv]


def _own_groups(plants, g):
    """[2, B, T, H, D] bool: the entries in the quantization group of a planted non-finite
    value (a key's group: its channel over G tokens; a value's: its token over G channels)."""
    mask = np.zeros((2, B, T, H, D), bool)
    for which, b, t, h, d, value in plants:
        if np.isfinite(value):
            continue
        if which == 0:
            mask[0, b, t - t % g : t - t % g + g, h, d] = True
        else:
            mask[1, b, t, h, d - d % g : d - d % g + g] = True
    return mask


plant = st.tuples(
    st.integers(0, 1),
    st.integers(0, B - 1),
    st.integers(0, T - 1),
    st.integers(0, H - 1),
    st.integers(0, D - 1),
    st.sampled_from([np.nan, np.inf, -np.inf]),
)


def _check_non_finite_locality(config, dtype, plants, n, seed):
    cfg = CONFIGS[config]
    k, v = _planted(seed, dtype, plants)
    fresh = kj.init_cache(cfg, batch=B, max_len=T, num_kv_heads=H, head_dim=D, dtype=dtype)
    whole, stepped = prefill_then_appends(fresh, k, v, n, T - n)
    assert tree_equal(whole, stepped)
    got = np.stack([np.asarray(x, np.float32) for x in kj.dequantize(whole)])
    planted = ~np.isfinite(np.stack([np.asarray(x, np.float32) for x in (k, v)]))
    # Never turned into a finite number; no other entry touched.
    assert not np.isfinite(got[planted]).any()
    assert np.isfinite(got[~_own_groups(plants, cfg.group_size)]).all()


non_finite_cases = dict(
    plants=st.lists(plant, max_size=3), n=st.integers(0, T), seed=st.integers(0, 2**31 - 1)
)


@settings(max_examples=6, deadline=None)
@given(
    kind=st.sampled_from([("plain", "bfloat16"), ("mixed", "float32"), ("lean", "bfloat16")]),
    **non_finite_cases,
)
@example(  # the float8 formats, always: a NaN key, an inf value (NaN in e4m3), a sink's inf key
    kind=("lean", "bfloat16"),
    plants=[(0, 0, 5, 1, 3, np.nan), (1, 1, 2, 0, 6, np.inf), (0, 1, 0, 0, 1, -np.inf)],
    n=7,
    seed=1,
)
@example(  # the range search, always: a NaN key, an inf value
    kind=("search", "float32"),
    plants=[(0, 1, 9, 0, 2, np.nan), (1, 0, 15, 1, 5, np.inf)],
    n=14,
    seed=4,
)
def test_a_non_finite_token_stays_in_its_group_and_prefill_still_equals_appends(
    kind, plants, n, seed
):
    _check_non_finite_locality(*kind, plants, n, seed)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(
    config=st.sampled_from(sorted(CONFIGS)),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    **non_finite_cases,
)
def test_a_non_finite_token_stays_in_its_group_in_every_dtype(
    slow_only, config, dtype, plants, n, seed
):
    _check_non_finite_locality(config, dtype, plants, n, seed)


# The largest finite value of each cache dtype: a group holding +-max spans twice the range.
EXTREMES = {d: float(jnp.finfo(d).max) for d in ("float32", "bfloat16", "float16")}


extreme_cases = dict(
    signs=st.lists(st.tuples(st.integers(0, 1), st.integers(0, T - 1), st.integers(0, D - 1),
                             st.sampled_from([-1.0, 1.0, 0.5, -0.9])), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)  # fmt: skip


@settings(max_examples=5, deadline=None)
@given(
    kind=st.sampled_from([("plain", "bfloat16"), ("mixed", "float32"), ("lean", "float32")]),
    **extreme_cases,
)
@example(kind=("lean", "float32"), signs=[(0, 3, 2, -1.0), (0, 4, 2, 1.0), (1, 9, 5, 0.5)], seed=2)
@example(kind=("search", "float32"), signs=[(0, 3, 2, -1.0), (1, 9, 5, 0.5)], seed=3)
def test_finite_tokens_anywhere_in_the_dtype_range_dequantize_finite(kind, signs, seed):
    _check_extremes(*kind, signs, seed)


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(
    config=st.sampled_from(sorted(CONFIGS)), dtype=st.sampled_from(sorted(EXTREMES)),
    **extreme_cases,
)  # fmt: skip
def test_finite_tokens_dequantize_finite_in_every_dtype(slow_only, config, dtype, signs, seed):
    _check_extremes(config, dtype, signs, seed)


def _check_extremes(config, dtype, signs, seed):
    cfg, top = CONFIGS[config], EXTREMES[dtype]
    signs = {(which, t, d): s for which, t, d, s in signs}  # the last plant of an entry wins
    plants = [(which, 0, t, 0, d, s * top) for (which, t, d), s in signs.items()]
    k, v = _planted(seed, dtype, plants)
    fresh = kj.init_cache(cfg, batch=B, max_len=T, num_kv_heads=H, head_dim=D, dtype=dtype)
    whole, stepped = prefill_then_appends(fresh, k, v, T // 2, T - T // 2)
    assert tree_equal(whole, stepped)
    # Every stored value is finite (heavy-token scores are rankings: +inf ranks first).
    for path, leaf in jax.tree_util.tree_leaves_with_path(whole):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and "score" not in path[-1].name:
            assert np.isfinite(np.asarray(leaf, np.float32)).all(), path[-1].name
    dk, dv = kj.dequantize(whole)
    assert np.isfinite(np.asarray(dk, np.float32)).all()
    assert np.isfinite(np.asarray(dv, np.float32)).all()
    # The extremes themselves come back within half a step of their group, i.e. not clipped
    # to a neighbour's sign.
    for (which, t, d), s in signs.items():
        got = float(np.asarray((dk, dv)[which], np.float32)[0, t, 0, d])
        assert np.sign(got) == np.sign(s) or abs(s) < 1


@settings(max_examples=6, deadline=None)
@given(
    kind=st.sampled_from(["plain", "mixed", "lean", "full"]),
    plants=st.lists(plant, min_size=1, max_size=2),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_non_finite_token_makes_attention_non_finite_only_for_the_heads_that_read_it(
    kind, plants, seed
):
    cfg = None if kind == "full" else CONFIGS[kind]
    k, v = _planted(seed, "float32", plants)
    cache = kj.init_cache(cfg, batch=B, max_len=T, num_kv_heads=H, head_dim=D, dtype="float32")
    cache = kj.prefill(cache, k, v)
    q = jnp.asarray(np.random.default_rng(seed).normal(size=(B, 2 * H, D)), jnp.float32)
    out = np.asarray(kj.decode_attention(q, cache, impl="reference"))
    dk, dv = (np.asarray(x) for x in kj.dequantize(cache))  # [B, T, H, D]
    per_head = lambda f: np.repeat(f(dk).any(axis=(1, 3)) | f(dv).any(axis=(1, 3)), 2, axis=1)
    # Query heads 2h, 2h + 1 read KV head h: those that read only finite entries are finite,
    # those that read a NaN have NaN channels (all of them for a NaN key; a NaN value's own
    # channels); an inf may weigh 0 and leave its head finite.
    reads_non_finite, reads_nan = per_head(lambda x: ~np.isfinite(x)), per_head(np.isnan)
    assert np.isfinite(out[~reads_non_finite]).all()
    assert np.isnan(out[reads_nan]).any(axis=-1).all()


def _kernel_case(seed, plants):
    cfg = kj.KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32)
    rng = np.random.default_rng(seed)
    k, v = (rng.normal(size=(1, 80, 1, 64)).astype(np.float32) for _ in range(2))
    for which, t, d, value in plants:
        (k, v)[which][0, t, 0, d] = value
    cache = kj.init_cache(cfg, batch=1, max_len=96, num_kv_heads=1, head_dim=64, dtype="float16")
    cache = kj.prefill(cache, jnp.asarray(k), jnp.asarray(v))
    q = jnp.asarray(rng.normal(size=(1, 2, 64)), jnp.float16)
    return q, cache


@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(
    plants=st.lists(
        st.tuples(st.integers(0, 1), st.integers(0, 79), st.integers(0, 63),
                  st.sampled_from([np.nan, np.inf, -np.inf, 300.0])), max_size=2),
    seed=st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_the_gpu_kernel_is_finite_where_the_reference_is(slow_only, plants, seed):
    """Interpreted on the CPU, a float16 cache (the kernel's operands are float16; its range
    in docs/design.md). Finite wherever the reference is; where the reference is NaN (a NaN
    group) the kernel may give a finite number: its integer query parts lose the NaN scale."""
    q, cache = _kernel_case(seed, plants)
    ref = np.asarray(kj.decode_attention(q, cache, impl="reference"), np.float32)
    got = np.asarray(kj.decode_attention(q, cache, impl="pallas", interpret=True), np.float32)
    assert np.isfinite(got[np.isfinite(ref)]).all()


# ------------------------------------------------------------------------ invalid inputs


@pytest.fixture(scope="module")
def params():
    return tiny_params()


BAD_TOKENS = {  # tokens -> the words of the error
    "id = vocab": (lambda v: [[1, 2, v]], ValueError, r"tokens: ids must lie in \[0, vocab"),
    "negative id": (lambda v: [[1, -1]], ValueError, r"tokens: ids must lie in \[0, vocab"),
    "float ids": (lambda v: np.ones((1, 3), np.float32), TypeError, "tokens must be integer"),
    "1-d": (lambda v: [1, 2, 3], ValueError, r"tokens must be \[batch, seq\]"),
    "ragged": (lambda v: [[1, 2], [3]], ValueError, "tokens must be a rectangular"),
    "a string": (lambda v: "hello", TypeError, "tokens must be an int array"),
}


@settings(max_examples=10, deadline=None)
@given(case=st.sampled_from(sorted(BAD_TOKENS)))
def test_forward_names_bad_tokens_before_compiling(params, case):
    make, error, match = BAD_TOKENS[case]
    with pytest.raises(error, match=match):
        kj.forward(params, make(params.config.vocab_size))


def test_forward_rejects_more_tokens_than_the_context_and_takes_lists(params):
    c = params.config
    with pytest.raises(ValueError, match=r"tokens: \d+ positions exceed .*max_context"):
        kj.forward(params, np.zeros((1, c.max_context + 1), np.int32))
    ids = [[1, 5, 9, 2]]
    np.testing.assert_array_equal(kj.forward(params, ids), kj.forward(params, np.array(ids)))


def test_under_jit_an_id_outside_the_vocabulary_gives_nan_logits(params):
    v = params.config.vocab_size
    logits = jax.jit(kj.forward)(params, jnp.array([[1, 2, v], [1, 2, -1], [1, 2, 3]]))
    assert np.isnan(np.asarray(logits[:2, 2])).all()
    assert np.isfinite(np.asarray(logits[2])).all()  # other rows untouched


def test_prefill_lengths_outside_the_prompt_under_jit_are_flagged_as_overflow():
    cache = kj.init_cache(
        CONFIGS["plain"], batch=3, max_len=T, num_kv_heads=H, head_dim=D, dtype="float32"
    )
    k, v = _planted(0, "float32", [])
    k, v = jnp.concatenate([k, k[:1]]), jnp.concatenate([v, v[:1]])
    out = jax.jit(kj.prefill)(cache, k, v, jnp.array([-3, 99, 5]))
    assert out.overflow.tolist() == [True, True, False]
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, seq=21\]"):
        kj.prefill(cache, k, v, jnp.array([-3, 99, 5]))


SAMPLING_FAULTS = {  # generate(...) keyword -> bad values, the words of the error
    "seed": ([2**64, -1, 2**32, 1.5, True], "seed must"),
    "temperature": ([float("inf"), float("nan"), -0.5, "1", True], "temperature must"),
    "top_k": ([True, 0, 2.0, -3], "top_k must"),
    "top_p": ([0.0, 1.5, float("nan"), True], "top_p must"),
    "max_new_tokens": ([0, -1, 2.5], "max_new_tokens must"),
}


@settings(max_examples=12, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(SAMPLING_FAULTS)))
def test_generate_names_a_bad_sampling_argument_before_running(params, data, name):
    values, match = SAMPLING_FAULTS[name]
    value = data.draw(st.sampled_from(values))
    with pytest.raises((ValueError, TypeError), match=match):
        kj.generate(params, [[1, 2, 3]], kv="full", **{"max_new_tokens": 2, name: value})


def test_generate_greedy_first_token_is_the_forward_argmax(params):
    ids = [[4, 8, 15, 16, 23]]
    first = kj.generate(params, ids, kv="full", max_new_tokens=1, seed=2**32 - 1)
    assert int(first[0, 0]) == int(jnp.argmax(kj.forward(params, ids)[0, -1]))


def test_functions_that_take_the_model_say_so_when_given_its_params(params, tmp_path):
    with pytest.raises(TypeError, match=r"pass the model itself, not model\.params"):
        kj.generate_text(params, "hi")
    with pytest.raises(TypeError, match=r"pass the model itself, not model\.params"):
        kj.save_model(params, tmp_path / "m")


@settings(max_examples=15, deadline=None)
@given(
    preset=st.sampled_from(["kivi2", "kivi4", "kivi2-mix", "kivi2-lean", "full"]),
    length=st.integers(0, 600),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
)
def test_held_bits_takes_a_preset_by_name_and_counts_non_negative_bits(preset, length, dtype):
    from kivi_jax.generate import resolve_kv

    by_name = kj.held_bits(preset, length=length, head_dim=64, dtype=dtype)
    assert by_name == kj.held_bits(resolve_kv(preset), length=length, head_dim=64, dtype=dtype)
    assert by_name.total_bits >= 0 and by_name.fp_bits == 2 * length * 64 * by_name.dtype_bits


HELD_BITS_FAULTS = [
    (dict(config="kivi3"), ValueError, "unknown kv 'kivi3'"),
    (dict(config=3), TypeError, "config must be"),
    (dict(length=-1), ValueError, "length must be an int >= 0"),
    (dict(length=2.5), ValueError, "length must be"),
    (dict(head_dim=0), ValueError, "head_dim must be an int >= 1"),
    (dict(head_dim=48), ValueError, "group_size=32 must divide head_dim=48"),
    (dict(dtype="int8"), ValueError, "dtype must be float32, bfloat16 or float16"),
]


@pytest.mark.parametrize("kwargs, error, match", HELD_BITS_FAULTS)
def test_held_bits_names_a_bad_argument(kwargs, error, match):
    args = dict(config="kivi2", length=10, head_dim=64) | kwargs
    with pytest.raises(error, match=match):
        kj.held_bits(args.pop("config"), **args)


@settings(max_examples=10, deadline=None)
@given(
    kind=st.sampled_from(["plain", "mixed", "lean", "full"]),
    layers=st.integers(1, 3),
    max_len=st.integers(1, 70),
)
def test_memory_report_counts_every_array_byte(kind, layers, max_len):
    cfg = None if kind == "full" else CONFIGS[kind]
    caches = kj.init_cache(
        cfg, batch=B, max_len=max_len, num_kv_heads=H, head_dim=D, num_layers=layers
    )
    want = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(caches))
    assert kj.memory_report(caches).total_bytes == want


@pytest.mark.parametrize(
    "bad, error, match",
    [(None, TypeError, "KiviCache or FullCache, got NoneType"),
     ((), ValueError, "empty sequence"),
     ([1], TypeError, "got int")],
)  # fmt: skip
def test_memory_report_names_what_is_not_a_cache(bad, error, match):
    with pytest.raises(error, match=match):
        kj.memory_report(bad)


INT_FIELDS = ["k_bits", "v_bits", "group_size", "residual_length", "sinks", "fine_key_channels",
              "heavy_tokens"]  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(INT_FIELDS),
    value=st.one_of(
        st.integers(-40, 300), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3),
        st.integers(1, 64).map(np.int64),
    ),
)  # fmt: skip
def test_kivi_config_takes_a_field_or_names_it(name, value):
    try:
        cfg = kj.KiviConfig(**{name: value})
    except ValueError as e:
        assert f"KiviConfig.{name}" in str(e) or name in str(e)
        return
    got = getattr(cfg, name)
    assert type(got) is int and got == value and not isinstance(value, bool | float | str)


def test_prefill_and_append_take_nested_lists_and_name_what_is_not_an_array():
    cache = kj.init_cache(None, batch=1, max_len=4, num_kv_heads=1, head_dim=2)
    kv = [[[[1.0, 2.0]]]]  # [batch, seq, kv_heads, head_dim]
    assert kj.prefill(cache, kv, kv).lengths.tolist() == [1]
    assert kj.append(cache, kv[0], kv[0]).lengths.tolist() == [1]
    with pytest.raises(TypeError, match="prefill: k must be an array, got str"):
        kj.prefill(cache, "k", kv)
    with pytest.raises(TypeError, match="append: v must be an array, got list"):
        kj.append(cache, kv[0], [[1.0], [1.0, 2.0]])


ATTENTION_FAULTS = {  # fault -> (error, the words of its message)
    "q of 2 axes": (ValueError, r"q must be \[batch, q_heads, head_dim\]"),
    "integer q": (ValueError, "q must be floating point"),
    "q of another batch": (ValueError, r"q of shape .* does not match the cache"),
    "q_heads not a multiple": (ValueError, "must be a multiple of the cache's kv_heads"),
    "unknown impl": (ValueError, "impl must be one of"),
    "a GPU kernel on the CPU": (NotImplementedError, "pass interpret=True"),
    "every layer's caches": (TypeError, "expected one layer's cache"),
}


@settings(max_examples=12, deadline=None)
@given(
    fault=st.none() | st.sampled_from(sorted(ATTENTION_FAULTS)),
    kind=st.sampled_from(["plain", "full"]),
    n=st.integers(0, T),
)
def test_decode_attention_agrees_with_the_reference_or_names_the_bad_argument(fault, kind, n):
    cfg = None if kind == "full" else CONFIGS[kind]
    cache = kj.init_cache(cfg, batch=B, max_len=T, num_kv_heads=H, head_dim=D, dtype="float32")
    k, v = _planted(n, "float32", [])
    cache = kj.prefill(cache, k, v, lengths=jnp.array([n, T - n]))
    q = jnp.asarray(np.random.default_rng(n).normal(size=(B, 2 * H, D)), jnp.float32)
    kw = dict(impl="auto")
    if fault is None:
        want = np.asarray(kj.decode_attention(q, cache, impl="reference"))
        got = np.asarray(kj.decode_attention(q, cache, **kw))
        assert got.shape == (B, 2 * H, D) and np.isfinite(got).all()
        if jax.default_backend() == "cpu":  # "auto" is the reference here; kernels: their files
            np.testing.assert_array_equal(got, want)
        return
    q = {
        "q of 2 axes": q[0],
        "integer q": q.astype(jnp.int32),
        "q of another batch": q[:1],
        "q_heads not a multiple": q[:, :3],
    }.get(fault, q)
    kw = {"unknown impl": dict(impl="cuda"), "a GPU kernel on the CPU": dict(impl="pallas")}.get(
        fault, kw
    )
    if fault == "every layer's caches":
        cache = (cache, cache)
    error, match = ATTENTION_FAULTS[fault]
    if fault == "a GPU kernel on the CPU" and jax.default_backend() == "gpu":
        return
    with pytest.raises(error, match=match):
        kj.decode_attention(q, cache, **kw)
