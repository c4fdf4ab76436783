"""decode_attention against an independent float64 numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_kv

import kivi_jax as kj


def numpy_attention(q, k, v, lengths):
    """float64 softmax(q.K/sqrt(d)).V; q [B, Hq, D], k, v [B, T, H, D]; zeros for empty rows."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, hq, d = q.shape
    rep = hq // k.shape[2]
    out = np.zeros((b, hq, d))
    for i in range(b):
        n = int(lengths[i])
        if n == 0:
            continue
        for h in range(hq):
            s = k[i, :n, h // rep] @ q[i, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h] = p @ v[i, :n, h // rep] / p.sum()
    return out


@pytest.mark.parametrize("rep", [1, 2, 3, 4])
@pytest.mark.parametrize("config", [kj.KiviConfig(group_size=4, residual_length=8), kj.KIVI4])
def test_reference_matches_numpy_over_the_dequantized_cache(rng, rep, config):
    heads, d = 2, max(config.group_size, 8)
    lengths = np.array([0, 5, 37, 64])
    k, v = random_kv(rng, 4, 63, heads, d, outliers=True)
    cache = kj.init_cache(
        config, batch=4, max_len=64, num_kv_heads=heads, head_dim=d, dtype=jnp.float32
    )
    cache = kj.prefill(cache, k, v, lengths=jnp.array(np.minimum(lengths, 63)))
    cache = kj.append(cache, k[:, 0], v[:, 0], active=jnp.array(lengths == 64))
    q = jnp.asarray(rng.normal(size=(4, heads * rep, d)), jnp.float32)
    out = kj.decode_attention(q, cache, impl="reference")
    dk, dv = kj.dequantize(cache, dtype=jnp.float32)
    expected = numpy_attention(q, dk, dv, lengths)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(out[0]))  # a sequence of length 0 gives zeros


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_full_precision_cache_gives_exact_attention(rng, dtype):
    k, v = random_kv(rng, 2, 20, 2, 16, dtype)
    cache = kj.init_cache(None, batch=2, max_len=32, num_kv_heads=2, head_dim=16, dtype=dtype)
    cache = kj.prefill(cache, k, v, lengths=jnp.array([20, 11]))
    q = jnp.asarray(rng.normal(size=(2, 6, 16)), jnp.float32)
    out = kj.decode_attention(q, cache)
    np.testing.assert_allclose(out, numpy_attention(q, k, v, [20, 11]), rtol=1e-5, atol=1e-6)


def test_query_dtype_is_kept(rng):
    cache = kj.init_cache(kj.KIVI2, batch=1, max_len=40, num_kv_heads=1, head_dim=32)
    k, v = random_kv(rng, 1, 40, 1, 32)
    cache = kj.prefill(cache, k, v)
    out = kj.decode_attention(jnp.ones((1, 2, 32), jnp.bfloat16), cache)
    assert out.dtype == jnp.bfloat16 and out.shape == (1, 2, 32)


def test_bad_queries_are_rejected():
    cache = kj.init_cache(kj.KIVI2, batch=2, max_len=40, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="q_heads=3 must be a multiple of the cache's kv_heads=2"):
        kj.decode_attention(jnp.zeros((2, 3, 32)), cache)
    with pytest.raises(ValueError, match=r"q must be \[batch, q_heads, head_dim\]"):
        kj.decode_attention(jnp.zeros((2, 1, 2, 32)), cache)
    with pytest.raises(ValueError, match="does not match the cache"):
        kj.decode_attention(jnp.zeros((2, 2, 64)), cache)
    with pytest.raises(ValueError, match="impl must be one of"):
        kj.decode_attention(jnp.zeros((2, 2, 32)), cache, impl="cuda")
    caches = kj.init_cache(kj.KIVI2, batch=2, max_len=40, num_kv_heads=2, head_dim=32, num_layers=2)
    with pytest.raises(TypeError, match="expected one layer's cache"):
        kj.decode_attention(jnp.zeros((2, 2, 32)), caches)


GRID = [(2, g, r) for g, r in [(4, 8), (4, 64), (32, 64), (32, 128), (64, 64), (64, 128)]]
GRID += [(4, 4, 8), (4, 32, 128)]


@pytest.mark.parametrize("bits, group, residual", GRID)
def test_the_issue_grid_streams_and_attends_correctly(rng, bits, group, residual):
    # bits 2 and 4, G in {4, 32, 64}, R in {8, 64, 128}, GQA 1-4, a ragged batch with a row
    # that crosses a key flush during the appends.
    config = kj.KiviConfig(k_bits=bits, v_bits=bits, group_size=group, residual_length=residual)
    d, heads, prompt, steps = 64, 2, 125, 6
    lengths = np.array([prompt, 60, 0])
    k, v = random_kv(rng, 3, prompt + steps, heads, d, outliers=True)
    make = lambda: kj.init_cache(
        config, batch=3, max_len=160, num_kv_heads=heads, head_dim=d, dtype=jnp.float32
    )
    cache = kj.prefill(make(), k[:, :prompt], v[:, :prompt], lengths=jnp.array(lengths))
    for t in range(steps):
        idx = jnp.array(lengths + t)
        cache = kj.append(cache, k[jnp.arange(3), idx], v[jnp.arange(3), idx])
    # The same tokens in one prefill give the same state.
    held = lengths + steps
    pad = np.arange(prompt + steps)[None, :] < held[:, None]
    whole = kj.prefill(
        make(),
        jnp.where(pad[..., None, None], k, 0),
        jnp.where(pad[..., None, None], v, 0),
        lengths=jnp.array(held),
    )
    assert all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(whole), strict=True)
    )
    dk, dv = kj.dequantize(cache, dtype=jnp.float32)
    for rep in (1, 2, 3, 4):
        q = jnp.asarray(rng.normal(size=(3, heads * rep, d)), jnp.float32)
        out = kj.decode_attention(q, cache, impl="reference")
        np.testing.assert_allclose(out, numpy_attention(q, dk, dv, held), rtol=1e-5, atol=1e-5)
