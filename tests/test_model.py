"""The Llama model: forward pass against an independent numpy implementation, RoPE, causality,
ragged (right-padded) batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.rope import apply_rope, rope_angles
from tiny_model import tiny_config, tiny_params

import kivi_jax


def numpy_llama(params, tokens: np.ndarray) -> np.ndarray:
    """Textbook Llama in float64 numpy, one sequence [S] -> logits [S, V]: an independent check
    of the JAX code (loops over heads, explicit repeat for GQA, explicit rotate-half RoPE)."""
    c = params.config
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    S, D = len(tokens), c.head_dim

    def norm(x, w):
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + c.rms_eps) * w

    inv = 1.0 / c.rope_theta ** (np.arange(0, D, 2) / D)
    ang = np.arange(S)[:, None] * inv  # [S, D/2]
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)

    def rope(x):  # x [S, D]
        rotated = np.concatenate([-x[:, D // 2 :], x[:, : D // 2]], -1)
        return x * cos + rotated * sin

    h = p.embed[tokens]
    for lw in p.layers:
        x = norm(h, lw.attn_norm)
        q = (x @ lw.wq).reshape(S, c.num_heads, D)
        k = (x @ lw.wk).reshape(S, c.num_kv_heads, D)
        v = (x @ lw.wv).reshape(S, c.num_kv_heads, D)
        heads = []
        for n in range(c.num_heads):
            kv = n // c.num_rep
            scores = rope(q[:, n]) @ rope(k[:, kv]).T / np.sqrt(D)
            scores = np.where(np.tril(np.ones((S, S), bool)), scores, -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((weights / weights.sum(-1, keepdims=True)) @ v[:, kv])
        h = h + np.concatenate(heads, -1) @ lw.wo
        x = norm(h, lw.mlp_norm)
        gate = x @ lw.w_gate
        h = h + (gate / (1 + np.exp(-gate)) * (x @ lw.w_up)) @ lw.w_down
    h = norm(h, p.final_norm)
    return h @ (p.embed.T if p.lm_head is None else p.lm_head)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # GQA 4:2, tied embeddings
        dict(num_kv_heads=4, tie_embeddings=False),  # plain multi-head, separate output head
        dict(num_kv_heads=1, rope_theta=100000.0),  # multi-query
    ],
)
def test_forward_matches_numpy_reference(overrides):
    params = tiny_params(**overrides)
    tokens = np.random.default_rng(0).integers(0, params.config.vocab_size, size=37)
    logits = kivi_jax.forward(params, jnp.asarray(tokens)[None])
    assert logits.shape == (1, 37, params.config.vocab_size)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits[0], numpy_llama(params, tokens), rtol=1e-4, atol=1e-4)


def test_forward_is_causal():
    params = tiny_params()
    tokens = jnp.arange(20, dtype=jnp.int32)[None] + 5
    changed = tokens.at[0, 12].set(99)
    a, b = kivi_jax.forward(params, tokens), kivi_jax.forward(params, changed)
    np.testing.assert_array_equal(a[0, :12], b[0, :12])
    assert not np.allclose(a[0, 12:], b[0, 12:])


def test_right_padded_rows_match_unpadded():
    """With lengths, a short prompt padded to the batch width gets the logits it gets alone."""
    params = tiny_params()
    rng = np.random.default_rng(1)
    long, short = rng.integers(3, 200, size=30), rng.integers(3, 200, size=11)
    batch = np.zeros((2, 30), np.int32)
    batch[0], batch[1, :11] = long, short
    batch[1, 11:] = 7  # padding: any token, masked out by lengths
    logits = kivi_jax.forward(params, jnp.asarray(batch), jnp.asarray([30, 11]))
    alone = kivi_jax.forward(params, jnp.asarray(short)[None])
    np.testing.assert_allclose(logits[1, :11], alone[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        logits[0], kivi_jax.forward(params, jnp.asarray(long)[None])[0], rtol=1e-5, atol=1e-5
    )


def test_bfloat16_params_run_and_stay_close():
    params = tiny_params()
    tokens = jnp.arange(16, dtype=jnp.int32)[None]
    full = kivi_jax.forward(params, tokens)
    half = kivi_jax.forward(params.astype(jnp.bfloat16), tokens)
    assert half.dtype == jnp.float32
    assert np.abs(np.asarray(half - full)).max() < 0.1 * np.abs(np.asarray(full)).max()


def test_rope_is_identity_at_position_zero_and_relative():
    D = 16
    rng = np.random.default_rng(2)
    q, k = rng.normal(size=(1, D)).astype(np.float32), rng.normal(size=(1, D)).astype(np.float32)

    def rot(x, pos):
        cos, sin = rope_angles(jnp.asarray(pos), D, 10000.0)
        return np.asarray(apply_rope(jnp.asarray(x), cos, sin))[0]

    np.testing.assert_allclose(rot(q, 0), q[0], atol=1e-6)
    # q.k after rotation depends only on the distance between the positions
    np.testing.assert_allclose(rot(q, 7) @ rot(k, 3), rot(q, 104) @ rot(k, 100), rtol=1e-4)


def test_config_rejects_inconsistent_heads():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_config(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="positive int"):
        LlamaConfig(
            vocab_size=0,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=8,
        )


def test_layer_weights_hold_qkv_and_gate_up_as_one_matrix_each(rng):
    d, q, kv, F = 8, 12, 4, 10
    shapes = dict(
        attn_norm=(d,), wq=(d, q), wk=(d, kv), wv=(d, kv), wo=(q, d), mlp_norm=(d,),
        w_gate=(d, F), w_up=(d, F), w_down=(F, d),
    )  # fmt: skip
    parts = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    lw = kivi_jax.models.llama.LayerWeights.from_projections(**parts)
    assert lw.w_qkv.shape == (d, q + 2 * kv) and lw.w_gate_up.shape == (d, 2 * F)
    for name, w in parts.items():
        np.testing.assert_array_equal(np.asarray(getattr(lw, name)), w)
    with pytest.raises(ValueError, match=r"wk .* and wv .* must have the same shape"):
        kivi_jax.models.llama.LayerWeights.from_projections(**{**parts, "wv": parts["wq"]})
