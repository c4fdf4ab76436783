"""Shared test helpers: random KV data and cache construction."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's name: fresh data per test, reproducible runs."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def random_kv(rng, batch, seq, heads, head_dim, dtype=jnp.float32, outliers=False):
    """Random keys and values [batch, seq, heads, head_dim]; keys get outlier channels if asked."""
    k = rng.normal(size=(batch, seq, heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(batch, seq, heads, head_dim)).astype(np.float32)
    if outliers:
        k[..., :: max(head_dim // 4, 1)] *= 10.0
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def tree_equal(a, b) -> bool:
    """Pytrees with equal structure, static fields and bit-identical leaves."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(bool(jnp.array_equal(x, y)) for x, y in pairs)
