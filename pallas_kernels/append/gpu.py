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
Rows with count 0 (inactive or full) write nothing. 2/4-bit codes, power-of-two head_dim, G
and R (`kivi_jax.cache._append_kernel_supports`).

A mixed state (kivi_jax.cache, module doc; kivi2-mix) runs `_mixed_append_kernel`: the same
writes, the new token also written to its sink slot when t < S (slot t of the extras, the
array that holds the sinks and then the heavy slots), the first key group's sinks
read as token S, and each completed group's F fine channels (`quantization.widest_channels`,
the same comparisons as the XLA append) quantized with 2b bits: the high b bits in k_codes,
the low ones in fine_codes, the channels in fine_channels. It hands out the key and value of
token t - R from the rings; XLA scores that token (ERROR) and `heavy_merge_kernel` merges it
into the heavy slots in place (`kivi_jax.cache._merge_one_heavy` is its reference): the
heavy slots are read whole and then written (one warp, so that every read of the next slot
comes before any write), where XLA's select over shifted slots cannot update them in place
and copies them back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kivi_jax.quantization import codes_of, is_finite, scale_and_zero, widest_channels


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


def _value_leaves(t, n, slot, vr_in, vc_ref, vs_ref, vz_ref, *, v_bits: int, residual_length: int,
                  dtype):  # fmt: skip
    """Token t - R leaves the value window: its slot (read before the new value takes it)
    quantized per token into row t - R."""
    R = residual_length

    @pl.when((n > 0) & (t >= R))
    def _value_leaves():
        x = vr_in[slot].astype(jnp.float32)  # [D // G, G // vpb, vpb]
        codes, scale, zero = _quantize(x, (2, 1), v_bits, dtype)
        vc_ref[t - R] = _pack(codes, v_bits, axis=2)  # [D // G, G // vpb]
        vs_ref[t - R] = scale[:, 0, 0]
        vz_ref[t - R] = zero[:, 0, 0]


