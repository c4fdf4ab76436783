"""The lane-level PTX of the GPU kernels (`pallas_kernels/decode_attention/ptx.py`): each jnp
twin, which interpret mode runs, against its instruction's definition. The PTX itself runs in
the kernels' GPU tests."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from kivi_jax.pallas_kernels.decode_attention import ptx


def test_warp_mma_is_the_16x16_by_16x8_product(rng):
    # the fragments as the PTX ISA lays out m16n8k16 (row g = lane // 4, t = lane % 4)
    A = rng.normal(size=(16, 16)).astype(np.float16).astype(np.float32)
    B = rng.normal(size=(16, 8)).astype(np.float16).astype(np.float32)
    g, t = np.arange(32) // 4, np.arange(32) % 4
    pack = functools.partial(ptx.pack_f16x2, interpret=True)
    f = lambda M, r, k: (jnp.asarray(M[r, k]), jnp.asarray(M[r, k + 1]))
    a = [
        pack(*f(A, r, k))
        for r, k in [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]
    ]
    b = [pack(*f(B.T, g, k)) for k in (2 * t, 2 * t + 8)]
    c = [jnp.full((32,), 1.0)] * 4
    d = [np.asarray(x) for x in ptx.mma_m16n8k16(a, b, c, interpret=True)]
    want = A @ B + 1.0
    for x, (r, col) in zip(
        d, [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)], strict=True
    ):
        np.testing.assert_allclose(x, want[r, col], rtol=1e-6, atol=1e-5)


def test_prmt_picks_the_selected_bytes(rng):
    a, b = (jnp.asarray(rng.integers(-(2**31), 2**31, 32), jnp.int32) for _ in range(2))
    sel = jnp.asarray(rng.integers(0, 2**16, 32), jnp.int32)
    out = np.asarray(ptx.prmt(a, b, sel, interpret=True)).view(np.uint32)
    both = np.stack(
        [np.asarray(a).view(np.uint8).reshape(32, 4), np.asarray(b).view(np.uint8).reshape(32, 4)],
        1,
    ).reshape(32, 8)
    for lane in range(32):
        picks = [(int(sel[lane]) >> (4 * i)) & 7 for i in range(4)]
        assert out[lane] == int.from_bytes(bytes(both[lane, picks]), "little")


def test_prmt_takes_an_immediate_selector_as_a_per_lane_one(rng):
    a, b = (jnp.asarray(rng.integers(-(2**31), 2**31, 32), jnp.int32) for _ in range(2))
    for sel in (0x5140, 0x7362, 0x4342, 0x0123):
        lanes = jnp.full((32,), sel, jnp.int32)
        np.testing.assert_array_equal(
            np.asarray(ptx.prmt(a, b, sel, interpret=True)),
            np.asarray(ptx.prmt(a, b, lanes, interpret=True)),
        )


def test_exp2_ftz_is_exp2_with_results_below_the_smallest_normal_flushed():
    # as ex2.approx.ftz.f32 (the softmax weights of both value kernels): 2**x, but 0 below
    # 2**-126; the PTX itself runs in the value kernels' GPU tests. (XLA's CPU exp2 is itself
    # approximate near that edge: 4e-6 off at -125.9, 0 at -126.)
    x = jnp.asarray([0.0, -1.0, -20.5, -125.9, -126.5, -140.0, -1e30], jnp.float32)
    got = np.asarray(ptx.exp2_ftz(x, interpret=True))
    want = np.exp2(np.asarray(x, np.float64))
    want[want < 2.0**-126] = 0.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


def test_dp4a_is_the_byte_dot_product(rng):
    """The interpret-mode IDP.4A: c + sum of a's unsigned bytes times b's signed bytes."""
    a = rng.integers(0, 256, (1000, 4), dtype=np.uint8)
    b = rng.integers(-128, 128, (1000, 4), dtype=np.int8)
    c = rng.integers(-(2**20), 2**20, 1000, dtype=np.int32)
    out = ptx.dp4a(
        jnp.asarray(a.view(np.int32)[:, 0]),
        jnp.asarray(b.view(np.int32)[:, 0]),
        jnp.asarray(c),
        interpret=True,
    )
    expected = c + (a.astype(np.int64) * b.astype(np.int64)).sum(axis=1)
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("high", [False, True])
def test_dp2a_is_the_half_word_dot_product(rng, high):
    """The interpret-mode IDP.2A: c + a's two signed 16-bit halves times b's unsigned bytes
    0 and 1 (or, high, 2 and 3)."""
    a = rng.integers(-(2**15), 2**15, (1000, 2), dtype=np.int16)
    b = rng.integers(0, 256, (1000, 4), dtype=np.uint8)
    c = rng.integers(-(2**20), 2**20, 1000, dtype=np.int32)
    out = ptx.dp2a(
        jnp.asarray(a.view(np.int32)[:, 0]),
        jnp.asarray(b.view(np.int32)[:, 0]),
        jnp.asarray(c),
        high=high,
        interpret=True,
    )
    pair = b[:, 2:] if high else b[:, :2]
    expected = c + (a.astype(np.int64) * pair.astype(np.int64)).sum(axis=1)
    np.testing.assert_array_equal(np.asarray(out), expected)
