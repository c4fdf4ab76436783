"""The TPU decode-attention kernel against the reference, in Pallas TPU interpret mode on the CPU.

CI runs the kernel in jax's TPU interpreter (uninitialized memory, and the padding of a last
block that runs past the capacity, read as NaN, so a read that is not masked shows up) on small
shapes with small blocks, so that sequences span several blocks and chunks; `pytest -m slow`
runs the full grid (bits x head_dim x GQA x dtype). A test lowers the kernel for TPU (Mosaic) on
the CPU, so that a block that breaks the TPU tiling rules fails here rather than on a TPU; the
Mosaic compiler's own checks (vector layouts, strided stores) run only on a TPU, where
`pytest tests/test_decode_attention_tpu.py` also runs the compiled kernel over the full grid
(skipped elsewhere; no TPU was available to the project, so those have never run).

States are real: built by kivi_jax.prefill and kivi_jax.append from random keys and values
(ragged prompts, then decode steps so rings wrap and keys flush), plus one state with random
codes, scales (some zero) and zero points written straight into the layout.

Tolerance (STYLE.md, after flash-attention's tests; the GPU kernel's tests use the same rule):
the kernel dequantizes and sums in float32 and rounds the operands of its products to
`mxu_dtype` (bfloat16 for a bfloat16 cache; float32, i.e. no rounding, for a float16 cache), so
it must be at most about twice as far from the float32 reference as a plain attention that
rounds the same operands (the scaled query, keys, softmax weights, values) to that dtype, plus
one rounding of the output to the query's dtype (4u of the values' magnitude) and float32
roundoff (sums of up to a few thousand terms, exponentials of logits of magnitude ~50: 1e-5 of
the values' magnitude). With a float16 cache the first term is float32 roundoff too, so those
cases check the kernel to about the output's rounding. Both references read the same
dequantized state (kivi_jax.cache.dequantized_heads_major), so quantization error never enters
the comparison.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_layout_cache, streamed_cache
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kivi_jax.pallas_kernels.decode_attention import (
    TpuTuning,
    decode_attention_pallas_tpu,
    kivi_decode_attention_tpu,
    tpu_supported_config_reason,
)
from kivi_jax.pallas_kernels.decode_attention.tpu import (
    _keys,
    _values,
    fold_matrix,
    mxu_dtype,
    spread_matrix,
    tiles,
    tiling_unit,
    unspread_matrix,
)

import kivi_jax
from kivi_jax.cache import dequantized_heads_major

# Small blocks for CPU runs: at G = 32 a chunk is 512 tokens (the tiling unit) and a block 2.
SMALL = TpuTuning(block_tokens=1024, chunk_tokens=512)


def _unpack_in_kernel(fn, arrays, out_shape):
    """Runs fn(*refs) -> array in a one-step TPU-interpreted pallas_call over whole arrays."""

    def kernel(*refs):
        *ins, o_ref, scr = refs
        o_ref[...] = fn(*ins, scr)

    scratch, out = out_shape
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out, jnp.float32),
        scratch_shapes=[pltpu.VMEM(scratch, jnp.float32)],
        interpret=pltpu.InterpretParams(),
    )(*arrays)


@pytest.mark.parametrize(("bits", "G"), [(2, 32), (4, 16)])
def test_keys_are_unpacked_in_token_order(rng, bits, G):
    """_keys on chunk 1 of a block (n = 256 tokens): row t is code * scale + zero of token
    n + t, codes in unpack_codes's order (packed along tokens), each group's (scale, zero) over
    its G tokens; bit-identical to quantization.dequantize."""
    n, D, kpb = 256, 128, 8 // bits
    codes = rng.integers(0, 256, (2 * n // kpb, D), dtype=np.uint8)
    scale, zero = (jnp.asarray(rng.normal(size=(2 * n // G, D)), jnp.bfloat16) for _ in "sz")
    fn = lambda c_ref, s_ref, z_ref, scr: _keys(c_ref, s_ref, z_ref, scr, 1, n=n, bits=bits,
                                                group_size=G)  # fmt: skip
    out = _unpack_in_kernel(fn, (jnp.asarray(codes), scale, zero), ((n, D), (n, D)))
    unpacked = kivi_jax.quantization.unpack_codes(jnp.asarray(codes), bits, axis=0)
    expected = kivi_jax.quantization.dequantize(unpacked, scale, zero, G, axis=0)[n:]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


@pytest.mark.parametrize(("bits", "G", "dtype"), [(2, 32, jnp.bfloat16), (4, 16, jnp.float16)])
def test_values_are_unpacked_in_token_order(rng, bits, G, dtype):
    """_values on chunk 1 (n = 64 tokens): row t, lane j D / vpb + i is code * scale + zero of
    token n + t, channel vpb i + j (codes packed along channels), with the token's (scale,
    zero) of that channel's group spread over the lanes in mxu_dtype(dtype); bit-identical to
    quantization.dequantize."""
    n, D, vpb = 64, 128, 8 // bits
    codes = rng.integers(0, 256, (2 * n, D // vpb), dtype=np.uint8)
    scale, zero = (jnp.asarray(rng.normal(size=(2 * n, D // G)), dtype) for _ in "sz")
    fn = lambda c_ref, s_ref, z_ref, scr: _values(c_ref, s_ref, z_ref, scr, 1, n=n, bits=bits,
                                                  group_size=G, mxu=mxu_dtype(dtype))  # fmt: skip
    out = _unpack_in_kernel(fn, (jnp.asarray(codes), scale, zero), ((n, D), (n, D)))
    unpacked = kivi_jax.quantization.unpack_codes(jnp.asarray(codes), bits, axis=1)
    expected = kivi_jax.quantization.dequantize(unpacked, scale, zero, G, axis=1)[n:]  # [n, D]
    width = D // vpb
    for j in range(vpb):
        np.testing.assert_array_equal(
            np.asarray(out[:, j * width : (j + 1) * width]), np.asarray(expected[:, j::vpb])
        )


@pytest.mark.parametrize("bits", [2, 4])
def test_spread_and_unspread_matrices(rng, bits):
    """scale @ spread puts a token's group-g scale on every lane of the value scratch whose
    channel (lane j D / vpb + i: channel vpb i + j) is in group g; x @ unspread puts the
    scratch's lanes back in channel order."""
    D, G, vpb = 128, 32, 8 // bits
    width = D // vpb
    lane_channel = np.array([vpb * (c % width) + c // width for c in range(D)])
    scale = rng.normal(size=(5, D // G)).astype(np.float32)
    spread = np.asarray(spread_matrix(head_dim=D, group_size=G, v_bits=bits))
    np.testing.assert_array_equal(scale @ spread, scale[:, lane_channel // G])
    x = rng.normal(size=(3, D)).astype(np.float32)
    unspread = np.asarray(unspread_matrix(head_dim=D, v_bits=bits))
    np.testing.assert_array_equal((x @ unspread)[:, lane_channel], x)


def test_fold_matrix_adds_tokens_to_their_slots(rng):
    """p @ fold: slot s gets the weights of the chunk's tokens u with u % R == s."""
    n, R = 384, 96
    p = rng.integers(-1000, 1000, (2, n)).astype(np.float32)  # exact sums in any order
    folded = p @ np.asarray(fold_matrix(tokens=n, residual_length=R))
    np.testing.assert_array_equal(folded, p.reshape(2, n // R, R).sum(axis=1))


def _case(
    rng, *, k_bits, v_bits, D, n_rep, dtype, prompts, steps, max_len, R=128, G=32, H=2, **formats
):
    cfg = kivi_jax.KiviConfig(
        k_bits=k_bits, v_bits=v_bits, group_size=G, residual_length=R, **formats
    )
    cache = streamed_cache(
        rng, config=cfg, H=H, D=D, max_len=max_len, prompts=prompts, steps=steps, dtype=dtype
    )
    q = jnp.asarray(rng.normal(size=(len(prompts), H * n_rep, D)).astype(np.float32), dtype)
    return q, cache


@jax.jit
def _references(q, cache):
    """(the float32 reference; the same with the scaled query, keys, softmax weights and values
    rounded to mxu_dtype(cache dtype); max |v|), each [B, Hq, D] but the last."""
    rnd = lambda x: x.astype(mxu_dtype(cache.dtype)).astype(jnp.float32)
    k, v = dequantized_heads_major(cache)  # [B, H, C, D] float32
    B, Hq, D = q.shape
    H, hi = k.shape[1], jax.lax.Precision.HIGHEST
    qg = rnd(q.astype(jnp.float32) / np.sqrt(D)).reshape(B, H, Hq // H, D)  # [B, H, rep, D]
    s = jnp.einsum("bhrd,bhtd->bhrt", qg, rnd(k), precision=hi)
    held = jnp.arange(k.shape[2]) < cache.lengths[:, None, None, None]  # [B, 1, 1, C]
    s = jnp.where(held, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(held, jnp.exp(s - jnp.where(held.any(-1, keepdims=True), m, 0.0)), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    lo = jnp.einsum("bhrt,bhtd->bhrd", rnd(p), rnd(v), precision=hi) / jnp.maximum(den, 1e-30)
    ref = kivi_jax.decode_attention_reference(q.astype(jnp.float32), cache)
    return ref, lo.reshape(B, Hq, D), jnp.abs(v).max()


def _check(q, cache, tuning=SMALL, attend=None):
    """The kernel (or `attend(q, cache)`, a route to it) is within the tolerance of the module
    docstring of the reference, finite, and zero for length-0 rows."""
    if attend is None:
        out = decode_attention_pallas_tpu(q, cache, interpret=True, tuning=tuning)
    else:
        out = attend(q, cache)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    ref, ref_lo, v_max = (np.asarray(x) for x in _references(q, cache))
    u = float(jnp.finfo(q.dtype).eps) / 2
    tol = 2 * np.abs(ref_lo - ref).max() + (4 * u + 1e-5) * max(float(v_max), 1.0)
    err = np.abs(out - ref).max()
    assert err <= tol, f"max err {err:.3g} > tol {tol:.3g}"
    assert (out[np.asarray(cache.lengths) == 0] == 0).all()


# Final lengths (prompt + 1 step) with R = 128, G = 32 and 1024-token blocks of two 512-token
# chunks: 0 (a row that stays empty), 3 (l < R), 131 (just past R: one quantized value), 256
# (l % R == 0: right after a flush), 603 (the key tail [Qk - R, Qk) = [384, 512) ends a chunk),
# 1027 (past a block), 1283 (rings wrapped many times, three blocks).
PROMPTS = [0, 2, 130, 255, 602, 1026, 1282]
LENGTHS = [0, 3, 131, 256, 603, 1027, 1283]
_CPU_CASES = [
    # k_bits, v_bits, D, n_rep, dtype: pairwise over the axes of the slow grid (the tests
    # below add (2, 4, 128, 2), (4, 2, 128, 4), (2, 4, 64, 3), (4, 4, 64, 2), (2, 4, 64, 3))
    (2, 2, 128, 4, jnp.bfloat16),
    (4, 4, 64, 1, jnp.float16),
    (2, 4, 64, 8, jnp.bfloat16),
    (4, 2, 128, 3, jnp.float16),
]


@pytest.mark.parametrize(("k_bits", "v_bits", "D", "n_rep", "dtype"), _CPU_CASES)
def test_kernel_matches_reference(rng, k_bits, v_bits, D, n_rep, dtype):
    """Rows 1-6 get their last token by a decode step (append); row 0 stays empty."""
    q, cache = _case(
        rng, k_bits=k_bits, v_bits=v_bits, D=D, n_rep=n_rep, dtype=dtype, prompts=PROMPTS,
        steps=0, max_len=1300,
    )  # fmt: skip
    step = jnp.asarray(np.arange(len(PROMPTS)) > 0)
    k_t, v_t = (jnp.asarray(rng.normal(size=(len(PROMPTS), 2, D)), jnp.float32) for _ in "kv")
    cache = kivi_jax.append(cache, k_t, v_t, active=step)
    assert np.asarray(cache.lengths).tolist() == LENGTHS
    _check(q, cache)


def test_float32_queries_match_to_float32_roundoff(rng):
    """A float16 cache (float32 products) and float32 queries (no output rounding): the kernel
    is the reference up to float32 roundoff."""
    q, cache = _case(
        rng, k_bits=2, v_bits=4, D=128, n_rep=2, dtype=jnp.float16, prompts=[1100, 90, 0],
        steps=0, max_len=1200,
    )  # fmt: skip
    _check(q.astype(jnp.float32), cache)


def test_one_block_holds_the_whole_capacity(rng):
    """The default tuning at a capacity below one block (416 tokens): a single block of one
    chunk, 512 tokens, past the capacity (its last 96 rows are the interpreter's NaN padding).
    Called through kivi_jax.decode_attention(impl="pallas_tpu", interpret=True)."""
    q, cache = _case(
        rng, k_bits=4, v_bits=2, D=128, n_rep=4, dtype=jnp.bfloat16, prompts=[27, 300, 0, 400],
        steps=0, max_len=400,
    )  # fmt: skip
    assert tiles(TpuTuning(), capacity=416, k_bits=4, group_size=32, residual_length=128) == (
        512,
        512,
    )
    attend = functools.partial(kivi_jax.decode_attention, impl="pallas_tpu", interpret=True)
    _check(q, cache, attend=attend)


def test_int8_zero_points_and_an_int8_residual_are_read_as_their_values(rng):
    """kivi2-lean's plain formats (issue 61): Format.E4M3_INT8 scales and zero points and an
    INT8 residual, widened to the cache dtype by XLA before the kernel
    (decode_attention.state.kernel_args)."""
    int8 = kivi_jax.Format.E4M3_INT8
    q, cache = _case(
        rng, k_bits=2, v_bits=2, D=64, n_rep=1, dtype=jnp.bfloat16, prompts=[150, 40],
        steps=0, max_len=160, k_scale_format=int8, v_scale_format=int8,
        residual_format=kivi_jax.Format.INT8,
    )  # fmt: skip
    assert cache.k_zero.dtype == cache.v_zero.dtype == cache.k_residual.dtype == jnp.int8
    _check(q, cache)


def test_group_16_and_several_chunks_per_block(rng):
    """G = 16 (tiling unit 256), R = 64: 256-token chunks, four to a 1024-token block."""
    q, cache = _case(
        rng, k_bits=2, v_bits=4, D=64, n_rep=3, dtype=jnp.float16, prompts=[1500, 700, 63, 5],
        steps=0, max_len=1600, R=64, G=16,
    )  # fmt: skip
    tuning = TpuTuning(block_tokens=1024, chunk_tokens=256)
    assert tiles(tuning, capacity=1600, k_bits=2, group_size=16, residual_length=64) == (1024, 256)
    _check(q, cache, tuning=tuning)


def test_residual_length_not_a_power_of_two(rng):
    """R = 96: chunks of lcm(512, 96) = 1536 tokens; the key tail [Qk - R, Qk) inside one."""
    q, cache = _case(
        rng, k_bits=4, v_bits=4, D=64, n_rep=2, dtype=jnp.bfloat16, prompts=[3000, 1536, 97],
        steps=0, max_len=3100, R=96,
    )  # fmt: skip
    _check(q, cache, tuning=TpuTuning(block_tokens=1536, chunk_tokens=512))


def test_random_layout_state(rng):
    """Random codes, scales (some zero) and zero points written straight into the layout."""
    cache = random_layout_cache(
        rng, capacity=1024, residual_length=128, lengths=[1024, 100, 700], zero_value_scales=7
    )
    q = jnp.asarray(rng.normal(size=(3, 6, 64)), jnp.bfloat16)
    _check(q, cache)


def test_dispatch(rng, monkeypatch):
    """impl="pallas_tpu" runs the kernel (interpret=True off a TPU, else an error naming the
    backend); "auto" runs it on a TPU backend where it supports the configuration, else the
    reference; what the kernel does not support is an error naming it."""
    from kivi_jax.pallas_kernels.decode_attention import tpu

    q, cache = _case(
        rng, k_bits=2, v_bits=2, D=64, n_rep=2, dtype=jnp.bfloat16, prompts=[100, 40],
        steps=0, max_len=128,
    )  # fmt: skip
    cfg8 = kivi_jax.KiviConfig(k_bits=8, v_bits=8, group_size=32, residual_length=64)
    c8 = kivi_jax.init_cache(cfg8, batch=2, max_len=128, num_kv_heads=2, head_dim=64)
    full = kivi_jax.init_cache(None, batch=2, max_len=128, num_kv_heads=2, head_dim=64)
    with pytest.raises(NotImplementedError, match=r"pallas_tpu.*KiviCache"):
        kivi_jax.decode_attention(q, full, impl="pallas_tpu", interpret=True)
    with pytest.raises(NotImplementedError, match="k_bits=8"):
        kivi_jax.decode_attention(q, c8, impl="pallas_tpu", interpret=True)
    assert jax.default_backend() == "cpu"
    with pytest.raises(NotImplementedError, match=r"runs on a TPU.*backend here: cpu"):
        kivi_jax.decode_attention(q, cache, impl="pallas_tpu")
    ref = kivi_jax.decode_attention(q, cache, impl="reference")
    np.testing.assert_array_equal(kivi_jax.decode_attention(q, cache), ref)  # auto on the CPU

    calls = []
    kernel = lambda q, cache, interpret: calls.append(interpret) or jnp.zeros_like(q)
    monkeypatch.setattr(tpu, "decode_attention_pallas_tpu", kernel)
    kivi_jax.decode_attention(q, cache, impl="pallas_tpu", interpret=True)
    assert calls == [True]
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert not kivi_jax.decode_attention(q, cache).any() and calls == [True, False]  # auto
    kivi_jax.decode_attention(q, cache, impl="pallas_tpu")
    assert calls == [True, False, False]
    np.testing.assert_array_equal(kivi_jax.decode_attention(q, c8), q * 0)  # auto: reference
    assert len(calls) == 3


def _lower_for_tpu(*, k_bits, v_bits, D, n_rep, dtype, C, G, R):
    """The kernel's step lowered for TPU on the CPU (the Mosaic module inside a custom call)."""
    B, H = 2, 2
    kpb, vpb, sd = 8 // k_bits, 8 // v_bits, jax.ShapeDtypeStruct
    args = [sd((B, H * n_rep, D), dtype), sd((B, H, C // kpb, D), jnp.uint8),
            sd((B, H, C // G, D), dtype), sd((B, H, C // G, D), dtype),
            sd((B, H, C, D // vpb), jnp.uint8), sd((B, H, C, D // G), dtype),
            sd((B, H, C, D // G), dtype), sd((B, H, R, D), dtype), sd((B, H, R, D), dtype),
            sd((B,), jnp.int32)]  # fmt: skip
    step = functools.partial(
        kivi_decode_attention_tpu, k_bits=k_bits, v_bits=v_bits, group_size=G,
        residual_length=R,
    )  # fmt: skip
    return jax.jit(step).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize(
    ("k_bits", "v_bits", "D", "n_rep", "dtype", "C", "G", "R"),
    [
        (2, 2, 128, 1, jnp.bfloat16, 32768, 32, 128),
        (4, 4, 128, 4, jnp.bfloat16, 32768, 32, 128),
        (2, 4, 64, 8, jnp.float16, 4096, 32, 128),
        (4, 2, 64, 3, jnp.float16, 4096, 32, 128),
        (2, 2, 128, 8, jnp.bfloat16, 416, 32, 128),  # one block past the capacity
        (4, 2, 128, 2, jnp.bfloat16, 5008, 16, 96),  # chunks of lcm(512, 96), a partial block
        (2, 4, 128, 4, jnp.bfloat16, 8192, 64, 128),  # tiling unit 1024
    ],
)
def test_lowers_for_tpu(k_bits, v_bits, D, n_rep, dtype, C, G, R):
    """Pallas's TPU lowering (block shapes against the (8, 128) tiling, every primitive's
    Mosaic rule, the Mosaic ops' verifiers) accepts the kernel: one Mosaic custom call."""
    hlo = _lower_for_tpu(k_bits=k_bits, v_bits=v_bits, D=D, n_rep=n_rep, dtype=dtype, C=C, G=G,
                         R=R)  # fmt: skip
    assert hlo.count("tpu_custom_call") == 1


@pytest.mark.parametrize(
    ("tuning", "G", "R", "expected"),
    [
        (TpuTuning(), 32, 128, (2048, 512)),
        (TpuTuning(block_tokens=1000, chunk_tokens=100), 32, 128, (1024, 512)),
        (TpuTuning(), 16, 96, (2304, 768)),  # unit 256, lcm with 96: 768
        (TpuTuning(), 64, 128, (2048, 1024)),
        (TpuTuning(block_tokens=4096, chunk_tokens=1024), 32, 128, (4096, 1024)),
    ],
)
def test_tiles_round_up_to_whole_tiles_and_the_residual(tuning, G, R, expected):
    """The chunk: the tuning's, rounded up to a multiple of R and of the tiling unit (lcm of
    32 kpb, 16 G and 128 tokens); the block: rounded up to a multiple of the chunk."""
    assert tiles(tuning, capacity=10**6, k_bits=2, group_size=G, residual_length=R) == expected
    assert tiling_unit(k_bits=2, group_size=32) == 512
    assert tiling_unit(k_bits=4, group_size=16) == 256


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"block_tokens": 0}, "block_tokens must be a positive int"),
        ({"chunk_tokens": 2.5}, "chunk_tokens must be a positive int"),
        ({"chunk_tokens": True}, "chunk_tokens must be a positive int"),
    ],
)
def test_bad_tunings_are_named(fields, match):
    with pytest.raises(ValueError, match=match):
        TpuTuning(**fields)


def test_unsupported_configs_are_named():
    ok = dict(k_bits=2, v_bits=4, group_size=32, head_dim=128, dtype=jnp.bfloat16)
    assert tpu_supported_config_reason(**ok) is None
    assert "k_bits=8" in tpu_supported_config_reason(**{**ok, "k_bits": 8})
    assert "head_dim=96" in tpu_supported_config_reason(**{**ok, "head_dim": 96})
    assert "float32" in tpu_supported_config_reason(**{**ok, "dtype": jnp.float32})
    assert "group_size=8" in tpu_supported_config_reason(**{**ok, "group_size": 8})


_SLOW_GRID = [
    pytest.param(
        k_bits, v_bits, D, n_rep, dtype, id=f"k{k_bits}v{v_bits}-D{D}-rep{n_rep}-{dtype.__name__}"
    )
    for (k_bits, v_bits), D, n_rep, dtype in itertools.product(
        [(2, 2), (4, 4), (2, 4), (4, 2)], [64, 128], [1, 3, 4, 8], [jnp.bfloat16, jnp.float16]
    )
]


@pytest.mark.slow
@pytest.mark.parametrize(("k_bits", "v_bits", "D", "n_rep", "dtype"), _SLOW_GRID)
def test_kernel_matches_reference_full_grid(rng, slow_only, k_bits, v_bits, D, n_rep, dtype):
    q, cache = _case(
        rng, k_bits=k_bits, v_bits=v_bits, D=D, n_rep=n_rep, dtype=dtype, H=3,
        prompts=[0, 1, 95, 1280, 2040, 1400], steps=7, max_len=2100,
    )  # fmt: skip
    _check(q, cache)


@pytest.mark.parametrize(("k_bits", "v_bits", "D", "n_rep", "dtype"), _SLOW_GRID)
@pytest.mark.parametrize("tuning", [TpuTuning(), SMALL], ids=["default", "small"])
def test_compiled_kernel_matches_reference_on_a_tpu(rng, tuning, k_bits, v_bits, D, n_rep, dtype):
    """On a TPU backend only: the Mosaic-compiled kernel over the full grid, with the default
    and the small blocks (the CPU runs it interpreted above)."""
    if jax.default_backend() != "tpu":
        pytest.skip("needs a TPU")
    q, cache = _case(
        rng, k_bits=k_bits, v_bits=v_bits, D=D, n_rep=n_rep, dtype=dtype, H=4,
        prompts=[0, 1, 95, 1280, 4000, 3001, 129, 8190], steps=9, max_len=8200,
    )  # fmt: skip
    _check(q, cache, attend=functools.partial(decode_attention_pallas_tpu, tuning=tuning))