def _key_group(g0, kr_in, k_ref, *, k_bits: int, group_size: int, residual_length: int):
    """The keys of the group of tokens [g0, g0 + G) that the new token completes (G - 1 from
    the ring, the new one last), float32 [G // kpb, kpb, D], and each one's index in the group
    (same shape)."""
    G, R, kpb = group_size, residual_length, 8 // k_bits
    w = kr_in[pl.ds((g0 % R) // kpb, G // kpb)].astype(jnp.float32)  # [G//kpb, kpb, D]
    rows = jax.lax.broadcasted_iota(jnp.int32, w.shape, 0)
    subs = jax.lax.broadcasted_iota(jnp.int32, w.shape, 1)
    last = (rows == G // kpb - 1) & (subs == kpb - 1)
    w = jnp.where(last, k_ref[...].astype(jnp.float32)[None, None, :], w)
    return w, rows * kpb + subs


def _rings_take_the_token(n, slot, k_ref, v_ref, kr_ref, vr_ref, *, k_bits: int):
    kpb = 8 // k_bits

    @pl.when(n > 0)
    def _rings_take_the_token():
        kr_ref[slot // kpb, slot % kpb] = k_ref[...]
        vr_ref[slot] = v_ref[...]


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
    _value_leaves(t, n, slot, vr_in, vc_ref, vs_ref, vz_ref, v_bits=v_bits, residual_length=R,
                  dtype=dtype)  # fmt: skip

    @pl.when((n > 0) & ((t + 1) % G == 0))
    def _key_group_completes():  # tokens [t + 1 - G, t], the last one new
        g0 = t + 1 - G
        w, _ = _key_group(g0, kr_in, k_ref, k_bits=k_bits, group_size=G, residual_length=R)
        codes, scale, zero = _quantize(w, (1, 0), k_bits, dtype)
        kc_ref[pl.ds(g0 // kpb, G // kpb)] = _pack(codes, k_bits, axis=1)  # [G // kpb, D]
        ks_ref[g0 // G] = scale[0, 0]
        kz_ref[g0 // G] = zero[0, 0]

    _rings_take_the_token(n, slot, k_ref, v_ref, kr_ref, vr_ref, k_bits=k_bits)


def _mixed_append_kernel(
    lengths_ref, counts_ref, k_ref, v_ref,  # as _append_kernel's
    kc_in, ks_in, kz_in, vc_in, vs_in, vz_in, kr_in, vr_in, sk_in, sv_in, fc_in, fch_in,
    kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, kr_ref, vr_ref,
    sk_ref,  # [S + N, D] the extras' keys: the sinks, then the heavy slots (not written here)
    sv_ref,  # [S + N, D] the extras' values
    fc_ref,  # uint8 [C // kpb, F] the fine channels' low codes
    fch_ref,  # uint8 [C // G, F] each key group's fine channels
    kl_ref,  # [D] out: the key of token t - R (the token leaving the window), from its slot
    vl_ref,  # [D // G, G // vpb, vpb] out: its value
    *, k_bits: int, v_bits: int, group_size: int, residual_length: int, sinks: int,
    fine_channels: int,
):  # fmt: skip
    """_append_kernel with a mixed state's sinks and fine key channels (kivi_jax.cache, module
    doc); the heavy tokens are merged outside, from the leaving token's key and value."""
    del kc_in, ks_in, kz_in, vc_in, vs_in, vz_in, sk_in, sv_in, fc_in, fch_in  # written only
    G, R, S, F = group_size, residual_length, sinks, fine_channels
    kpb = 8 // k_bits
    t, n = lengths_ref[...], counts_ref[...]
    slot = t % R
    dtype = ks_ref.dtype
    kl_ref[...] = kr_in[slot // kpb, slot % kpb]  # before the new token takes the slot
    vl_ref[...] = vr_in[slot]
    _value_leaves(t, n, slot, vr_in, vc_ref, vs_ref, vz_ref, v_bits=v_bits, residual_length=R,
                  dtype=dtype)  # fmt: skip

    @pl.when((n > 0) & ((t + 1) % G == 0))
    def _key_group_completes():
        g0 = t + 1 - G
        w, j = _key_group(g0, kr_in, k_ref, k_bits=k_bits, group_size=G, residual_length=R)
        # The first group's sinks read as token S (its range is over [S, G)).
        at_s = jnp.max(jnp.max(jnp.where(j == S, w, -jnp.inf), axis=0, keepdims=True),
                       axis=1, keepdims=True)  # fmt: skip
        w = jnp.where((g0 == 0) & (j < S), at_s, w)
        codes, scale, zero = _quantize(w, (1, 0), k_bits, dtype)
        fine, fine_scale, _ = _quantize(w, (1, 0), 2 * k_bits, dtype)
        lo_w = jnp.min(jnp.min(w, axis=0, keepdims=True), axis=1, keepdims=True)
        hi_w = jnp.max(jnp.max(w, axis=0, keepdims=True), axis=1, keepdims=True)
        D = w.shape[2]
        is_fine, channels = widest_channels((hi_w - lo_w).reshape(D), F)  # [D], [F]
        codes = jnp.where(is_fine[None, None, :], fine >> k_bits, codes)
        scale = jnp.where(is_fine[None, None, :], fine_scale * (1 << k_bits), scale)
        kc_ref[pl.ds(g0 // kpb, G // kpb)] = _pack(codes, k_bits, axis=1)  # [G // kpb, D]
        ks_ref[g0 // G] = scale[0, 0]
        kz_ref[g0 // G] = zero[0, 0]
        # The low codes at the fine channels, [G, D] x [D, F] (one term each: exact).
        lo = (fine & ((1 << k_bits) - 1)).astype(jnp.float32).reshape(G, D)
        pick = channels[:, None] == jax.lax.broadcasted_iota(jnp.int32, (F, D), 1)
        lo_f = jnp.dot(lo, pick.astype(jnp.float32).T)  # [G, F]
        lo_f = lo_f.astype(jnp.uint8).reshape(G // kpb, kpb, F)
        fc_ref[pl.ds(g0 // kpb, G // kpb)] = _pack(lo_f, k_bits, axis=1)  # [G // kpb, F]
        fch_ref[g0 // G] = channels.astype(jnp.uint8)

    @pl.when((n > 0) & (t < S))
    def _a_sink_arrives():
        sk_ref[t] = k_ref[...]
        sv_ref[t] = v_ref[...].reshape(sv_ref.shape[1])

    _rings_take_the_token(n, slot, k_ref, v_ref, kr_ref, vr_ref, k_bits=k_bits)


@functools.partial(
    jax.jit,
    static_argnames=("k_bits", "v_bits", "group_size", "residual_length", "sinks", "interpret"),
)
def append_kernel(
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual, v_residual,
    lengths, counts, k, v, side=None,
    *, k_bits: int, v_bits: int, group_size: int, residual_length: int, sinks: int = 0,
    interpret: bool = False,
):  # fmt: skip
    """The kernel over one layer's arrays (kivi_jax.cache's layout); k, v [B, H, D] in the
    cache dtype, counts [B] in {0, 1} (tokens that fit). Returns the 8 arrays, updated.

    side: None, or a mixed state's (extra_k, extra_v, fine_codes, fine_channels) (extras
    [B, H, S + N, D], S = `sinks` sinks first; F fine key channels): then the 12 arrays,
    updated (the extras' sink slots), and the key and value of each row's token
    t - R (t = lengths[b]) read from the rings before the new token takes its slot, [B, H, D]
    (what a row's slot held where no token leaves)."""
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
    config = dict(k_bits=k_bits, v_bits=v_bits, group_size=G, residual_length=R)
    in_specs = [
        pl.BlockSpec((None,), row),
        pl.BlockSpec((None,), row),
        full(D),
        full(D // G, G // vpb, vpb),
    ]
    inputs = (lengths, counts, k, v.reshape(B, H, D // G, G // vpb, vpb))
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    if side is None:
        out = pl.pallas_call(
            functools.partial(_append_kernel, **config),
            grid=(B, H),
            in_specs=[*in_specs, *state_specs],
            out_specs=state_specs,
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in views],
            input_output_aliases={4 + i: i for i in range(8)},
            compiler_params=params,
            interpret=interpret,
            name="kivi_append",
        )(*inputs, *views)
        return [o.reshape(x.shape) for o, x in zip(out, state, strict=True)]
    E, F = side[0].shape[2], side[2].shape[3]  # extra_k [B, H, S + N, D], fine_codes [.., F]
    side_specs = [full(E, D), full(E, D), full(C // kpb, F), full(C // G, F)]
    leaving_specs = [full(D), full(D // G, G // vpb, vpb)]
    leaving = [jax.ShapeDtypeStruct((B, H, D), k_residual.dtype),
               jax.ShapeDtypeStruct((B, H, D // G, G // vpb, vpb), v_residual.dtype)]  # fmt: skip
    out = pl.pallas_call(
        functools.partial(_mixed_append_kernel, **config, sinks=sinks, fine_channels=F),
        grid=(B, H),
        in_specs=[*in_specs, *state_specs, *side_specs],
        out_specs=[*state_specs, *side_specs, *leaving_specs],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*views, *side)] + leaving,
        input_output_aliases={4 + i: i for i in range(12)},
        compiler_params=params,
        interpret=interpret,
        name="kivi_append_mixed",
    )(*inputs, *views, *side)
    arrays = [o.reshape(x.shape) for o, x in zip(out[:12], (*state, *side), strict=True)]
    return [*arrays, out[12], out[13].reshape(B, H, D)]


def _heavy_merge_kernel(
    valid_ref,  # [] int32: 1 where the row's leaving token is a candidate
    pos_ref,  # [] int32: its position (above every slot's)
    score_ref,  # [] float32: its score (a NaN already taken as +inf)
    k_ref,  # [D] its key
    v_ref,  # [D] its value
    hk_in, hv_in, hp_in, hs_in,  # the heavy slots (aliased)
    hk_ref,  # [S + N, D] the extras' keys: the sinks, then the heavy slots' keys
    hv_ref,  # [S + N, D] the extras' values
    hp_ref,  # int32 [N] positions, ascending, -1 for an empty slot (at the end)
    hs_ref,  # float32 [N] scores, -inf for an empty slot
):  # fmt: skip
    del hk_in, hv_in, hp_in, hs_in  # read and written through the outputs
    N = hp_ref.shape[0]
    S = hk_ref.shape[0] - N
    hp, hs = hp_ref[...], hs_ref[...]
    i = jax.lax.broadcasted_iota(jnp.int32, (N,), 0)
    held = hp >= 0
    count = jnp.sum(held.astype(jnp.int32))
    worst = jnp.min(jnp.where(held, hs, jnp.inf))
    last_worst = jnp.max(jnp.where(held & (hs == worst), i, -1))
    full = count == N
    enters = (valid_ref[...] > 0) & (jnp.logical_not(full) | (score_ref[...] > worst))
    write_at = jnp.where(full, N - 1, count)
    # full: the slots from the worst on take the next slot's entry, the candidate the last
    moves = full & (i >= last_worst)
    takes = i == write_at
    after = jnp.minimum(i + 1, N - 1)  # the next slot

    @pl.when(enters)
    def _merge():  # each array read whole, then written (one warp: every read before a write)
        for ref, cand in ((hp_ref, pos_ref[...]), (hs_ref, score_ref[...])):
            x, x_next = ref[...], ref[after]  # [N]
            ref[...] = jnp.where(takes, cand, jnp.where(moves, x_next, x))
        for ref, cand in ((hk_ref, k_ref[...]), (hv_ref, v_ref[...])):
            x, x_next = ref[pl.ds(S, N)], ref[S + after]  # [N, D]
            ref[pl.ds(S, N)] = jnp.where(
                takes[:, None], cand[None, :], jnp.where(moves[:, None], x_next, x)
            )


@functools.partial(jax.jit, static_argnames=("interpret",))
def heavy_merge_kernel(
    extra_k, extra_v, heavy_pos, heavy_score, valid, pos, score, k, v, *, interpret: bool = False
):  # fmt: skip
    """One candidate per row merged into a mixed state's heavy slots, in place
    (`kivi_jax.cache._merge_one_heavy` is the reference): extra_k, extra_v [B, H, S + N, D]
    (the extras: S sinks, then the N heavy slots), heavy_pos int32 and heavy_score float32
    [B, H, N]; valid int32 [B], pos int32 [B], score float32 [B, H] (NaN taken as +inf), k, v
    [B, H, D] in the slots' dtype. Returns the four arrays, updated (the sinks as they were)."""
    B, H, E, D = extra_k.shape
    N = heavy_pos.shape[2]
    row = pl.BlockSpec((None,), lambda b, h: (b,))
    per_head = lambda *block: pl.BlockSpec(
        (None, None, *block), lambda b, h: (b, h) + (0,) * len(block)
    )
    slots = [per_head(E, D), per_head(E, D), per_head(N), per_head(N)]
    heavy = (extra_k, extra_v, heavy_pos, heavy_score)
    return pl.pallas_call(
        _heavy_merge_kernel,
        grid=(B, H),
        in_specs=[row, row, per_head(), per_head(D), per_head(D), *slots],
        out_specs=slots,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in heavy],
        input_output_aliases={5 + j: j for j in range(4)},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="kivi_heavy_merge",
    )(valid, pos, score, k, v, *heavy)
