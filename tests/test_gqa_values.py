"""The tensor-core GQA value kernel (`pallas_kernels/decode_attention/gqa_values.py`): its
partial softmaxes, merged, against float64 on fresh random codes, logits and residuals
(interpret mode on the CPU; the same on a GPU with -m gpu). Its lane-level PTX:
test_ptx.py. The whole decode step with it: test_decode_attention_kernel.py
(`gqa_values="tensor_cores"`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import triton_modules
from kivi_jax.pallas_kernels.decode_attention import gpu
from kivi_jax.pallas_kernels.decode_attention import gqa_values as gv

LOG2E = 1.4426950408889634


def _reference(q, logits, codes, s, z, kr, vr, lengths, *, bits, R, q_scale):
    """float64 attention output [B, H, n_rep, D] of the value side: base-2 logits of the
    quantized keys (t < Qk) or of q . k_residual, values dequantized (t < Pv) or residual."""
    B, H, n_rep, D = q.shape
    vpb = 8 // bits
    c = np.stack([(codes >> (bits * j)) & ((1 << bits) - 1) for j in range(vpb)], axis=-1)
    v = c.reshape(*codes.shape[:3], D) * np.repeat(s, 32, -1) + np.repeat(z, 32, -1)
    out = np.zeros((B, H, n_rep, D))
    for b, length in enumerate(lengths):
        qk, pv = length - length % R, max(length - R, 0)
        for h in range(H):
            for r in range(n_rep):
                x = np.array([
                    logits[b, h, r, t] if t < qk else q_scale * q[b, h, r] @ kr[b, h, t % R]
                    for t in range(length)
                ])  # fmt: skip
                vals = np.array([v[b, h, t] if t < pv else vr[b, h, t % R] for t in range(length)])
                if length:
                    p = 2.0 ** (x - x.max())
                    out[b, h, r] = p @ vals / p.sum()
    return out


def _check(rng, *, bits, n_rep, D, dtype, interpret, blocks=2, splits=3, interleave=True,
           prefetch=1, B=4, H=2, C=1152, R=128):  # fmt: skip
    # lengths: at the capacity, mid-tile, shorter than R (tail only, part of it past Qk),
    # and 0
    vpb, G = 8 // bits, 32
    lengths = np.array([C, 701, 100, 0], np.int32)[:B]
    codes = rng.integers(0, 256, (B, H, C, D // vpb), dtype=np.uint8)
    s = jnp.asarray(rng.random((B, H, C, D // G)) * 0.5 + 0.01, dtype)
    z = jnp.asarray(rng.normal(size=(B, H, C, D // G)), dtype)
    kr, vr = (jnp.asarray(rng.normal(size=(B, H, R, D)), dtype) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(B, H, n_rep, D)), dtype)
    logits = (rng.normal(size=(B, H, n_rep, C)) * 3).astype(np.float32)
    slots = 1 << (n_rep - 1).bit_length()  # a score kernel's slots may exceed n_rep
    padded = np.full((B, H, slots, C), np.nan, np.float32)  # read only where defined
    padded[:, :, :n_rep] = logits
    maxima = np.full((B, H, slots, 5), -1e30, np.float32)  # 5 score programs per row
    for b, length in enumerate(lengths):
        qk = length - length % R
        padded[b, :, :, qk:] = np.nan  # no logit of the score kernel there
        for p in range(5):
            held = logits[b, :, :, p * 256 : min((p + 1) * 256, qk)]
            if held.size:
                maxima[b, :, :n_rep, p] = held.max(-1)
    q_scale = LOG2E / np.sqrt(D)
    m, o, o_tail, l_sum = gv.gqa_weighted_values(
        q, jnp.asarray(padded), jnp.asarray(maxima), jnp.asarray(codes), s, z, kr, vr,
        jnp.asarray(lengths), q_scale=q_scale, bits=bits, group_size=G, splits=splits,
        blocks=blocks, tokens_per_split=16 * blocks * -(-C // (16 * blocks * splits)),
        interleave=interleave, tail_slots=16, max_chunk=1, prefetch=prefetch,
        interpret=interpret,
    )  # fmt: skip
    assert m.shape == l_sum.shape == (B, H, n_rep, splits)
    assert o.shape == o_tail.shape == (B, H, n_rep, splits, D)
    got = np.asarray(gpu._merge_splits(m, o, o_tail, l_sum))
    f64 = lambda x: np.asarray(x, np.float64)
    want = _reference(f64(q), logits, codes, f64(s), f64(z), f64(kr), f64(vr), lengths,
                      bits=bits, R=R, q_scale=q_scale)  # fmt: skip
    # f16 weights p s (relative error 2**-11 each), float32 sums
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    assert (got[lengths == 0] == 0).all()
    return got


@pytest.mark.parametrize(
    ("bits", "n_rep", "D", "dtype", "blocks", "splits", "interleave", "prefetch"),
    [(2, 4, 128, jnp.bfloat16, 2, 3, True, 1),
     (4, 8, 64, jnp.float16, 1, 2, False, 2),
     (2, 3, 64, jnp.float16, 4, 4, True, 1),
     (4, 2, 128, jnp.bfloat16, 2, 1, True, 1)],
)  # fmt: skip
def test_values_match_float64_interpret(rng, bits, n_rep, D, dtype, blocks, splits,
                                        interleave, prefetch):  # fmt: skip
    _check(rng, bits=bits, n_rep=n_rep, D=D, dtype=dtype, interpret=True, blocks=blocks,
           splits=splits, interleave=interleave, prefetch=prefetch)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("n_rep", [2, 3, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_values_match_float64_gpu(rng, bits, n_rep, D, dtype):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _check(rng, bits=bits, n_rep=n_rep, D=D, dtype=dtype, interpret=False)


def test_unsupported_configurations_are_named():
    assert "at most 8" in gv.supported_reason(n_rep=9, group_size=32, head_dim=128, v_bits=2)
    assert "takes 32" in gv.supported_reason(n_rep=4, group_size=64, head_dim=128, v_bits=2)
    assert "multiple of 32" in gv.supported_reason(n_rep=4, group_size=32, head_dim=48, v_bits=2)
    assert gv.supported_reason(n_rep=8, group_size=32, head_dim=64, v_bits=4) is None
    sd = jax.ShapeDtypeStruct
    with pytest.raises(NotImplementedError, match="n_rep=9"):
        jax.eval_shape(
            functools.partial(gv.gqa_weighted_values, q_scale=1.0, bits=2, group_size=32,
                              splits=1, blocks=2, tokens_per_split=64, interleave=True,
                              tail_slots=16, max_chunk=1, prefetch=1, interpret=True),
            sd((1, 1, 9, 128), jnp.bfloat16), sd((1, 1, 16, 64), jnp.float32),
            sd((1, 1, 16, 1), jnp.float32), sd((1, 1, 64, 32), jnp.uint8),
            sd((1, 1, 64, 4), jnp.bfloat16), sd((1, 1, 64, 4), jnp.bfloat16),
            sd((1, 1, 32, 128), jnp.bfloat16), sd((1, 1, 32, 128), jnp.bfloat16),
            sd((1,), jnp.int32),
        )  # fmt: skip


def test_lowers_for_cuda_to_tensor_core_mma(monkeypatch):
    # on a CPU-only jaxlib the kernel lowers to Triton IR for "cuda": its mma is inline PTX,
    # not a Triton dot
    sd = jax.ShapeDtypeStruct
    f = functools.partial(gv.gqa_weighted_values, q_scale=1.0, bits=2, group_size=32,
                          splits=2, blocks=2, tokens_per_split=128, interleave=True,
                          tail_slots=16, max_chunk=4, prefetch=1, interpret=False)  # fmt: skip
    args = (sd((1, 2, 4, 128), jnp.bfloat16), sd((1, 2, 4, 256), jnp.float32),
            sd((1, 2, 4, 8), jnp.float32), sd((1, 2, 256, 32), jnp.uint8),
            sd((1, 2, 256, 4), jnp.bfloat16), sd((1, 2, 256, 4), jnp.bfloat16),
            sd((1, 2, 128, 128), jnp.bfloat16), sd((1, 2, 128, 128), jnp.bfloat16),
            sd((1,), jnp.int32))  # fmt: skip
    [module] = triton_modules(monkeypatch, f, *args).values()
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in module
    assert "tt.dot" not in module
