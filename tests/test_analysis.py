"""The paper's error measures: definitions on hand-made arrays, then the observation itself."""

import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax import analysis
from kivi_jax.analysis import Grouping


def test_measures_follow_their_definitions():
    k = jnp.array([[3.0, 0.0], [0.0, 4.0]])
    assert float(analysis.key_reconstruction_error(k, jnp.zeros_like(k))) == pytest.approx(5.0)
    a = jnp.array([[0.5, 0.5]])
    v = jnp.array([[2.0, 4.0], [2.0, 0.0]])  # A V = [2, 2]
    v_hat = v.at[0, 0].add(2.0)  # A V' = [3, 2]: elementwise relative errors [0.5, 0]
    assert float(analysis.attention_output_error(a, v, v_hat)) == pytest.approx(0.5)
    q = jnp.zeros((1, 2))  # uniform attention whatever the keys: no score error
    assert float(analysis.attention_score_error(q, k, 2 * k)) == pytest.approx(0.0)


def test_per_channel_keys_and_per_token_values_win(rng):
    # Keys with outlier channels; values whose magnitude varies by token; sparse attention.
    k = rng.normal(size=(256, 64))
    k[:, [3, 40]] = 10.0 * rng.normal(1.0, 0.3, size=(256, 2))
    v = rng.normal(size=(256, 64)) * np.exp(rng.normal(size=(256, 1)))
    q = 1.5 * k[rng.choice(256, 8)]
    q[:, [3, 40]] = 0.0
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    a = analysis.attention_scores(q, k)
    err = {}
    for g in Grouping:
        k_hat = analysis.quantize_dequantize(k, 2, 32, g)
        v_hat = analysis.quantize_dequantize(v, 2, 32, g)
        err[g] = (
            float(analysis.key_reconstruction_error(k, k_hat)),
            float(analysis.attention_output_error(a, v, v_hat)),
        )
    assert err[Grouping.PER_CHANNEL][0] < err[Grouping.PER_TOKEN][0]
    assert err[Grouping.PER_TOKEN][1] < err[Grouping.PER_CHANNEL][1]
