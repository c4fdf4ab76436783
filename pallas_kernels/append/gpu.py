"""A decode step's KIVI append as one kernel per layer (Pallas, Triton lowering).

The XLA append (`kivi_jax.cache._extend_kivi`, the reference) costs ~11 small kernels per
layer and step; this one program per (sequence, KV head) writes what the step writes, in
place (every array aliased to its input):

    the new key and value into the rings, at slot t % R (t = lengths[b], the new token);
    the value leaving the window (token t - R, read from the slot before it is overwritten),
      quantized per token: its codes, scales and zero points at row t - R;
    when the new token completes a key group (t + 1 a multiple of G), the group's G keys
      (G - 1 from the ring, the new one) quantized per channel: codes, scales, zero points.

The arithmetic is `kivi_jax.quantization.quantize`'s (its scale_and_zero and codes_of), so that
the state stays bit-identical to prefill's, non-finite groups included: min and max (exact),
scale = round_up((hi - lo) * (1 / levels)), codes = round((x - z) / s), a division, as XLA's
on a GPU (div.full). XLA on the CPU multiplies by 1 / s instead, and does so in this kernel's
interpreted body too, so interpreted it matches the CPU's XLA append.
Rows with count 0 (inactive or full) write nothing. Plain KIVI only (no mixed state), 2/4-bit
codes, power-of-two head_dim, G and R (`kivi_jax.cache._append_kernel_supports`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kivi_jax.quantization import codes_of, is_finite, scale_and_zero


def _round_half_even(y):
    """jnp.round of y >= 0 below 2**22 (Pallas lowers no `round` for Triton), exactly."""
    r = jnp.floor(y)
    d = y - r  # exact
    odd = r - 2 * jnp.floor(r * 0.5) == 1
    return jnp.where((d > 0.5) | ((d == 0.5) & odd), r + 1, r)


def _quantize(x, axes, bits, dtype):
    """codes (uint8), scale, zero (kept dims) of x (float32), one group over the two `axes`:
    `kivi_jax.quantization.quantize`'s arithmetic, non-finite groups included."""

    def reduce(f, y):
        return f(f(y, axis=axes[0], keepdims=True), axis=axes[1], keepdims=True)

    finite = reduce(jnp.min, jnp.where(is_finite(x), 1.0, 0.0)) > 0
    scale, zero = scale_and_zero(reduce(jnp.min, x), reduce(jnp.max, x), finite, bits, dtype)
    return codes_of(x, scale, zero, finite, bits, _round_half_even), scale, zero


def _pack(codes, bits: int, axis: int):
    """uint8 codes -> one byte per `8 // bits` along `axis` (its length), first in the LSBs."""
    n = codes.shape[axis]
    shape = [1] * codes.ndim
    shape[axis] = n
    shifts = (jax.lax.broadcasted_iota(jnp.uint32, tuple(shape), axis) * bits).astype(jnp.uint32)
    return jnp.sum(codes.astype(jnp.uint32) << shifts, axis=axis).astype(jnp.uint8)


