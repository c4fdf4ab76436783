"""The fused quantized-weight matmul (pallas_kernels/matmul/gpu.py), interpreted on the CPU and
compiled on a GPU (`-m gpu`: int4's PTX runs only there): x @ w for every stored format against
the product computed in float64 from the stored arrays, and what the kernel refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kivi_jax.pallas_kernels.matmul import gemv
from kivi_jax.pallas_kernels.matmul.gpu import (
    MAX_ROWS,
    MAX_SPLITS,
    Tiling,
    default_tiling,
    quantized_matmul,
    row_step,
    unsupported_reason,
)

from kivi_jax.weights import QuantizedWeight, dense, fused_unsupported_reason, quantize_matrix


def exact_product(x, w: QuantizedWeight) -> np.ndarray:
    """x @ ((q - z) * s) in float64 from the stored arrays (an independent reference)."""
    k, n = w.shape
    q = np.asarray(w.qvalue.astype(jnp.int32), np.float64).reshape(-1, w.group, n)
    if w.zero_point is not None:
        q = q - np.asarray(w.zero_point.astype(jnp.float32), np.float64)[:, None]
    wf = (q * np.asarray(w.scale.astype(jnp.float32), np.float64)[:, None]).reshape(k, n)
    return np.asarray(x.astype(jnp.float32), np.float64) @ wf


def gguf_like(rng, k, n, qdtype, *, zero: bool) -> QuantizedWeight:
    """Blocks of 32 rows as a GGUF stores them: Q8_0 (int8, no zero), Q4_0 / Q4_1 (int4)."""
    lo, hi = (-127, 128) if qdtype == jnp.int8 else (-8, 8)
    s = jnp.asarray(rng.uniform(0.001, 0.02, (k // 32, n)), jnp.bfloat16)
    return QuantizedWeight(
        qvalue=jnp.asarray(rng.integers(lo, hi, (k, n)), qdtype),
        scale=s,
        zero_point=jnp.asarray(rng.uniform(-9, 3, (k // 32, n)), jnp.bfloat16) if zero else None,
    )


CASES = {
    # name: (rows M, K, N, how the weight is made, tiling or None for the default)
    "int8 per channel, split K": (3, 256, 128, ("quantize", 8, None), Tiling(64, splits=2)),
    "int4 groups of 32, split K": (16, 256, 128, ("quantize", 4, 32), Tiling(64, splits=2)),
    "int4 one row": (1, 128, 64, ("quantize", 4, 64), None),
    "int4 per channel with zero": (5, 256, 64, ("quantize", 4, 256), None),
    "int8 per channel, K = 576": (2, 576, 64, ("quantize", 8, None), None),
    "Q8_0 blocks": (33, 128, 64, ("gguf", jnp.int8, False), None),
    "Q4_0 blocks": (64, 128, 128, ("gguf", jnp.int4, False), Tiling(128, splits=4)),
    "Q4_1 blocks": (7, 128, 64, ("gguf", jnp.int4, True), None),
}
X_DTYPES = {"int4 one row": jnp.float16}  # the other cases: bfloat16


needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.parametrize(
    "interpret",
    [True, pytest.param(False, id="gpu", marks=[pytest.mark.gpu, needs_gpu])],
)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_stored_weights_product(case, interpret):
    m, k, n, (how, a, b), tiling = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    if how == "quantize":
        w = quantize_matrix(jnp.asarray(rng.normal(0, 0.05, (k, n)), jnp.bfloat16), bits=a,
                            group_size=b or k)  # fmt: skip
    else:
        w = gguf_like(rng, k, n, a, zero=b)
    x = jnp.asarray(rng.normal(0, 1, (m, k)), X_DTYPES.get(case, jnp.bfloat16))
    got = quantized_matmul(x, w.qvalue, w.scale, w.zero_point, tiling=tiling, interpret=interpret)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    want = exact_product(x, w)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # The reference path (XLA's dequantize-then-dot, weights in bf16) agrees to bf16's rounding.
    ref = dense(x, w).astype(jnp.float32)
    assert np.abs(np.asarray(ref) - want).max() <= 2e-2 * np.abs(want).max()


def test_default_tiling_fills_the_gpu_and_divides_k():
    shapes = [(4096, 28672, 32), (14336, 4096, 32), (4096, 6144, 4096), (576, 1536, 576)]
    for k, n, group in shapes:
        t = default_tiling(k, n, group)
        step = row_step(k, group, t.block_k)
        assert n % t.block_n == 0 and k % (t.splits * step) == 0
        more = 2 * t.splits * step  # rows per split were K split twice as often
        enough = (n // t.block_n) * t.splits >= 4 * 132 or t.splits == MAX_SPLITS
        assert enough or k % more or k // more < 4
    # The sweep's best on the H100 (benchmarks/results/matmul.md): Llama-3-8B's w_down, int4 g128.
    assert default_tiling(14336, 4096, 128) == Tiling(block_n=128, splits=8)


@pytest.mark.parametrize(
    "m, k, n, group, qdtype, xdtype, says",
    [
        (MAX_ROWS + 1, 128, 64, 32, jnp.int8, jnp.bfloat16, "rows"),
        (4, 128, 64, 32, jnp.int8, jnp.float32, "bfloat16 or float16"),
        (4, 576, 64, 96, jnp.int4, jnp.bfloat16, "groups of 96"),
        (4, 1024, 64, 512, jnp.int4, jnp.bfloat16, "groups of 512"),
        (4, 128, 96, 32, jnp.int4, jnp.bfloat16, "multiple of 64"),
        (4, 128, 64, 32, jnp.uint8, jnp.bfloat16, "int8 or int4"),
    ],
)
def test_what_the_kernel_refuses(m, k, n, group, qdtype, xdtype, says):
    reason = unsupported_reason(m, k, n, group, qdtype, xdtype)
    assert reason is not None and says in reason
    w = QuantizedWeight(
        qvalue=jnp.zeros((k, n), qdtype), scale=jnp.ones((k // group, n), jnp.bfloat16)
    )
    with pytest.raises(ValueError, match="quantized_matmul"):
        quantized_matmul(jnp.zeros((m, k), xdtype), w.qvalue, w.scale, interpret=True)


def test_dense_runs_the_reference_off_the_gpu():
    w = quantize_matrix(jnp.ones((128, 64), jnp.bfloat16), bits=4, group_size=32)
    reason = fused_unsupported_reason(jnp.ones((2, 1, 128), jnp.bfloat16), w)
    assert reason is None if jax.default_backend() == "gpu" else "needs a GPU" in reason


# The small-M kernel (pallas_kernels/matmul/gemv.py): no tensor cores, codes as subnormals.
TWO_WARPS = gemv.Tiling(4, num_warps=2, splits=2)
GEMV_CASES = {
    # name: (rows M, K, N, how the weight is made, tiling or None for the default)
    "int4 groups of 32, split K, 2 warps": (1, 256, 256, ("quantize", 4, 32), TWO_WARPS),
    "int4 groups of 128, two rows": (2, 512, 512, ("quantize", 4, 128), None),
    "int4 per channel with zero": (1, 256, 256, ("quantize", 4, 256), None),
    "int4 groups of 16, float16 x": (2, 128, 256, ("quantize", 4, 16), None),
    "int8 per channel, K = 576": (2, 576, 128, ("quantize", 8, None), None),
    "Q8_0 blocks": (1, 128, 256, ("gguf", jnp.int8, False), gemv.Tiling(8, num_warps=2)),
    "Q4_0 blocks": (2, 128, 256, ("gguf", jnp.int4, False), None),
    "Q4_1 blocks, float16": (1, 128, 1024, ("gguf", jnp.int4, True), None),
}
GEMV_DTYPES = {  # (x, scales) where not bfloat16
    "int4 groups of 16, float16 x": (jnp.float16, jnp.bfloat16),
    "Q4_1 blocks, float16": (jnp.float16, jnp.float16),
}


def gemv_case(case):
    m, k, n, (how, a, b), tiling = GEMV_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    xdtype, dtype = GEMV_DTYPES.get(case, (jnp.bfloat16, jnp.bfloat16))
    if how == "quantize":
        w = quantize_matrix(jnp.asarray(rng.normal(0, 0.05, (k, n)), dtype), bits=a,
                            group_size=b or k)  # fmt: skip
    else:
        w = gguf_like(rng, k, n, a, zero=b)
        w = jax.tree.map(lambda v: v.astype(dtype) if v.dtype == jnp.bfloat16 else v, w)
    x = jnp.asarray(rng.normal(0, 1, (m, k)), xdtype)
    return x, w, tiling


@pytest.mark.parametrize(
    "interpret",
    [True, pytest.param(False, id="gpu", marks=[pytest.mark.gpu, needs_gpu])],
)
@pytest.mark.parametrize("case", list(GEMV_CASES))
def test_gemv_matches_the_stored_weights_product(case, interpret):
    x, w, tiling = gemv_case(case)
    got = gemv.quantized_gemv(x, w.qvalue, w.scale, w.zero_point, tiling=tiling,
                              interpret=interpret)  # fmt: skip
    assert got.shape == (x.shape[0], w.shape[1]) and got.dtype == jnp.float32
    want = exact_product(x, w)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_gemv_fields_read_as_float32_are_the_codes_times_a_power_of_two():
    # What the kernel's PTX computes per field, ((word >> shift) & mask) ^ top bit, read as a
    # float32 (numpy keeps subnormals): (q + o) * 2^(pos - 149) for every byte value at every
    # position of the word, q the signed code and o = 2^(bits - 1).
    # E.g. int4, byte 0 = 0x9F: low nibble 0xF (q = -1) -> bits 0x7 -> 7 * 2^-149 = (-1 + 8)
    # * 2^(0 - 149); high nibble 0x9 (q = -7) -> 0x10 -> 16 * 2^-149 = (-7 + 8) * 2^(4 - 149).
    values = np.arange(256, dtype=np.uint32)
    signed = values.astype(np.uint8).view(np.int8).astype(np.int64)
    low_nibble = ((values & 15) ^ 8).astype(np.int64) - 8
    for bits, fields in gemv.FIELDS.items():
        codes = [low_nibble, signed >> 4] if bits == 4 else [signed]
        for byte, per_slot in enumerate(fields):
            word = values << (8 * byte) | np.uint32(0x5A5A5A5A) & ~np.uint32(0xFF << (8 * byte))
            for (shift, mask), q in zip(per_slot, codes, strict=True):
                got = ((word >> shift) & mask) ^ gemv.field_sign(mask)
                got = got.astype(np.uint32).view(np.float32).astype(np.float64)
                want = (q + 2 ** (bits - 1)) * 2.0 ** (gemv.field_position(mask) - 149)
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "m, k, n, group, qdtype, xdtype, sdtype, says",
    [
        (gemv.MAX_ROWS + 1, 128, 256, 32, jnp.int4, jnp.bfloat16, jnp.bfloat16, "rows"),
        (1, 128, 256, 32, jnp.int4, jnp.float32, jnp.bfloat16, "bfloat16 or float16"),
        (1, 128, 256, 32, jnp.int4, jnp.bfloat16, jnp.float32, "scales"),
        (1, 128, 192, 32, jnp.int4, jnp.bfloat16, jnp.bfloat16, "128-byte"),
        (1, 576, 256, 96, jnp.int4, jnp.bfloat16, jnp.bfloat16, "groups of 96"),
        (1, 132, 256, 132, jnp.int8, jnp.bfloat16, jnp.bfloat16, "multiple of 8"),
    ],
)
def test_what_the_gemv_refuses(m, k, n, group, qdtype, xdtype, sdtype, says):
    reason = gemv.unsupported_reason(m, k, n, group, qdtype, xdtype, sdtype)
    assert reason is not None and says in reason
    with pytest.raises(ValueError, match="quantized_gemv"):
        gemv.quantized_gemv(
            jnp.zeros((m, k), xdtype), jnp.zeros((k, n), qdtype),
            jnp.ones((k // group, n), sdtype), interpret=True,
        )  # fmt: skip


def test_gemv_default_tiling_fills_the_gpu_and_divides_k():
    # Llama-3-8B's layers (K, N's bytes, group, bits): int4 in groups of 128 and int8 per
    # channel; every tiling fits, gives 4 warps an SM, and its float32 partial sums (8 bytes a
    # split and column, written and read) stay within an eighth of the weight's bytes.
    layers = [(4096, 14336, 128, 4), (14336, 2048, 128, 4), (4096, 3072, 128, 4),
              (4096, 2048, 128, 4), (4096, 28672, 4096, 8), (14336, 4096, 14336, 8)]  # fmt: skip
    for k, n_bytes, group, bits in layers:
        t = gemv.default_tiling(k, n_bytes, group, bits=bits)
        assert gemv.tiling_unsupported_reason(t, k, n_bytes, group) is None
        assert (n_bytes // t.block_bytes()) * t.splits * t.num_warps >= 4 * 132
        assert 8 * t.splits * (n_bytes * 8 // bits) <= k * n_bytes / 8
    # w_gate_up: 8 splits of 4 runs of one group; w_o: 16 bytes a thread would need 64 splits
    # (partial sums a quarter of the weight), so 8 bytes and 32.
    assert gemv.default_tiling(4096, 14336, 128) == gemv.Tiling(16, num_warps=4, splits=8)
    assert gemv.default_tiling(4096, 2048, 128) == gemv.Tiling(8, num_warps=4, splits=32)


def test_dense_takes_the_small_m_kernel_for_one_or_two_rows(monkeypatch):
    # With the backend said to be a GPU and both kernels replaced by recorders: 1-2 rows go to
    # the small-M kernel, 3-64 to the tensor-core kernel, a shape neither takes (groups of 96)
    # to the reference with the reason.
    import kivi_jax.pallas_kernels.matmul.gpu as tensor_cores

    calls = []

    def recorder(name):
        def kernel(x, qvalue, scale, zero_point):
            calls.append((name, x.shape[0]))
            return jnp.zeros((x.shape[0], qvalue.shape[1]), jnp.float32)

        return kernel

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gemv, "quantized_gemv", recorder("gemv"))
    monkeypatch.setattr(tensor_cores, "quantized_matmul", recorder("tensor cores"))
    w = quantize_matrix(jnp.ones((256, 256), jnp.bfloat16), bits=4, group_size=32)
    for shape in [(1, 1, 256), (2, 256), (3, 256), (64, 256)]:
        assert dense(jnp.ones(shape, jnp.bfloat16), w).shape == (*shape[:-1], 256)
    assert calls == [("gemv", 1), ("gemv", 2), ("tensor cores", 3), ("tensor cores", 64)]
    w96 = quantize_matrix(jnp.ones((576, 256), jnp.bfloat16), bits=4, group_size=128)
    assert "groups of 96" in fused_unsupported_reason(jnp.ones((1, 576), jnp.bfloat16), w96)
