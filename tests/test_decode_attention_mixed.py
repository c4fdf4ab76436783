"""The GPU kernels over a mixed-precision state (kivi2-mix) against the reference.

States are real (prefill, and decode appends): sinks, sliding keys, fine key channels and
heavy tokens with the key and value bits, head_dim, GQA (n_rep 1, 3, 4, 8) and dtype, in Pallas
interpret mode. CI runs a few cases that together take every value of every factor and each
mixed part on and off, on both GQA kernel pairs (an interpreted case costs 5-16 s of
compilation on 2 cores); the full grid runs under `-m slow` (`-k pairwise`: a cover with
every pair of two factors' values in some case, first), compiled on a GPU under `-m gpu`.
The tolerance is the plain kernels' (`conftest.assert_matches_reference`): the reference reads
the same state, dequantized with its sinks, heavy tokens and fine channels put in
(kivi_jax.cache.dequantized_heads_major).

Final lengths per row, two sets (R = 64, G = 32, S = 4):
  "prefilled": 0 (empty), 3 (sinks only), 69 (just past R: sinks below the value window),
    130 (just past a key flush), 301;
  "streamed": prompts of 1, 60, 126, 250 and 3 decode appends each: 4 (= S), 63, 129 (a key
    flush and the value window's first exit during the appends), 253.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches_reference, streamed_cache
from kivi_jax.pallas_kernels.decode_attention import decode_attention_pallas, gpu, mixed, tpu
from kivi_jax.pallas_kernels.decode_attention.gpu import KernelTuning

import kivi_jax as kj
from kivi_jax.eval.studies import LEAN_R128

CC = {"gqa_scores": "cuda_cores", "gqa_values": "cuda_cores"}  # the CUDA-core GQA kernels
LENGTHS = {"prefilled": ([0, 3, 69, 130, 301], 0), "streamed": ([1, 60, 126, 250], 3)}


def _config(bits, *, sinks, fine, heavy, sliding, selection=kj.Selection.ERROR):
    return kj.KiviConfig(
        k_bits=bits, v_bits=bits, group_size=32, residual_length=64, sinks=sinks,
        sliding_keys=sliding, fine_key_channels=fine, heavy_tokens=heavy, selection=selection,
    )  # fmt: skip


def _check(rng, cfg, *, D, n_rep, dtype, lengths, kernels=None):
    prompts, steps = LENGTHS[lengths]
    cache = streamed_cache(
        rng, config=cfg, H=2, D=D, max_len=400, prompts=prompts, steps=steps, dtype=dtype
    )
    if cfg.heavy_tokens:
        assert (cache.side.heavy_pos >= 0).any()  # heavy slots in use
    q = jnp.asarray(rng.normal(size=(len(prompts), 2 * n_rep, D)), dtype)
    tuning = KernelTuning(num_splits=3, **(kernels or {}))
    out = decode_attention_pallas(q, cache, interpret=True, tuning=tuning)
    assert_matches_reference(out, q, cache)


BF, F16 = jnp.bfloat16, jnp.float16
TC = {}  # the default: the tensor-core kernels with GQA
_NAMES = ("n_rep", "bits", "D", "dtype", "sinks", "fine", "heavy", "sliding", "lengths")
_CI = [  # _NAMES, then the GQA kernels
    (1, 2, 128, BF, 4, 16, 32, True, "prefilled", TC),  # KIVI2_MIX's parts
    (1, 4, 64, F16, 4, 0, 32, False, "streamed", TC),  # sinks in [Pv, Qk): masked, extra
    (3, 2, 64, BF, 0, 16, 0, True, "prefilled", TC),  # 4 head slots for 3 heads
    (4, 4, 128, F16, 4, 16, 0, False, "prefilled", CC),
    (8, 2, 128, BF, 0, 0, 32, True, "streamed", CC),
]


@pytest.mark.parametrize((*_NAMES, "kernels"), _CI)
def test_mixed_state_matches_reference_interpret(
    rng, n_rep, bits, D, dtype, sinks, fine, heavy, sliding, lengths, kernels
):
    cfg = _config(bits, sinks=sinks, fine=fine, heavy=heavy, sliding=sliding)
    _check(rng, cfg, D=D, n_rep=n_rep, dtype=dtype, lengths=lengths, kernels=kernels)


# Every pair of two factors' values in some case (a greedy all-pairs cover).
_PAIRWISE = [
    (1, 2, 64, F16, 0, 0, 32, False, "streamed"),
    (1, 2, 128, BF, 0, 16, 0, True, "prefilled"),
    (1, 4, 64, BF, 4, 0, 32, True, "streamed"),
    (3, 2, 64, BF, 0, 16, 32, True, "prefilled"),
    (3, 4, 128, F16, 4, 0, 0, False, "streamed"),
    (4, 2, 128, F16, 0, 0, 0, True, "streamed"),
    (4, 4, 64, BF, 4, 16, 32, False, "streamed"),
    (4, 4, 128, F16, 4, 16, 0, True, "prefilled"),
    (8, 2, 64, F16, 4, 16, 0, True, "streamed"),
    (8, 4, 128, BF, 0, 0, 32, False, "prefilled"),
]


_FULL = [
    (n_rep, bits, D, dtype, sinks, fine, heavy, sliding, lengths)
    for n_rep, bits, D, dtype, sinks, fine, heavy, sliding, lengths in itertools.product(
        [1, 3, 4, 8],
        [2, 4],
        [64, 128],
        [BF, F16],
        [0, 4],
        [0, 16],
        [0, 32],
        [True, False],
        list(LENGTHS),
    )
    if sinks or fine or heavy or sliding  # else plain KIVI (test_decode_attention_kernel)
]


# `-m slow -k pairwise` runs the cover alone.
_SLOW = [pytest.param(*c, id=f"pairwise{i}") for i, c in enumerate(_PAIRWISE)]
_SLOW += [c for c in _FULL if c not in _PAIRWISE]


@pytest.mark.slow
@pytest.mark.parametrize(_NAMES, _SLOW)
def test_mixed_state_full_grid_interpret(
    rng, slow_only, n_rep, bits, D, dtype, sinks, fine, heavy, sliding, lengths
):
    cfg = _config(bits, sinks=sinks, fine=fine, heavy=heavy, sliding=sliding)
    _check(rng, cfg, D=D, n_rep=n_rep, dtype=dtype, lengths=lengths)


@pytest.mark.parametrize(
    ("kernels", "n_rep", "bits", "F"),
    [(CC, 1, 2, 16), (CC, 1, 4, 16), (CC, 2, 4, 8), (TC, 4, 2, 16), (TC, 3, 4, 8)],
)  # F = 8: padded to 16 with zero codes and weights (mixed.fine_operands); MHA at 4 bits: the
# plain loop Triton pipelines (3 stages), at 2 bits the register prefetch
def test_score_kernels_add_the_fine_channels_interpret(rng, kernels, n_rep, bits, F):
    """Both score kernels on fresh random codes, scales, fine codes and fine channels: their
    logits are the plain kernel's plus `mixed.fine_correction_reference` (the CUDA-core
    kernel's weights as int16, the tensor-core kernel's as f16: within 1e-3 of the largest
    correction) and their maxima are exact: each row's largest is its largest logit below Qk
    (R = 64, 10 key groups of 32 in programs of 4; Qk 320, 128 and 0)."""
    B, H, D, G, C, R = 3, 2, 64, 32, 320, 64
    kpb = 8 // bits
    lengths = jnp.asarray([320, 170, 40], jnp.int32)
    q = jnp.asarray(rng.normal(size=(B, H, n_rep, D)), BF)
    k_codes = jnp.asarray(rng.integers(0, 256, (B, H, C // kpb, D), dtype=np.uint8))
    k_scale = jnp.asarray(rng.random((B, H, C // G, D)) + 0.1, BF)
    k_zero = jnp.asarray(rng.normal(size=(B, H, C // G, D)), BF)
    fine_codes = jnp.asarray(rng.integers(0, 256, (B, H, C // kpb, F), dtype=np.uint8))
    channels = np.sort(rng.random((B, H, C // G, D)).argsort(-1)[..., :F], axis=-1)
    fine_channels = jnp.asarray(channels, jnp.uint8)  # F distinct channels a group, ascending
    q_scale = 0.2
    qs = q.astype(jnp.float32) * q_scale
    tuning = KernelTuning(score_program_groups=4, gqa_program_groups=4, **kernels)
    scores = functools.partial(
        gpu.dispatch_key_scores, q, k_codes, k_scale, k_zero, lengths, q_scale=q_scale,
        bits=bits, group_size=G, residual_length=R, tuning=tuning, interpret=True,
    )  # fmt: skip
    plain, _ = scores()
    fine = mixed.fine_operands(qs, k_scale, fine_codes, fine_channels, k_bits=bits)
    logits, maxima = (np.asarray(x)[:, :, :n_rep] for x in scores(fine=fine))
    corr = np.asarray(
        mixed.fine_correction_reference(
            qs, k_scale, fine_codes, fine_channels, k_bits=bits, group_size=G
        )
    )  # fmt: skip
    want = np.asarray(plain)[:, :, :n_rep] + corr
    for b, qk in enumerate([320, 128, 0]):
        if qk:
            err = np.abs(logits[b, ..., :qk] - want[b, ..., :qk]).max()
            assert err <= 1e-3 * np.abs(corr[b, ..., :qk]).max()
            np.testing.assert_array_equal(maxima[b].max(-1), logits[b, ..., :qk].max(-1))
        else:
            assert (maxima[b] == np.float32(-1e30)).all()


def test_mass_selection_and_cuda_core_gqa_kernels_interpret(rng):
    """Heavy tokens chosen by attention mass (the state then holds the window's scores, which
    attention does not read) and n_rep = 3 on the CUDA-core kernels (logits of n_rep head
    slots, not the tensor-core kernels' 4)."""
    cfg = dataclasses.replace(kj.KIVI2_MIX, residual_length=64, selection=kj.Selection.MASS)
    prompts = [200, 77, 0]
    cache = kj.init_cache(cfg, batch=3, max_len=256, num_kv_heads=2, head_dim=64, dtype=BF)
    k, v, q = (jnp.asarray(rng.normal(size=(3, 200, h, 64)), BF) for h in (2, 2, 6))
    cache = kj.prefill(cache, k, v, lengths=jnp.asarray(prompts), q=q)
    assert (cache.side.heavy_pos >= 0).any()
    q = q[:, -1]
    tuning = KernelTuning(num_splits=2, **CC)
    assert_matches_reference(
        decode_attention_pallas(q, cache, interpret=True, tuning=tuning), q, cache
    )


def test_kivi2_lean_matches_reference_interpret(rng):
    """kivi2-lean's state (e4m3 scales, int8 zeros, an INT8 residual, a ring of 160 tokens (not
    a power of two), no heavy tokens, the keys' ranges searched; issue 61) through the
    kernels, and the preset before the range search (R 64 here, 16 heavy tokens)."""
    _check(rng, kj.KIVI2_LEAN, D=64, n_rep=3, dtype=BF, lengths="streamed")
    before = dataclasses.replace(LEAN_R128, residual_length=64)
    _check(rng, before, D=64, n_rep=3, dtype=BF, lengths="streamed")


@pytest.mark.slow
def test_plain_e5m2_state_on_cuda_core_kernels_interpret(rng, slow_only):
    cfg = kj.KiviConfig(
        k_bits=4, v_bits=4, group_size=32, residual_length=64, k_scale_format=kj.Format.E5M2,
        v_scale_format=kj.Format.E5M2, residual_format=kj.Format.E5M2,
    )  # fmt: skip
    _check(rng, cfg, D=64, n_rep=1, dtype=BF, lengths="streamed", kernels=CC)


def test_the_gpu_kernels_read_the_mixed_state_and_the_tpu_kernel_names_it(rng):
    cache = kj.init_cache(kj.KIVI2_MIX, batch=1, max_len=64, num_kv_heads=2, head_dim=64, dtype=BF)
    q = jnp.zeros((1, 4, 64), BF)
    assert gpu.unsupported_reason(q, cache) is None
    assert "mixed-precision state" in tpu.unsupported_reason(q, cache)
    with pytest.raises(NotImplementedError, match="kivi2-mix"):
        kj.decode_attention(q, cache, impl="pallas_tpu", interpret=True)


_GPU_GRID = [
    (n_rep, bits, D, dtype, cfg)
    for n_rep, bits, D, dtype in itertools.product([1, 3, 4, 8], [2, 4], [64, 128], [BF, F16])
    for cfg in ("kivi2-mix", "sinks+heavy", "fine", "sliding")
]


@pytest.mark.gpu
@pytest.mark.parametrize(("n_rep", "bits", "D", "dtype", "parts"), _GPU_GRID)
def test_mixed_state_matches_reference_gpu(rng, n_rep, bits, D, dtype, parts):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    on = {
        "kivi2-mix": dict(sinks=4, fine=16, heavy=32, sliding=True),
        "sinks+heavy": dict(sinks=4, fine=0, heavy=32, sliding=False),
        "fine": dict(sinks=0, fine=16, heavy=0, sliding=False),
        "sliding": dict(sinks=0, fine=0, heavy=0, sliding=True),
    }[parts]
    cfg = dataclasses.replace(_config(bits, **on), residual_length=128)
    prompts = [0, 3, 95, 1280, 2040, 1400]
    cache = streamed_cache(
        rng, config=cfg, H=4, D=D, max_len=2100, prompts=prompts, steps=7, dtype=dtype
    )
    q = jnp.asarray(rng.normal(size=(len(prompts), 4 * n_rep, D)), dtype)
    assert_matches_reference(decode_attention_pallas(q, cache), q, cache)
