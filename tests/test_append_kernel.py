"""The fused append kernel (pallas_kernels/append/gpu.py, interpreted on the CPU) writes the
same state as the XLA append, bit for bit, on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from kivi_jax import cache as kc

CONFIGS = [
    (2, 2, 32, 128, 128, jnp.bfloat16),
    (4, 4, 32, 128, 64, jnp.bfloat16),
    (2, 4, 16, 64, 64, jnp.float16),
    (4, 2, 32, 64, 128, jnp.float32),
]
ARGS = ("k_bits", "v_bits", "group_size", "residual", "head_dim", "dtype")


@pytest.mark.parametrize(ARGS, CONFIGS)
def test_the_kernel_appends_what_the_xla_append_does(
    k_bits, v_bits, group_size, residual, head_dim, dtype
):
    _check(k_bits, v_bits, group_size, residual, head_dim, dtype, interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize(ARGS, CONFIGS)
def test_on_the_gpu_the_kernel_appends_what_the_xla_append_does(
    monkeypatch, k_bits, v_bits, group_size, residual, head_dim, dtype
):
    # the reference: XLA's append on the same GPU
    monkeypatch.setattr(kc, "_append_kernel_applies", lambda cache: False)
    _check(k_bits, v_bits, group_size, residual, head_dim, dtype, interpret=False)


def _check(k_bits, v_bits, group_size, residual, head_dim, dtype, *, interpret):
    G, R, D, B, H, max_len = group_size, residual, head_dim, 7, 2, 320
    # empty, mid-group, completing a group, completing the first R, a value leaving with a
    # group completing, inactive, the last slot of the capacity
    lengths = np.array([0, 5, 2 * G - 1, R - 1, R + 3 * G - 1, R + 3, max_len - 1])
    active = jnp.array([True, True, True, True, True, False, True])
    rng = np.random.default_rng(k_bits * 100 + v_bits * 10 + G)
    seq = int(lengths.max())
    k = jnp.asarray(rng.standard_normal((B, seq, H, D)) * 3, dtype)
    v = jnp.asarray(rng.standard_normal((B, seq, H, D)), dtype)
    cfg = kivi_jax.KiviConfig(k_bits=k_bits, v_bits=v_bits, group_size=G, residual_length=R)
    cache = kivi_jax.init_cache(
        cfg, batch=B, max_len=max_len, num_kv_heads=H, head_dim=D, dtype=dtype
    )
    cache = kivi_jax.prefill(cache, k, v, lengths=jnp.asarray(lengths, jnp.int32))
    k_new = jnp.asarray(rng.standard_normal((B, H, D)) * 3, dtype)
    v_new = jnp.asarray(rng.standard_normal((B, H, D)), dtype)

    want = kivi_jax.append(cache, k_new, v_new, active=active)
    got = kc._append_with_kernel(
        cache, k_new, v_new, cache.lengths, active.astype(jnp.int32), interpret=interpret
    )
    differing = {
        name: int(
            np.sum(
                np.asarray(got[name]).view(np.uint8)
                != np.asarray(getattr(want, name)).view(np.uint8)
            )
        )
        for name in kc._APPEND_FIELDS
    }
    assert not any(differing.values()), differing


def test_the_kernel_is_used_only_on_a_gpu():
    cache = kivi_jax.init_cache(
        kivi_jax.KIVI2, batch=1, max_len=64, num_kv_heads=1, head_dim=64, dtype=jnp.float32
    )
    assert kc._append_kernel_applies(cache) == (jax.default_backend() == "gpu")


def test_generate_with_the_kernel_gives_the_tokens_of_the_xla_append(monkeypatch):
    # ragged prompts across the residual length, 40 steps: values leave the window and key
    # groups complete under the kernel (interpreted), in the model's jitted decode loop
    from tiny_model import tiny_config

    params = kivi_jax.init_params(tiny_config(max_context=512), jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, params.config.vocab_size, (3, 150)).astype(np.int32)
    lengths = np.array([150, 97, 120])
    run = lambda: kivi_jax.generate(params, tokens, lengths=lengths, max_new_tokens=40)
    want = run()
    traced, kernel = [], kc._append_with_kernel

    def interpreted(*args, **kwargs):
        traced.append(1)
        return kernel(*args, **kwargs, interpret=True)

    monkeypatch.setattr(kc, "_append_kernel_applies", lambda cache: cache.side is None)
    monkeypatch.setattr(kc, "_append_with_kernel", interpreted)
    jax.clear_caches()
    np.testing.assert_array_equal(run(), want)
    assert traced
