"""The tensor-core GQA score kernel (`pallas_kernels/decode_attention/gqa_scores.py`): its
code formats, and its logits against float64 on fresh random codes (interpret mode on the CPU;
the same on a GPU with -m gpu). Its lane-level PTX: test_ptx.py. The whole decode step with it:
test_decode_attention_kernel.py (`gqa_scores="tensor_cores"`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import triton_modules
from kivi_jax.pallas_kernels.decode_attention import gqa_scores as gq
from kivi_jax.pallas_kernels.decode_attention import ptx

LOG2E = 1.4426950408889634


def test_codes_unpack_exactly_into_f16_halves():
    # the kernels' unpacking: a field of two bytes ORed into 1024.0 is 1024 + the field, exactly
    # (the score kernel's A entries); minus 1024.0 it is the field (the value kernel's HSUB2)
    for bits in (2, 4):
        for j in range(8 // bits):
            codes = np.arange(256, dtype=np.int32)
            y = codes | (codes[::-1] << 16)  # the two bytes, already in the two halves
            mask = ((1 << bits) - 1) << (bits * j)
            x = ptx.and_or(jnp.asarray(y), jnp.int32(mask * 0x00010001), jnp.int32(gq._MAGIC),
                          interpret=True)  # fmt: skip
            lo, hi = (np.asarray(h) for h in ptx.f16_halves(x))
            np.testing.assert_array_equal(lo, 1024 + (codes & mask))
            np.testing.assert_array_equal(hi, 1024 + (codes[::-1] & mask))
            x = ptx.sub_f16x2(x, jnp.full((256,), gq._MAGIC, jnp.int32), interpret=True)
            lo, hi = (np.asarray(h) for h in ptx.f16_halves(x))
            np.testing.assert_array_equal(lo, codes & mask)
            np.testing.assert_array_equal(hi, codes[::-1] & mask)


def test_minus_magic_is_minus_1024_in_both_halves():
    # the score kernel's accumulators start from an mma with this A, -1024 * sum_k B[k, n] on
    # every row, cancelling the 1024 each unpacked A entry carries (the kernel tests below check
    # the scores themselves)
    lo, hi = ptx.f16_halves(jnp.full((32,), gq._MINUS_MAGIC, jnp.int32))
    np.testing.assert_array_equal(np.asarray(lo), -1024.0)
    np.testing.assert_array_equal(np.asarray(hi), -1024.0)


def _reference(q, codes, s, z, *, bits, q_scale):
    """float64 logits [B, H, n_rep, C] of the dequantized keys (codes: byte row r, field j
    holds token kpb r + j)."""
    B, H, _, D = q.shape
    kpb = 8 // bits
    c = np.stack([(codes >> (bits * j)) & ((1 << bits) - 1) for j in range(kpb)], axis=3)
    c = c.reshape(B, H, -1, D).astype(np.float64)
    k = c * np.repeat(s.astype(np.float64), 32, axis=2) + np.repeat(
        z.astype(np.float64), 32, axis=2
    )
    return np.einsum("bhrd,bhtd->bhrt", q.astype(np.float64) * q_scale, k)


@pytest.mark.parametrize(
    ("bits", "n_rep", "D", "dtype", "program_groups", "prefetch"),
    [(2, 4, 128, jnp.bfloat16, 16, 1), (4, 8, 128, jnp.float16, 16, 2),
     (2, 3, 64, jnp.float16, 8, 1), (4, 2, 64, jnp.bfloat16, 16, 1),
     (2, 1, 128, jnp.bfloat16, 4, 2), (2, 4, 128, jnp.bfloat16, 16, 2)],
)  # fmt: skip
def test_logits_match_float64_interpret(rng, bits, n_rep, D, dtype, program_groups, prefetch):
    _check_logits(rng, bits=bits, n_rep=n_rep, D=D, dtype=dtype, interpret=True,
                  program_groups=program_groups, prefetch=prefetch)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("n_rep", [2, 3, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_logits_match_float64_gpu(rng, bits, n_rep, D, dtype):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _check_logits(rng, bits=bits, n_rep=n_rep, D=D, dtype=dtype, interpret=False)


def _check_logits(
    rng, *, bits, n_rep, D, dtype, interpret, program_groups=16, prefetch=1, B=3, H=2,
    C=1152,
):  # fmt: skip
    # C: 36 key groups, so a row's last program holds fewer (4 of 16, 4 of 8); lengths: at
    # the capacity, a quantized part ending mid-program, and a row with no quantized key
    kpb, R = 8 // bits, 128
    codes = rng.integers(0, 256, (B, H, C // kpb, D), dtype=np.uint8)
    s = jnp.asarray(rng.random((B, H, C // 32, D)) * 0.5 + 0.01, dtype)
    z = jnp.asarray(rng.normal(size=(B, H, C // 32, D)), dtype)
    q = jnp.asarray(rng.normal(size=(B, H, n_rep, D)), jnp.bfloat16)
    lengths = np.array([C, 700, 100], np.int32)
    q_scale = LOG2E / np.sqrt(D)
    logits, maxima = gq.gqa_key_scores(
        q, jnp.asarray(codes), s, z, jnp.asarray(lengths), q_scale=q_scale, bits=bits,
        group_size=32, residual_length=R, program_groups=program_groups, prefetch=prefetch,
        interpret=interpret,
    )  # fmt: skip
    P, span = -(-36 // program_groups), 32 * program_groups  # programs a row, their tokens
    slots = gq.head_slots(n_rep)  # 1, 2, 4, 4, 8 for n_rep 1, 2, 3, 4, 8
    assert slots >= n_rep and slots & (slots - 1) == 0
    M = 1 << (8 * P - 1).bit_length()  # 8 maxima a program, padded to a power of two
    assert logits.shape == (B, H, slots, C) and maxima.shape == (B, H, slots, M)
    logits, maxima = np.asarray(logits), np.asarray(maxima)
    assert (maxima[:, :, :n_rep, 8 * P :] == np.float32(-1e30)).all()
    want = _reference(np.asarray(q, np.float32), codes, np.asarray(s, np.float32),
                      np.asarray(z, np.float32), bits=bits, q_scale=q_scale)  # fmt: skip
    for b, length in enumerate(lengths):
        qk = length - length % R
        got, ref = logits[b, :, :n_rep, :qk], want[b, :, :, :qk]
        if qk:  # f16 operands, float32 sums: within 1e-3 of the largest logit
            assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max()
        for p in range(P):
            held = got[..., p * span : min((p + 1) * span, qk)]
            top = maxima[b, :, :n_rep, 8 * p : 8 * p + 8].max(-1)
            np.testing.assert_array_equal(top, held.max(-1) if held.size else np.float32(-1e30))


def test_unsupported_configurations_are_named():
    assert "at most 8" in gq.supported_reason(n_rep=9, group_size=32, head_dim=128, k_bits=2)
    assert "takes 32" in gq.supported_reason(n_rep=4, group_size=64, head_dim=128, k_bits=2)
    assert gq.supported_reason(n_rep=8, group_size=32, head_dim=64, k_bits=4) is None
    sd = jax.ShapeDtypeStruct
    with pytest.raises(NotImplementedError, match="n_rep=9"):
        jax.eval_shape(
            functools.partial(gq.gqa_key_scores, q_scale=1.0, bits=2, group_size=32,
                              residual_length=128, program_groups=16, prefetch=1,
                              interpret=True),
            sd((1, 1, 9, 128), jnp.bfloat16), sd((1, 1, 64, 128), jnp.uint8),
            sd((1, 1, 8, 128), jnp.bfloat16), sd((1, 1, 8, 128), jnp.bfloat16),
            sd((1,), jnp.int32),
        )  # fmt: skip


def test_lowers_for_cuda_to_tensor_core_mma(monkeypatch):
    # on a CPU-only jaxlib the kernel lowers to Triton IR for "cuda": the mma is its own inline
    # PTX, not a Triton dot (whose operand layouts Triton would choose and stage through shared
    # memory); benchmarks/kernel_sass.py builds it to SASS
    sd = jax.ShapeDtypeStruct
    f = functools.partial(gq.gqa_key_scores, q_scale=1.0, bits=2, group_size=32,
                          residual_length=128, program_groups=16, prefetch=1,
                          interpret=False)  # fmt: skip
    args = (sd((1, 2, 4, 128), jnp.bfloat16), sd((1, 2, 256, 128), jnp.uint8),
            sd((1, 2, 32, 128), jnp.bfloat16), sd((1, 2, 32, 128), jnp.bfloat16),
            sd((1,), jnp.int32))  # fmt: skip
    [module] = triton_modules(monkeypatch, f, *args).values()
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in module
    assert "tt.dot" not in module
