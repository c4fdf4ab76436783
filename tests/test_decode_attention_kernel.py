"""The fused GPU decode-attention kernels against the reference on fresh random KIVI states.

CPU CI runs the kernels in Pallas interpret mode on small shapes; `pytest -m gpu` runs the
compiled kernels on a CUDA GPU over the full grid (bits x head_dim x GQA x dtype) and tunings.

States are real: built by kivi_jax.prefill and kivi_jax.append from random keys and values
(ragged prompt lengths, then decode steps so residual rings wrap and flushes happen), plus one
test with random codes, scales and zero points written straight into the layout.

Tolerance (STYLE.md, after flash-attention's tests): the kernels compute in float32 from the
query and the state as stored (the query times the key scales as int16, the softmax weights
times the value scales as two int8 parts, ~16 bits against the largest of a set) and round
only the output to the query's dtype, so they must be at most about twice as far from the
float32 reference as a plain implementation that rounds its operands (query, keys,
probabilities, values) to that dtype, plus a few units of roundoff of the values' scale.
Both references read the same dequantized state (kivi_jax.cache.dequantized_heads_major), so
quantization error never enters the comparison.
With `value_parts=1` (one int8 part per value weight, ~8 bits against the largest of a set)
the same bound holds for bfloat16 queries, mostly through its roundoff term of the values'
scale: that test checks that the option computes the right thing, not its precision
(docs/performance.md gives its measured error).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches_reference, random_layout_cache, streamed_cache, triton_modules
from kivi_jax.pallas_kernels import triton_stages
from kivi_jax.pallas_kernels.decode_attention import (
    GpuTuning,
    decode_attention_pallas,
    kivi_decode_attention_gpu,
    supported_config_reason,
)
from kivi_jax.pallas_kernels.decode_attention.gpu import (
    KernelTuning,
    _byte_transpose,
    _field_mask,
    _fold_query,
    _int8_parts,
    _int8_unit,
    _join_parts,
    _loop_stages,
    _merge_splits,
    _pack_bytes,
    _parts_unit,
    _score_tile_start,
    _words,
    key_scores,
    score_tiles,
    weighted_values,
)

import kivi_jax


@pytest.mark.parametrize("bits", [2, 4])
def test_value_words_transpose_into_token_bytes(rng, bits):
    """The value kernel's unpacking: the byte transpose of 4 tokens' words, masked with field
    j's mask, holds in byte a exactly c * 2**(bits*j), c the code unpack_codes reads for token a
    and channel (4 * word + r) * (8 // bits) + j, for every r and j."""
    per = 8 // bits
    packed = rng.integers(0, 256, (4, 50, 4), dtype=np.uint8)  # [token, word, byte]
    codes = np.asarray(kivi_jax.quantization.unpack_codes(jnp.asarray(packed), bits, axis=2))
    codes = codes.reshape(4, 50, 4, per)  # [token, word, byte r, field j]
    words = [_words(jnp.asarray(packed[a]))[:, 0] for a in range(4)]  # int32 [50] per token
    tokens = _byte_transpose(words, interpret=True)
    for r in range(4):
        for j in range(per):
            masked = np.asarray(tokens[r] & _field_mask(j, bits)).view(np.uint8).reshape(50, 4)
            np.testing.assert_array_equal(masked, codes[:, :, r, j].T << (bits * j))


def test_pack_bytes_keeps_each_low_byte(rng):
    """_pack_bytes puts the low byte of tile a (an int8 in two's complement) in byte a."""
    x = rng.integers(-127, 128, (4, 100), dtype=np.int32)
    packed = np.asarray(_pack_bytes([jnp.asarray(v) for v in x], interpret=True))
    np.testing.assert_array_equal(packed.view(np.int8).reshape(100, 4), x.T.astype(np.int8))


@pytest.mark.parametrize("bits", [2, 4])
def test_field_masks_keep_one_token_per_byte(bits):
    """Masking a key word with field j's mask leaves, in every byte, c * 2**(bits*j) with c the
    code unpack_codes reads for token j of that byte, and nothing else."""
    per = 8 // bits
    byte = np.arange(256, dtype=np.uint8)
    codes = np.asarray(kivi_jax.quantization.unpack_codes(jnp.asarray(byte), bits, axis=0))
    codes = codes.reshape(256, per)
    words = _words(jnp.asarray(np.stack([byte, byte[::-1], byte, byte[::-1]], axis=1)))[:, 0]
    for j in range(per):
        masked = np.asarray(words & _field_mask(j, bits)).view(np.uint8).reshape(256, 4)
        expected = np.stack([codes[:, j], codes[::-1, j]] * 2, axis=1) << (bits * j)
        np.testing.assert_array_equal(masked, expected)


@pytest.mark.parametrize(("n", "bound"), [(1, 254), (2, 64516)])
def test_int8_parts_reconstruct_within_their_bound(rng, n, bound):
    """n int8 parts of x against unit = max|x| / 127: unit / 254**(n-1) * (254**(n-1) hi + ...)
    is within max|x| / 254 (n = 1) or / 64516 (n = 2) of x; a set below 1e-30 gives zeros."""
    x = rng.normal(size=(64, 32)).astype(np.float32) * np.logspace(-3, 3, 32, dtype=np.float32)
    amax = np.abs(x).max(axis=0)
    unit = _int8_unit(jnp.asarray(amax))
    parts = _int8_parts(jnp.asarray(x), unit, n)
    assert len(parts) == n and all(np.abs(np.asarray(p)).max() <= 127 for p in parts)
    rebuilt = np.asarray(_join_parts(parts), np.float64) * np.asarray(unit / _parts_unit(n))
    assert np.all(np.abs(rebuilt - x) <= amax / bound * 1.01)
    tiny = _int8_parts(jnp.full((4,), 1e-31), _int8_unit(jnp.float32(1e-31)), n)
    assert not any(np.asarray(p).any() for p in tiny)


def test_folded_query_words_reconstruct_the_folded_query(rng):
    """_fold_query (the score kernel's fold of the query into key groups): coef * y is within
    max_d |q_d s_gd| / 65534 of q_d s_gd in every group (y int16: channels 4w, 4w + 1 in the
    halves of word w of the first set of words, 4w + 2, 4w + 3 in the second), bias is
    sum_d q_d z_gd, and a group of zero scales gives zero words."""
    NG, D = 16, 64
    qs = rng.normal(size=(D,)).astype(np.float32) * 3.0
    scale = np.abs(rng.normal(size=(NG, D))).astype(np.float32)
    scale[5] = 0.0  # a group whose keys are all equal
    zero = rng.normal(size=(NG, D)).astype(np.float32)
    sc, ze = jnp.asarray(scale, jnp.bfloat16), jnp.asarray(zero, jnp.bfloat16)
    words, coef, bias = _fold_query(
        [jnp.asarray(qs).reshape(1, D // 4, 4)],
        [sc.reshape(NG, D // 4, 4)],
        [ze.reshape(NG, D // 4, 4)],
    )
    halves = [np.asarray(words[h][0]).view(np.int16).reshape(NG, D // 4, 2) for h in range(2)]
    y = np.concatenate(halves, axis=-1).reshape(NG, D).astype(np.float64)
    folded = qs[None, :] * np.asarray(sc, np.float32)  # [NG, D]
    rebuilt = np.asarray(coef)[:, None] * y
    bound = np.abs(folded).max(axis=-1, keepdims=True) / 65534
    assert np.all(np.abs(rebuilt - folded) <= bound * 1.01 + 1e-30)
    assert np.abs(y).max() <= 32767
    assert not y[5].any()
    z = np.asarray(ze, np.float32)
    np.testing.assert_allclose(np.asarray(bias), z @ qs, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("interleave", "prefetch"), [(True, 1), (False, 1), (True, 3), (False, 3)])
def test_value_kernel_splits_share_the_tail(rng, interleave, prefetch):
    """weighted_values, per token split s (64 tokens each here) of every row: its share of the
    residual tail, the R tokens [Pv, Pv + R) at ring slot t % R, is chunks s, s + S, ... of
    n slots (logit from the score kernel's output where t < Qk, else q . k_residual); its max
    m is the larger of the row's score-program maxima and its tail logits; then the sums of
    2**(s_t - m) v_t over its tail share and over the split's quantized values within [0, Pv)
    (interleaved: the row's 16-token tiles s, s + S, ...; else [64 s, 64 s + 64)), and of
    2**(s_t - m) over both. R = 48 (not a power of two: 3 chunks of 16 over 4 splits, so
    split 3 has none), rings at several rotations; as the score kernel leaves them, logits
    past Qk are garbage (NaN), the program maxima bound the quantized logits (one of them
    attains it) and a row without quantized keys has maxima of -1e30. Prefetch 3 does not
    divide a split's 4 tiles: the loop runs past its last tile, into the next split's
    (contiguous) or past Pv (interleaved), and must not count those tokens."""
    B, H, n_rep, D, G, R, C, P, n, S = 5, 2, 2, 64, 16, 48, 256, 4, 16, 4
    lengths = np.array([0, 20, 48, 100, 200], np.int32)  # Pv: 0, 0, 0, 52, 152
    q = rng.normal(size=(B, H, n_rep, D)).astype(np.float32)
    k_res, v_res = (rng.normal(size=(B, H, R, D)).astype(np.float32) for _ in range(2))
    scores = rng.normal(size=(B, H, n_rep, C)).astype(np.float32) * 3
    block_max = np.full((B, H, n_rep, P), -1e30, np.float32)
    for b, length in enumerate(lengths):
        qk = length - length % R
        scores[b, ..., qk:] = np.nan
        if qk:
            top = scores[b, ..., :qk].max(axis=-1, keepdims=True)
            block_max[b] = top - np.abs(rng.normal(size=(H, n_rep, P)))
            block_max[b, ..., rng.integers(P)] = top[..., 0]
    v_codes = jnp.asarray(rng.integers(0, 256, (B, H, C, D // 2), dtype=np.uint8))
    v_scale, v_zero = (jnp.asarray(rng.normal(size=(B, H, C, D // G)), jnp.bfloat16) for _ in "sz")
    q_scale = 0.2
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    tuning = KernelTuning(
        value_quads=4,
        value_chain=1,
        num_splits=S,
        tail_slots=n,
        value_interleave=interleave,
        prefetch=prefetch,
    )  # 16-token tiles
    m, o, o_tail, l_sum = weighted_values(
        bf(q), jnp.asarray(scores), jnp.asarray(block_max), v_codes, v_scale, v_zero,
        bf(k_res), bf(v_res), jnp.asarray(lengths), q_scale=q_scale, bits=4, group_size=G,
        residual_length=R, tuning=tuning, interpret=True,
    )  # fmt: skip
    assert m.shape == l_sum.shape == (B, H, n_rep, S) and o_tail.shape == (B, H, n_rep, S, D)
    rd = lambda x: np.asarray(bf(x), np.float64)  # the kernel reads bfloat16 operands
    codes = np.asarray(kivi_jax.quantization.unpack_codes(v_codes, 4, axis=-1), np.float64)
    values = codes * np.repeat(rd(v_scale), G, -1) + np.repeat(rd(v_zero), G, -1)  # [B,H,C,D]
    for b, length in enumerate(lengths):
        qk, pv = length - length % R, max(length - R, 0)
        for h, r, split in itertools.product(range(H), range(n_rep), range(S)):
            slot = np.array([c * n + i for c in range(split, R // n, S) for i in range(n)], int)
            tok = pv + (slot - pv) % R  # the token at each ring slot
            s_res = rd(k_res[b, h])[slot] @ (rd(q[b, h, r]) * q_scale)
            s = np.where(tok < qk, scores[b, h, r, np.minimum(tok, C - 1)], s_res)
            held = tok < length
            m_ref = max(block_max[b, h, r].max(), s[held].max(initial=-np.inf))
            p = 2.0 ** np.where(held, s - m_ref, -np.inf)
            tile = np.arange(C) // 16
            mine = tile % S == split if interleave else tile // (C // 16 // S) == split
            span = np.flatnonzero(mine & (np.arange(C) < pv))
            p_quant = 2.0 ** (scores[b, h, r, span].astype(np.float64) - m_ref)
            # m is a logit (float32 sums in the kernel): absolute error where it is near 0
            np.testing.assert_allclose(m[b, h, r, split], m_ref, rtol=1e-6, atol=1e-5)
            np.testing.assert_allclose(l_sum[b, h, r, split], p.sum() + p_quant.sum(), rtol=1e-5)
            # the quantized values' weights carried as two int8 parts: ~1/64516 of the largest
            o_quant = p_quant @ values[b, h, span]
            np.testing.assert_allclose(o[b, h, r, split], o_quant, rtol=1e-3, atol=1e-3)
            o_ref = p @ rd(v_res[b, h])[slot] if slot.size else np.zeros(D)
            np.testing.assert_allclose(o_tail[b, h, r, split], o_ref, rtol=1e-5, atol=1e-5)
    assert not np.asarray(o_tail[0]).any() and not np.asarray(l_sum[0]).any()  # length 0


@pytest.mark.parametrize("S", [1, 2, 5, 128])
def test_splits_merge_into_one_softmax(rng, S):
    """_merge_splits: the splits' partial softmaxes (max m, sums o + o_tail of 2**(s_t - m) v_t,
    l of 2**(s_t - m)) rescaled to the row's largest max: sum_s 2**(m_s - M) (o_s + o_tail_s)
    / sum_s 2**(m_s - M) l_s; a split without tokens (zero sums; m the row's quantized max,
    at most any other split's m) adds nothing, a row whose splits are all empty (m = -1e30)
    gives zeros."""
    rows, D = 4, 8
    m = rng.normal(size=(rows, S)).astype(np.float32) * 4
    o, o_tail = (rng.normal(size=(rows, S, D)).astype(np.float32) for _ in range(2))
    l_sum = rng.uniform(0.5, 2.0, size=(rows, S)).astype(np.float32)
    o[1, 0] = o_tail[1, 0] = l_sum[1, 0] = 0  # an empty split
    m[1, 0] = m[1].min() - 1
    m[3], o[3], o_tail[3], l_sum[3] = -1e30, 0, 0, 0  # an empty row
    out = _merge_splits(*(jnp.asarray(x) for x in (m, o, o_tail, l_sum)))
    w = np.exp2(m.astype(np.float64) - m.max(axis=1, keepdims=True))
    num = np.einsum("rs,rsd->rd", w, o + o_tail)
    den = (w * l_sum).sum(axis=1, keepdims=True)
    expected = np.where(den > 0, num / np.where(den > 0, den, 1), 0)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)
    assert not np.asarray(out[3]).any()


def test_an_extra_split_merges_as_one_more_split(rng):
    """_merge_splits' `extra` (a mixed state's full-precision entries, mixed.extras_softmax:
    m, o, l without the split axis) gives what one more split with no tail gives: above the
    splits' maxima, below them, and empty (m = -1e30, zero sums)."""
    rows, S, D = 3, 4, 8
    m = rng.normal(size=(rows, S)).astype(np.float32) * 4
    o, o_tail = (rng.normal(size=(rows, S, D)).astype(np.float32) for _ in range(2))
    l_sum = rng.uniform(0.5, 2.0, size=(rows, S)).astype(np.float32)
    m_e = np.array([m[0].max() + 3, m[1].min() - 3, -1e30], np.float32)
    o_e = rng.normal(size=(rows, D)).astype(np.float32)
    l_e = np.array([1.5, 0.7, 0.0], np.float32)
    o_e[2] = 0
    extra = tuple(jnp.asarray(x) for x in (m_e, o_e, l_e))
    got = _merge_splits(*(jnp.asarray(x) for x in (m, o, o_tail, l_sum)), extra)
    joined = (
        np.concatenate([m, m_e[:, None]], 1), np.concatenate([o, o_e[:, None]], 1),
        np.concatenate([o_tail, np.zeros((rows, 1, D), np.float32)], 1),
        np.concatenate([l_sum, l_e[:, None]], 1),
    )  # fmt: skip
    want = _merge_splits(*(jnp.asarray(x) for x in joined))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def _check(q, cache, *, interpret, tuning=None):
    out = decode_attention_pallas(q, cache, interpret=interpret, tuning=tuning or KernelTuning())
    assert_matches_reference(out, q, cache)


def _case(rng, *, k_bits, v_bits, D, n_rep, dtype, H, max_len, prompts, steps, R):
    cfg = kivi_jax.KiviConfig(k_bits=k_bits, v_bits=v_bits, group_size=32, residual_length=R)
    cache = streamed_cache(
        rng, config=cfg, H=H, D=D, max_len=max_len, prompts=prompts, steps=steps, dtype=dtype
    )
    q = jnp.asarray(rng.normal(size=(len(prompts), H * n_rep, D)).astype(np.float32), dtype)
    return q, cache


# CPU (interpret) grid: each case covers several axes at once (pairwise), a few seconds apiece.
# Final lengths (prompt + 5 steps: 32, 305, 69, 185) are shorter than R, not multiples of G or
# of the block, past key flushes and value-ring wraps; test_length_zero_row covers l = 0.
# With GQA the default runs the tensor-core kernels (`gqa_scores.py`, `gqa_values.py`); these
# fields choose the CUDA-core ones for both (CC), the values (SC: tensor-core scores only) or
# the scores (VC: tensor-core values only).
CC = {"gqa_scores": "cuda_cores", "gqa_values": "cuda_cores"}
SC = {"gqa_values": "cuda_cores"}
VC = {"gqa_scores": "cuda_cores"}
_CPU_CASES = [
    # k_bits, v_bits, D, n_rep, dtype, GpuTuning fields
    (2, 2, 128, 4, jnp.bfloat16, CC),
    (4, 4, 64, 1, jnp.float16, {}),
    (2, 4, 64, 3, jnp.bfloat16, CC),
    (4, 2, 128, 8, jnp.float16, CC),
    (2, 2, 64, 1, jnp.float16, {}),
    (4, 4, 128, 3, jnp.bfloat16, CC),
    (2, 2, 128, 4, jnp.bfloat16, {}),
    (4, 2, 64, 3, jnp.float16, SC),
    (2, 4, 64, 8, jnp.bfloat16, {}),
    (4, 4, 128, 2, jnp.float16, SC),
    (4, 2, 64, 3, jnp.bfloat16, VC),
    (2, 4, 128, 2, jnp.float16, {}),
    # n_rep 5-7 (Qwen2.5's 5 and 7 query heads per KV head, Qwen3's 6 at 0.6B): the
    # tensor-core kernels' 8 head slots part used, and the CUDA-core ones
    (2, 2, 64, 5, jnp.bfloat16, {}),
    (4, 4, 64, 6, jnp.float16, CC),
    (2, 4, 64, 7, jnp.bfloat16, SC),
]


@pytest.mark.parametrize(("k_bits", "v_bits", "D", "n_rep", "dtype", "fields"), _CPU_CASES)
def test_kernel_matches_reference_interpret(rng, k_bits, v_bits, D, n_rep, dtype, fields):
    q, cache = _case(
        rng, k_bits=k_bits, v_bits=v_bits, D=D, n_rep=n_rep, dtype=dtype, H=2, max_len=400,
        prompts=[27, 300, 64, 180], steps=5, R=64,
    )  # fmt: skip
    _check(q, cache, interpret=True, tuning=KernelTuning(num_splits=3, **fields))


def test_length_zero_row_interpret(rng):
    cfg = kivi_jax.KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=64)
    cache = streamed_cache(
        rng, config=cfg, H=2, D=64, max_len=256, prompts=[0, 97, 200], steps=0,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    q = jnp.asarray(rng.normal(size=(3, 4, 64)), jnp.bfloat16)
    _check(q, cache, interpret=True, tuning=KernelTuning(score_rows=8, num_splits=3, **CC))
    _check(q, cache, interpret=True, tuning=KernelTuning(num_splits=3))


def test_gqa_falls_back_to_cuda_cores_where_tensor_cores_do_not_apply_interpret(rng):
    """G = 64: the tensor-core kernels take G = 32 only, so the default runs the CUDA-core
    ones (with GQA, n_rep 2)."""
    from kivi_jax.pallas_kernels.decode_attention import gqa_scores, gqa_values

    assert gqa_scores.supported_reason(n_rep=2, group_size=64, head_dim=64, k_bits=2)
    assert gqa_values.supported_reason(n_rep=2, group_size=64, head_dim=64, v_bits=2)
    cfg = kivi_jax.KiviConfig(k_bits=2, v_bits=2, group_size=64, residual_length=64)
    cache = streamed_cache(
        rng, config=cfg, H=2, D=64, max_len=256, prompts=[130, 200], steps=3,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.bfloat16)
    _check(q, cache, interpret=True, tuning=KernelTuning(num_splits=2))


def test_residual_length_not_a_power_of_two_interpret(rng):
    """R = 96: the tail in 6 chunks of 16 ring slots, dealt to 2 value splits; final lengths
    305, 97 (just past R) and 5 (a row that started empty)."""
    q, cache = _case(
        rng, k_bits=2, v_bits=4, D=64, n_rep=2, dtype=jnp.bfloat16, H=2, max_len=320,
        prompts=[300, 92, 0], steps=5, R=96,
    )  # fmt: skip
    _check(q, cache, interpret=True, tuning=KernelTuning(num_splits=2))


@pytest.mark.parametrize("capacity", [320, 2176, 4096, 96 * 32])
@pytest.mark.parametrize(
    "tuning", [KernelTuning(), KernelTuning(score_program_groups=4, score_rows=8)]
)
def test_score_tiles_stay_within_the_capacity(capacity, tuning):
    """Every tile a score program loads or stores, prefetched ones past its last included,
    lies within the capacity's key groups (interpret mode pads blocks, so only this shows a
    missing clamp; the Triton lowering reads and writes past the arrays)."""
    for bits in (2, 4):
        NG, n1, _ = score_tiles(tuning, capacity=capacity, group_size=32, head_dim=128, k_bits=bits)
        n_groups = capacity // 32
        assert NG % n1 == 0 and n_groups % n1 == 0
        for g_base in range(0, n_groups, NG):
            for k in range(NG // n1 + 4):
                start = g_base + int(
                    _score_tile_start(
                        k, g_base=g_base, program_groups=NG, groups_per_iter=n1,
                        n_groups=n_groups,
                    )
                )  # fmt: skip
                assert g_base <= start and start + n1 <= min(g_base + NG, n_groups)


@pytest.mark.parametrize("stages", [1, 3])
def test_last_score_program_holds_the_rest_interpret(rng, stages):
    """A capacity of 10 key groups in score programs of 4: the programs hold groups 0-3, 4-7
    and 8-9 (the last one's blocks reach past the capacity); final lengths end in each
    program, in the last one's second group and at the capacity; the register prefetch (1
    stage, two tiles ahead) and the plain loop Triton pipelines (3). The CUDA-core kernels,
    whose score programs these are (n_rep = 2)."""
    tuning = KernelTuning(
        score_program_groups=4, num_splits=2, score_stages=stages, prefetch=2, **CC
    )
    assert score_tiles(tuning, capacity=320, group_size=32, head_dim=64, k_bits=2)[:2] == (4, 2)
    q, cache = _case(
        rng, k_bits=2, v_bits=2, D=64, n_rep=2, dtype=jnp.bfloat16, H=2, max_len=320,
        prompts=[100, 230, 312, 315], steps=5, R=64,
    )  # fmt: skip
    assert cache.k_codes.shape[2] * 4 == 320  # the capacity, in key codes
    _check(q, cache, interpret=True, tuning=tuning)


def test_score_program_maxima_are_padded_to_a_power_of_two_interpret(rng):
    """10 key groups in score programs of 4 (3 programs a row): the maxima come as 4 per row,
    program p's the max of its logits below Qk (-1e30 where it holds none), the fourth -1e30,
    so that a value program reads them in one load."""
    B, H, n_rep, D, G, C, R = 3, 1, 2, 64, 32, 320, 64
    tuning = KernelTuning(score_program_groups=4)
    lengths = np.array([320, 170, 40], np.int32)  # Qk: 320, 128, 0
    logits, maxima = key_scores(
        jnp.asarray(rng.normal(size=(B, H, n_rep, D)), jnp.bfloat16),
        jnp.asarray(rng.integers(0, 256, (B, H, C // 4, D), dtype=np.uint8)),
        jnp.asarray(rng.random((B, H, C // G, D)) + 0.1, jnp.bfloat16),
        jnp.asarray(rng.normal(size=(B, H, C // G, D)), jnp.bfloat16),
        jnp.asarray(lengths), q_scale=0.2, bits=2, group_size=G, residual_length=R,
        tuning=tuning, interpret=True,
    )  # fmt: skip
    assert maxima.shape == (B, H, n_rep, 4)
    logits, maxima = np.asarray(logits), np.asarray(maxima)
    for b, length in enumerate(lengths):
        qk = length - length % R
        for p in range(3):
            held = logits[b, ..., p * 128 : min((p + 1) * 128, qk)]
            want = held.max(-1) if held.size else np.float32(-1e30)
            np.testing.assert_array_equal(maxima[b, ..., p], want)
    assert (maxima[..., 3] == np.float32(-1e30)).all()


def test_random_layout_state_interpret(rng):
    """Random codes, scales (some zero) and zero points written straight into the layout."""
    cache = random_layout_cache(
        rng, capacity=256, residual_length=64, lengths=[256, 100, 193], zero_value_scales=0
    )
    q = jnp.asarray(rng.normal(size=(3, 6, 64)), jnp.bfloat16)
    _check(q, cache, interpret=True, tuning=KernelTuning(num_splits=2))


@pytest.mark.parametrize(
    "tuning",
    [
        # many small tiles and programs: every clamp and mask at a tile or split boundary
        KernelTuning(
            score_rows=4,
            score_slices=2,
            score_program_groups=2,
            value_quads=2,
            value_chain=2,
            num_splits=5,
        ),
        KernelTuning(value_quads=2, num_splits=3, prefetch=3, value_interleave=False),
        KernelTuning(
            prefetch=3, score_rows=16, score_slices=1, value_quads=8, num_splits=2, score_stages=1
        ),
        KernelTuning(prefetch=2, score_program_groups=64, value_chain=4, num_splits=1),
        KernelTuning(score_stages=2, prefetch=2, score_rows=4, value_quads=2, num_splits=3),
        KernelTuning(value_parts=1, value_quads=4, num_splits=3),
    ],
)
def test_kernel_variants_interpret(rng, tuning):
    """The CUDA-core kernels, whose tiles these fields shape, with GQA (n_rep = 3: the
    tensor-core kernels' own tilings are in test_gqa_scores.py and test_gqa_values.py)."""
    q, cache = _case(
        rng, k_bits=2, v_bits=4, D=64, n_rep=3, dtype=jnp.bfloat16, H=2, max_len=384,
        prompts=[384 - 3, 250], steps=3, R=64,
    )  # fmt: skip
    _check(q, cache, interpret=True, tuning=dataclasses.replace(tuning, **CC))


def test_dispatch(rng):
    q, cache = _case(  # MHA: the cheapest kernels to interpret (dispatch is what is tested)
        rng, k_bits=2, v_bits=2, D=64, n_rep=1, dtype=jnp.bfloat16, H=2, max_len=128,
        prompts=[100, 40], steps=1, R=64,
    )  # fmt: skip
    ref = kivi_jax.decode_attention(q, cache, impl="reference")
    if jax.default_backend() != "gpu":
        np.testing.assert_array_equal(kivi_jax.decode_attention(q, cache), ref)  # auto
        with pytest.raises(NotImplementedError, match="CUDA GPU"):
            kivi_jax.decode_attention(q, cache, impl="pallas")
    out = kivi_jax.decode_attention(q, cache, impl="pallas", interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=0.05)
    full = kivi_jax.init_cache(None, batch=2, max_len=128, num_kv_heads=2, head_dim=64)
    with pytest.raises(NotImplementedError, match="KiviCache"):
        kivi_jax.decode_attention(q, full, impl="pallas", interpret=True)
    cfg8 = kivi_jax.KiviConfig(k_bits=8, v_bits=8, group_size=32, residual_length=64)
    c8 = kivi_jax.init_cache(cfg8, batch=2, max_len=128, num_kv_heads=2, head_dim=64)
    with pytest.raises(NotImplementedError, match="k_bits=8"):
        kivi_jax.decode_attention(q, c8, impl="pallas", interpret=True)


def _lowered_triton_modules(monkeypatch, tuning: GpuTuning, n_rep: int = 1) -> dict[str, str]:
    """{kernel name: its Triton module as text}, lowered for CUDA (no GPU needed) at a small
    shape, as Pallas-Triton hands it on (after `triton_stages` marks its loops)."""
    triton_stages.install()
    B, H, C, D, G, R = 1, 2, 256, 64, 32, 64
    sd, bf, u8 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.uint8
    args = [sd((B, H * n_rep, D), bf), sd((B, H, C // 2, D), u8), sd((B, H, C // G, D), bf),
            sd((B, H, C // G, D), bf), sd((B, H, C, D // 2), u8), sd((B, H, C, D // G), bf),
            sd((B, H, C, D // G), bf), sd((B, H, R, D), bf), sd((B, H, R, D), bf),
            sd((B,), jnp.int32)]  # fmt: skip
    step = functools.partial(
        kivi_decode_attention_gpu, k_bits=4, v_bits=4, group_size=G, residual_length=R,
        tuning=tuning,
    )  # fmt: skip
    return triton_modules(monkeypatch, step, *args)


@pytest.mark.parametrize(
    ("score_stages", "n_rep", "stages"),
    [(1, 1, 1), (4, 1, 4), (None, 1, 3), (None, 2, 1), (2, 2, 2)],
)
def test_score_loop_carries_its_pipeline_stages(monkeypatch, score_stages, n_rep, stages):
    """Triton pipelines a loop without a dot only where it carries tt.num_stages: the score
    kernel's one loop gets score_stages (left None: 3 for MHA, 1 for GQA; at 1 it keeps the
    register prefetch, unmarked); the value kernel's two loops (its tail share's and its main
    loop) are never marked. (The CUDA-core kernels, also with GQA.)"""
    tuning = KernelTuning(score_stages=score_stages, **CC)
    modules = _lowered_triton_modules(monkeypatch, tuning, n_rep)
    score = modules["kivi_scores" if stages == 1 else f"kivi_scores_stages{stages}"]
    assert score.count("scf.for") == 1
    assert re.findall(r"tt\.num_stages = (\d+)", score) == ([] if stages == 1 else [str(stages)])
    assert modules["kivi_values"].count("scf.for") == 2
    assert "tt.num_stages" not in modules["kivi_values"]


def test_without_the_lowering_hook_the_score_kernel_prefetches_in_registers(monkeypatch):
    """Where jax lacks Pallas-Triton's lowering function, `install` warns and returns False
    and compiled kernels keep the register prefetch (interpret mode runs the plain loop as
    asked, no lowering involved)."""
    from jax._src.pallas.triton import lowering

    monkeypatch.delattr(lowering, "lower_jaxpr_to_triton_module")
    triton_stages._warn_unavailable.cache_clear()
    with pytest.warns(UserWarning, match="Triton loop pipelining unavailable"):
        assert not triton_stages.install()
    assert _loop_stages(3, interpret=False) == 1
    assert _loop_stages(3, interpret=True) == 3


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"prefetch": 0}, "prefetch"),
        ({"score_stages": 0}, "score_stages must be a positive int"),
        ({"num_splits": 0}, "num_splits"),
        ({"score_slices": 3}, "score_slices"),
        ({"value_chain": 128}, "value_chain=128: at most 64"),
        ({"value_parts": 3}, "value_parts must be 1 or 2"),
        ({"value_interleave": 1}, "value_interleave must be a bool"),
        ({"score_slices": 0}, "score_slices must be a positive int"),
        ({"value_quads": 0}, "value_quads must be a positive int"),
        ({"tail_slots": 0}, "tail_slots must be a positive int"),
        ({"gqa_scores": "mma"}, "gqa_scores must be 'cuda_cores' or 'tensor_cores'"),
        ({"gqa_program_groups": 0}, "gqa_program_groups must be a positive int"),
        ({"gqa_values": True}, "gqa_values must be 'cuda_cores' or 'tensor_cores'"),
        ({"gqa_value_blocks": 0}, "gqa_value_blocks must be a positive int"),
    ],
)
def test_bad_tunings_are_named(fields, match):
    with pytest.raises(ValueError, match=match):
        KernelTuning(**fields)


def test_gpu_tuning_holds_what_a_user_sets_and_the_kernels_the_settled_tiles():
    """GpuTuning: at most 8 fields; the tile sizes are KernelTuning's, which the kernels run
    with (a GpuTuning's fields and the settled tiles)."""
    from kivi_jax.pallas_kernels.decode_attention.gpu import kernel_tuning

    assert len(dataclasses.fields(GpuTuning)) <= 8
    with pytest.raises(TypeError):
        GpuTuning(score_rows=16)
    with pytest.raises(ValueError, match=r"GpuTuning\.gqa_scores must be"):
        GpuTuning(gqa_scores="mma")
    assert kernel_tuning(GpuTuning()) == KernelTuning()
    assert kernel_tuning(GpuTuning(num_splits=3)) == KernelTuning(num_splits=3)


@pytest.mark.parametrize(("bits", "slices", "quads"), [(2, 2, 16), (4, 1, 8)])
def test_fields_left_none_take_the_bit_widths_default(bits, slices, quads):
    default = KernelTuning()
    assert default.key_slices(bits) == slices and default.quads(bits) == quads
    chosen = KernelTuning(score_slices=4, value_quads=4)
    assert chosen.key_slices(bits) == 4 and chosen.quads(bits) == 4
    assert KernelTuning(num_splits=None).num_splits is None  # chosen by the value kernel


def test_score_stages_left_none_follow_heads_bits_and_programs():
    """3 pipeline stages for MHA, but the register prefetch (1) for 2-bit keys in one wave of
    programs; 1 for GQA; a set value stands."""
    t = KernelTuning()
    many, few = t.one_wave + 1, t.one_wave
    assert t.key_stages(1, k_bits=2, programs=many) == t.key_stages(1, k_bits=4, programs=few) == 3
    assert t.key_stages(1, k_bits=2, programs=few) == 1
    assert t.key_stages(4, k_bits=4, programs=many) == 1
    set2 = KernelTuning(score_stages=2)
    assert set2.key_stages(1, k_bits=2, programs=few) == 2
    assert set2.key_stages(4, k_bits=4, programs=many) == 2


def test_gqa_program_groups_left_none_follow_the_programs():
    """16 key groups per tensor-core score program where that fills `one_wave` programs
    (8 x 32k at 8 KV heads: 64 rows of 64 programs), else 8; a set value stands."""
    t = KernelTuning()
    assert t.gqa_groups(n_groups=1024, rows=64) == 16  # 4096 programs
    assert t.gqa_groups(n_groups=1024, rows=8) == 8  # 1 x 32k
    assert t.gqa_groups(n_groups=68, rows=128) == 8  # 16 x 2176: 640 programs
    assert KernelTuning(gqa_program_groups=4).gqa_groups(n_groups=1024, rows=64) == 4


def test_unsupported_configs_are_named():
    ok = dict(k_bits=2, v_bits=2, group_size=32, head_dim=128, dtype=jnp.bfloat16)
    assert supported_config_reason(**ok) is None
    assert "k_bits=8" in supported_config_reason(**{**ok, "k_bits": 8})
    assert "head_dim=96" in supported_config_reason(**{**ok, "head_dim": 96})
    assert "float32" in supported_config_reason(**{**ok, "dtype": jnp.float32})
    assert "group_size=8" in supported_config_reason(**{**ok, "group_size": 8})


_GPU_GRID = [  # the CUDA-core kernels at n_rep 1, 3-8; the tensor-core ones (GQA) too
    (bits, D, n_rep, dtype, name)
    for name, reps in (
        ("cuda_cores", [1, 3, 4, 5, 6, 7, 8]),
        ("tensor_scores", [2, 3, 4, 5, 6, 7, 8]),
        ("tensor_both", [2, 3, 4, 5, 6, 7, 8]),
    )
    for bits, D, n_rep, dtype in itertools.product(
        [(2, 2), (4, 4), (2, 4), (4, 2)], [64, 128], reps, [jnp.bfloat16, jnp.float16]
    )
]


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "D", "n_rep", "dtype", "kernels"), _GPU_GRID)
def test_kernel_matches_reference_gpu(rng, bits, D, n_rep, dtype, kernels):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    k_bits, v_bits = bits
    q, cache = _case(
        rng, k_bits=k_bits, v_bits=v_bits, D=D, n_rep=n_rep, dtype=dtype, H=4, max_len=2100,
        prompts=[0, 1, 95, 1280, 2040, 1400], steps=7, R=128,
    )  # fmt: skip
    _check(
        q,
        cache,
        interpret=False,
        tuning=KernelTuning(**{"cuda_cores": CC, "tensor_scores": SC}.get(kernels, {})),
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("tuning", "bits"),
    [
        (KernelTuning(score_rows=64, score_slices=8, value_quads=16, value_chain=4), 2),
        (KernelTuning(prefetch=2, value_quads=64, value_chain=1), 2),
        (
            KernelTuning(
                score_rows=8, score_slices=2, score_program_groups=4, value_quads=4, num_splits=7
            ),
            2,
        ),
        (KernelTuning(value_parts=1), 2),
        (KernelTuning(score_slices=4, value_quads=8), 2),
        (KernelTuning(score_slices=2), 4),  # 4-bit keys in two slices
        (KernelTuning(score_stages=1), 4),  # the register prefetch at 4 bits
        (KernelTuning(score_stages=4, prefetch=2, score_rows=32), 2),
        (KernelTuning(prefetch=2), 4),
    ],
)
def test_kernel_tunings_gpu(rng, tuning, bits):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, cache = _case(
        rng, k_bits=bits, v_bits=bits, D=128, n_rep=4, dtype=jnp.bfloat16, H=8, max_len=4096,
        prompts=[4000, 3001, 129], steps=9, R=128,
    )  # fmt: skip
    _check(q, cache, interpret=False, tuning=tuning)


@pytest.mark.gpu
def test_residual_length_not_a_power_of_two_gpu(rng):
    """R = 96: the tail in 6 chunks of 16 ring slots, dealt to the value splits (every other
    GPU case has R = 128, 8 chunks); final lengths 1007, 97 (just past R), 7 (a row that
    started empty) and 407."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, cache = _case(
        rng, k_bits=2, v_bits=4, D=128, n_rep=2, dtype=jnp.bfloat16, H=4, max_len=1100,
        prompts=[1000, 90, 0, 400], steps=7, R=96,
    )  # fmt: skip
    _check(q, cache, interpret=False)
