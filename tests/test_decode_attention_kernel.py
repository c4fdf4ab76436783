"""The fused GPU decode-attention kernel against a plain reference on fresh random KIVI states.

CPU CI runs the kernel in Pallas interpret mode on small shapes; `pytest -m gpu` runs the
compiled kernel on a CUDA GPU over the full grid.

Tolerance (STYLE.md, after flash-attention's tests): the kernel rounds its tensor-core operands
(query x key scale, keys, probabilities x value scale, values) to the input dtype and accumulates
in float32, so it may be at most about twice as far from the float32 reference as a plain
implementation that rounds the same operands to the same dtype, plus a few units of roundoff
of the output's scale. Both references see the same dequantized state, so quantization error
never enters the comparison.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kivi_jax.pallas_kernels.decode_attention import (
    GpuTuning,
    kivi_decode_attention_gpu,
    supported_config_reason,
)

G = 32


def _random_state(rng, *, B, H, n_rep, D, C, R, k_bits, v_bits, lengths, dtype):
    """A KIVI state with random codes, scales and zero points in the documented layout."""
    kpb, vpb = 8 // k_bits, 8 // v_bits

    def u8(shape):
        return jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8))

    def f(shape, lo, hi):
        return jnp.asarray(rng.uniform(lo, hi, shape).astype(np.float32)).astype(dtype)

    k_scale = f((B, H, C // G, D), 0.0, 0.3)
    k_scale = k_scale.at[:, :, 0, :4].set(0)  # constant groups (scale 0) must work too
    state = dict(
        k_codes=u8((B, H, C // kpb, D)),
        k_scale=k_scale,
        k_zero=f((B, H, C // G, D), -1.0, 1.0),
        v_codes=u8((B, H, C, D // vpb)),
        v_scale=f((B, H, C, D // G), 0.0, 0.3),
        v_zero=f((B, H, C, D // G), -1.0, 1.0),
        k_residual=f((B, H, R, D), -2.0, 2.0),
        v_residual=f((B, H, R, D), -2.0, 2.0),
        lengths=jnp.asarray(lengths, jnp.int32),
    )
    q = f((B, H * n_rep, D), -2.0, 2.0)
    return q, state


def _dequantized_kv(state, *, k_bits, v_bits, R):
    """Per sequence, the float32 keys and values of tokens [0, l) the attention must see."""
    B, H, C, _ = state["v_codes"].shape
    D = state["k_codes"].shape[-1]
    f32 = lambda x: np.asarray(x, np.float32)
    kc = np.asarray(state["k_codes"]).astype(np.int32)  # token t, channel d: byte t // kpb
    kcodes = np.stack([(kc >> (k_bits * j)) & ((1 << k_bits) - 1) for j in range(8 // k_bits)], 3)
    kcodes = kcodes.reshape(B, H, C, D)
    vc = np.asarray(state["v_codes"]).astype(np.int32)  # channel d of token t: byte d // vpb
    vcodes = np.stack([(vc >> (v_bits * j)) & ((1 << v_bits) - 1) for j in range(8 // v_bits)], 4)
    vcodes = vcodes.reshape(B, H, C, D)
    K = kcodes * np.repeat(f32(state["k_scale"]), G, 2) + np.repeat(f32(state["k_zero"]), G, 2)
    V = vcodes * np.repeat(f32(state["v_scale"]), G, 3) + np.repeat(f32(state["v_zero"]), G, 3)
    out = []
    for b in range(B):
        length = int(state["lengths"][b])
        qk, pv = length - length % R, max(length - R, 0)
        t = np.arange(length)
        k, v = K[b, :, :length].copy(), V[b, :, :length].copy()
        k[:, qk:] = f32(state["k_residual"])[b][:, t[qk:] % R]
        v[:, pv:] = f32(state["v_residual"])[b][:, t[pv:] % R]
        out.append((k, v))
    return out


def _attention_reference(q, kv, *, round_to=None):
    """softmax(q.K/sqrt(D)) @ V per sequence; round_to rounds the operands the kernel rounds."""
    rnd = (
        (lambda x: x)
        if round_to is None
        else (lambda x: np.asarray(jnp.asarray(x, round_to), np.float32))
    )
    q = np.asarray(q, np.float32)
    B, Hq, D = q.shape
    out = np.zeros((B, Hq, D), np.float32)
    for b, (k, v) in enumerate(kv):
        H = k.shape[0]
        n_rep = Hq // H
        if k.shape[1] == 0:
            continue
        for h in range(Hq):
            s = rnd(k[h // n_rep]) @ rnd(q[b, h] / np.sqrt(D))
            p = np.exp(s - s.max())
            out[b, h] = (rnd(p) @ rnd(v[h // n_rep])) / p.sum()
    return out


def _check(rng, *, B, H, n_rep, D, C, R, k_bits, v_bits, lengths, dtype, interpret, tuning=None):
    q, state = _random_state(
        rng, B=B, H=H, n_rep=n_rep, D=D, C=C, R=R, k_bits=k_bits, v_bits=v_bits,
        lengths=lengths, dtype=dtype,
    )  # fmt: skip
    out = kivi_decode_attention_gpu(
        q, **state, k_bits=k_bits, v_bits=v_bits, group_size=G, residual_length=R,
        tuning=tuning or GpuTuning(), interpret=interpret,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    kv = _dequantized_kv(state, k_bits=k_bits, v_bits=v_bits, R=R)
    ref = _attention_reference(q, kv)
    ref_lo = _attention_reference(q, kv, round_to=dtype)
    u = float(jnp.finfo(dtype).eps) / 2
    scale = (
        max(float(np.abs(v).max()) for _, v in kv if v.size) if any(v.size for _, v in kv) else 1
    )
    tol = 2 * np.abs(ref_lo - ref).max() + 4 * u * scale
    err = np.abs(out - ref)
    assert err.max() <= tol, f"max err {err.max():.3g} > tol {tol:.3g}"
    for b, length in enumerate(lengths):
        if length == 0:
            assert (out[b] == 0).all()


# Small CPU (interpret) grid: each case covers several axes at once (pairwise), ~3 s apiece.
# Lengths: 0, shorter than R, not a multiple of G or of the block, a multiple of R, a flush
# boundary (l % R == 0 with l > R), and long enough to use the fast path of several splits.
_CPU_CASES = [
    # k_bits, v_bits, D, n_rep, dtype
    (2, 2, 128, 4, jnp.bfloat16),
    (4, 4, 64, 1, jnp.float16),
    (2, 4, 64, 3, jnp.bfloat16),
    (4, 2, 128, 8, jnp.float16),
    (2, 2, 64, 1, jnp.float16),
    (4, 4, 128, 3, jnp.bfloat16),
]


@pytest.mark.parametrize(("k_bits", "v_bits", "D", "n_rep", "dtype"), _CPU_CASES)
def test_kernel_matches_reference_interpret(k_bits, v_bits, D, n_rep, dtype):
    rng = np.random.default_rng([k_bits, v_bits, D, n_rep])
    _check(
        rng, B=5, H=2, n_rep=n_rep, D=D, C=384, R=64, k_bits=k_bits, v_bits=v_bits,
        lengths=[0, 37, 355, 128, 193], dtype=dtype, interpret=True,
        tuning=GpuTuning(num_splits=3),
    )  # fmt: skip


def test_single_group_blocks_and_one_split_interpret():
    rng = np.random.default_rng(7)
    _check(
        rng, B=2, H=1, n_rep=2, D=64, C=256, R=32, k_bits=2, v_bits=2, lengths=[256, 97],
        dtype=jnp.bfloat16, interpret=True, tuning=GpuTuning(n_groups=1, num_splits=1),
    )  # fmt: skip


def test_unsupported_configs_are_named():
    assert supported_config_reason(k_bits=8, v_bits=2, group_size=32, head_dim=128,
                                   dtype=jnp.bfloat16) is not None  # fmt: skip
    assert "head_dim" in supported_config_reason(
        k_bits=2, v_bits=2, group_size=32, head_dim=96, dtype=jnp.bfloat16
    )
    assert "float32" in supported_config_reason(
        k_bits=2, v_bits=2, group_size=32, head_dim=128, dtype=jnp.float32
    )
    q = jnp.zeros((1, 1, 96), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="head_dim"):
        kivi_decode_attention_gpu(
            q, *[jnp.zeros((1, 1, 1, 1))] * 9, k_bits=2, v_bits=2, group_size=32,
            residual_length=128,
        )  # fmt: skip


_GPU_GRID = list(
    itertools.product(
        [(2, 2), (4, 4), (2, 4), (4, 2)],
        [64, 128],
        [1, 3, 4, 8],
        [jnp.bfloat16, jnp.float16],
    )
)


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "D", "n_rep", "dtype"), _GPU_GRID)
def test_kernel_matches_reference_gpu(bits, D, n_rep, dtype):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    k_bits, v_bits = bits
    rng = np.random.default_rng([k_bits, v_bits, D, n_rep, jnp.dtype(dtype).itemsize])
    _check(
        rng, B=6, H=4, n_rep=n_rep, D=D, C=2048, R=128, k_bits=k_bits, v_bits=v_bits,
        lengths=[0, 1, 100, 1280, 2047, 1411], dtype=dtype, interpret=False,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tuning",
    [
        GpuTuning(n_groups=1),
        GpuTuning(n_groups=4, num_warps=8),
        GpuTuning(k_mode="dequant", v_mode="dequant"),
        GpuTuning(v_mode="lazy"),
    ],
)
def test_kernel_tunings_gpu(tuning):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(11)
    _check(
        rng, B=3, H=8, n_rep=4, D=128, C=4096, R=128, k_bits=2, v_bits=2,
        lengths=[4096, 3001, 129], dtype=jnp.bfloat16, interpret=False, tuning=tuning,
    )  # fmt: skip


@pytest.mark.parametrize(
    "tuning",
    [
        GpuTuning(k_mode="dequant", v_mode="dequant", num_splits=2),
        GpuTuning(v_mode="lazy", n_groups=4, num_splits=2),
    ],
)
def test_kernel_variants_interpret(tuning):
    rng = np.random.default_rng(5)
    _check(
        rng, B=3, H=2, n_rep=3, D=64, C=384, R=64, k_bits=2, v_bits=4,
        lengths=[384, 0, 250], dtype=jnp.bfloat16, interpret=True, tuning=tuning,
    )  # fmt: skip
