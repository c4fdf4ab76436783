"""The query-group tensor-core kernel (gpu_gqa) equals the reference in interpret mode."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import streamed_cache
from kivi_jax.pallas_kernels.decode_attention import gpu_gqa, state

import kivi_jax


@pytest.mark.parametrize(
    ("k_bits", "v_bits", "D", "n_rep", "dtype", "R", "prompts"),
    [
        (2, 2, 128, 4, jnp.bfloat16, 64, [27, 300, 64, 180]),
        (4, 2, 64, 8, jnp.float16, 64, [0, 97, 200]),
        (2, 4, 64, 3, jnp.bfloat16, 96, [300, 92, 0]),
    ],
)
def test_query_group_kernel_matches_reference_interpret(
    rng, k_bits, v_bits, D, n_rep, dtype, R, prompts
):
    cfg = kivi_jax.KiviConfig(k_bits=k_bits, v_bits=v_bits, group_size=32, residual_length=R)
    cache = streamed_cache(
        rng, config=cfg, H=2, D=D, max_len=320, prompts=prompts, steps=5, dtype=dtype
    )
    q = jnp.asarray(rng.normal(size=(len(prompts), 2 * n_rep, D)).astype(np.float32), dtype)
    arrays, config = state.kernel_args(cache)
    out = gpu_gqa.kivi_decode_attention_gqa(
        q, *arrays, **config, tuning=gpu_gqa.GqaTuning(num_splits=3), interpret=True
    )
    ref = kivi_jax.decode_attention_reference(q.astype(jnp.float32), cache)
    out = np.asarray(out, np.float32)
    # keys, queries and probabilities rounded to the dtype, as in a bf16/fp16 attention
    np.testing.assert_allclose(out, np.asarray(ref), atol=4e-2 if dtype == jnp.bfloat16 else 4e-3)
    assert (out[np.asarray(cache.lengths) == 0] == 0).all()