def _append_kernel(
    lengths_ref,  # [] int32: tokens held before the step
    counts_ref,  # [] int32: 1 where the row takes the token
    k_ref,  # [D] new key
    v_ref,  # [D // G, G // vpb, vpb] new value
    kc_in, ks_in, kz_in, vc_in, vs_in, vz_in, kr_in, vr_in,  # the state (aliased)
    kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, kr_ref, vr_ref,
    *, k_bits: int, v_bits: int, group_size: int, residual_length: int,
):  # fmt: skip
    del kc_in, ks_in, kz_in, vc_in, vs_in, vz_in  # written only
    G, R = group_size, residual_length
    kpb = 8 // k_bits
    t, n = lengths_ref[...], counts_ref[...]
    slot = t % R
    dtype = ks_ref.dtype

    @pl.when((n > 0) & (t >= R))
    def _value_leaves():  # token t - R: its slot, before the new value takes it
        x = vr_in[slot].astype(jnp.float32)  # [D // G, G // vpb, vpb]
        codes, scale, zero = _quantize(x, (2, 1), v_bits, dtype)
        vc_ref[t - R] = _pack(codes, v_bits, axis=2)  # [D // G, G // vpb]
        vs_ref[t - R] = scale[:, 0, 0]
        vz_ref[t - R] = zero[:, 0, 0]

    @pl.when((n > 0) & ((t + 1) % G == 0))
    def _key_group_completes():  # tokens [t + 1 - G, t], the last one new
        g0 = t + 1 - G
        w = kr_in[pl.ds((g0 % R) // kpb, G // kpb)].astype(jnp.float32)  # [G//kpb, kpb, D]
        rows = jax.lax.broadcasted_iota(jnp.int32, w.shape, 0)
        subs = jax.lax.broadcasted_iota(jnp.int32, w.shape, 1)
        last = (rows == G // kpb - 1) & (subs == kpb - 1)
        w = jnp.where(last, k_ref[...].astype(jnp.float32)[None, None, :], w)
        codes, scale, zero = _quantize(w, (1, 0), k_bits, dtype)
        kc_ref[pl.ds(g0 // kpb, G // kpb)] = _pack(codes, k_bits, axis=1)  # [G // kpb, D]
        ks_ref[g0 // G] = scale[0, 0]
        kz_ref[g0 // G] = zero[0, 0]

    @pl.when(n > 0)
    def _rings_take_the_token():
        kr_ref[slot // kpb, slot % kpb] = k_ref[...]
        vr_ref[slot] = v_ref[...]


@functools.partial(
    jax.jit, static_argnames=("k_bits", "v_bits", "group_size", "residual_length", "interpret")
)
def append_kernel(
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual, v_residual,
    lengths, counts, k, v,
    *, k_bits: int, v_bits: int, group_size: int, residual_length: int, interpret: bool = False,
):  # fmt: skip
    """The kernel over one layer's arrays (kivi_jax.cache's layout); k, v [B, H, D] in the
    cache dtype, counts [B] in {0, 1} (tokens that fit). Returns the 8 arrays, updated."""
    state = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual, v_residual)
    B, H, C, _ = v_codes.shape
    D = k.shape[-1]
    G, R = group_size, residual_length
    kpb, vpb = 8 // k_bits, 8 // v_bits
    row = lambda b, h: (b,)
    full = lambda *block: pl.BlockSpec(
        (None, None, *block), lambda b, h: (b, h) + (0,) * len(block)
    )
    state_specs = [
        full(C // kpb, D),  # k_codes
        full(C // G, D),  # k_scale
        full(C // G, D),  # k_zero
        full(C, D // G, G // vpb),  # v_codes: a token's bytes by channel group
        full(C, D // G),  # v_scale
        full(C, D // G),  # v_zero
        full(R // kpb, kpb, D),  # k_residual: slots by key byte
        full(R, D // G, G // vpb, vpb),  # v_residual: a value by channel group and byte
    ]
    views = [
        k_codes,
        k_scale,
        k_zero,
        v_codes.reshape(B, H, C, D // G, G // vpb),
        v_scale,
        v_zero,
        k_residual.reshape(B, H, R // kpb, kpb, D),
        v_residual.reshape(B, H, R, D // G, G // vpb, vpb),
    ]
    out = pl.pallas_call(
        functools.partial(
            _append_kernel, k_bits=k_bits, v_bits=v_bits, group_size=G, residual_length=R
        ),
        grid=(B, H),
        in_specs=[
            pl.BlockSpec((None,), row),
            pl.BlockSpec((None,), row),
            full(D),
            full(D // G, G // vpb, vpb),
            *state_specs,
        ],
        out_specs=state_specs,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in views],
        input_output_aliases={4 + i: i for i in range(8)},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kivi_append",
    )(lengths, counts, k, v.reshape(B, H, D // G, G // vpb, vpb), *views)
    return [o.reshape(x.shape) for o, x in zip(out, state, strict=True)]
