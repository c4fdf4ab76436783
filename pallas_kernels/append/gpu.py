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

Over a page pool (kivi_jax.paged, plain KIVI) the quantized arrays are the pool's, one block
per KV head (written only, through the table), and the row's table places each write: the
leaving value's codes at its token's page, a completed key group's at the group's (a page holds
whole groups); a write whose page the table does not hold is dropped, as the XLA path drops
it. The rings stay the row's own.

A mixed state (kivi_jax.cache, module doc; kivi2-mix) runs `_mixed_append_kernel`: the same
writes, the new token also written to its sink slot when t < S (slot t of the extras, the
array that holds the sinks and then the heavy slots), the first key group's sinks
read as token S, and each completed group's F fine channels (`quantization.widest_channels`,
the same comparisons as the XLA append) quantized with 2b bits: the high b bits in k_codes,
the low ones in fine_codes, the channels in fine_channels. With heavy tokens (chosen by
ERROR) it also scores token t - R, whose key and value leave the rings (`_leaving_score`: its
key as the codes read it, its value as quantized in this step), and merges it into the heavy
slots in place (`_heavy_merge`; `kivi_jax.cache._merge_one_heavy` is the reference), before
the new token takes its ring slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kivi_jax.quantization import affine, codes_of, is_finite, scale_and_zero, widest_channels


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


def _quantize_value(v, v_bits: int, dtype):
    """codes, scale, zero of one token's value v [D // G, G // vpb, vpb], per token."""
    return _quantize(v.astype(jnp.float32), (2, 1), v_bits, dtype)


def _page(table_ref, ref, unit):
    """The page that the row's table [M] names for the row's entry `unit` of a pool array
    [Pp, per_page, ...], and whether the table holds one there (NO_PAGE lies past the pool)."""
    pages, per_page = ref.shape[:2]
    page = table_ref[jnp.maximum(unit, 0) // per_page]
    return page, page < pages


def _when(cond, table_ref, ref, unit):
    """pl.when(cond) over the row's own arrays (table_ref None); over a pool's, pl.when(cond
    and the table holds the page of the row's entry `unit` of `ref`): a write without its page
    is dropped."""
    return pl.when(cond if table_ref is None else cond & _page(table_ref, ref, unit)[1])


def _at(table_ref, ref, unit, n=None):
    """The index of the row's entry `unit` of a token-axis array (n entries from it with n): in
    the row's own array [entries, ...] (table_ref None), or in the pool's [Pp, per_page, ...]
    at the page the row's table names (page 0 where it names none: `_when` skips the write)."""
    if table_ref is None:
        return unit if n is None else pl.ds(unit, n)
    page, held = _page(table_ref, ref, unit)
    at = unit % ref.shape[1]
    return jnp.where(held, page, 0), at if n is None else pl.ds(at, n)


def _value_leaves(t, n, quantized, vc_ref, vs_ref, vz_ref, *, v_bits: int, residual_length: int,
                  table_ref=None):  # fmt: skip
    """Token t - R leaves the value window: its value (its ring slot, read before the new value
    takes it), quantized per token by `quantized()` (`_quantize_value`'s), into row t - R (of
    the row's arrays or of its page, `_at`)."""
    R = residual_length

    @_when((n > 0) & (t >= R), table_ref, vc_ref, t - R)
    def _value_leaves():
        codes, scale, zero = quantized()
        at = _at(table_ref, vc_ref, t - R)  # v_codes, v_scale, v_zero: a token an entry
        vc_ref[at] = _pack(codes, v_bits, axis=2)  # [D // G, G // vpb]
        vs_ref[at] = scale[:, 0, 0]
        vz_ref[at] = zero[:, 0, 0]


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
    *, k_bits: int, v_bits: int, group_size: int, residual_length: int, table_ref=None,
):  # fmt: skip
    """table_ref: None (the quantized refs are the row's) or the row's page table [M] (they
    are the pool's, `_at`)."""
    del kc_in, ks_in, kz_in, vc_in, vs_in, vz_in  # written only
    G, R = group_size, residual_length
    kpb = 8 // k_bits
    t, n = lengths_ref[...], counts_ref[...]
    slot = t % R
    dtype = ks_ref.dtype
    _value_leaves(t, n, lambda: _quantize_value(vr_in[slot], v_bits, dtype), vc_ref, vs_ref,
                  vz_ref, v_bits=v_bits, residual_length=R, table_ref=table_ref)  # fmt: skip

    @_when((n > 0) & ((t + 1) % G == 0), table_ref, ks_ref, (t + 1 - G) // G)
    def _key_group_completes():  # tokens [t + 1 - G, t], the last one new
        g0 = t + 1 - G
        w, _ = _key_group(g0, kr_in, k_ref, k_bits=k_bits, group_size=G, residual_length=R)
        codes, scale, zero = _quantize(w, (1, 0), k_bits, dtype)
        packed = _pack(codes, k_bits, axis=1)  # [G // kpb, D]
        kc_ref[_at(table_ref, kc_ref, g0 // kpb, G // kpb)] = packed  # a page holds whole groups
        ks_ref[_at(table_ref, ks_ref, g0 // G)] = scale[0, 0]
        kz_ref[_at(table_ref, kz_ref, g0 // G)] = zero[0, 0]

    _rings_take_the_token(n, slot, k_ref, v_ref, kr_ref, vr_ref, k_bits=k_bits)


def _ordered_sum(x):
    """Sum of x [n] (n a power of two) as `kivi_jax.quantization.ordered_sum` takes it: adjacent
    pairs added, level by level (the same rounding as the XLA append's score). Explicit adds of the
    pairs' halves (a split, in Triton): XLA would merge a chain of reductions into one and
    reorder it."""
    while x.shape[0] > 1:
        even, odd = jnp.unstack(x.reshape(x.shape[0] // 2, 2), axis=1)
        x = even + odd
    return x.reshape(())


def _leaving_score(p, k_leave, v_leave, v_codes, v_scale, v_zero, kc_in, ks_in, kz_in, fc_in,
                   fch_in, *, k_bits: int, group_size: int):  # fmt: skip
    """The ERROR score of token p, leaving the value window with key k_leave [D] and value
    v_leave [D // G, G // vpb, vpb] (float32), as `kivi_jax.cache._extend_kivi` scores it:
    ||k - k'||^2 + ||v - v'||^2, k' its key as the codes read it (its key group complete: p is
    R >= G tokens behind the new one), v' its value as quantized now (codes, scale, zero);
    a NaN taken as +inf."""
    b, G = k_bits, group_size
    kpb, mask = 8 // b, (1 << b) - 1
    D, F = k_leave.shape[0], fc_in.shape[1]
    shift = (p % kpb) * b
    code = (kc_in[p // kpb].astype(jnp.int32) >> shift) & mask  # [D]
    lo = (fc_in[p // kpb].astype(jnp.int32) >> shift) & mask  # [F]
    # its group's fine channels: code * 2^b + lo at (scale / 2^b) (`cache._fine_dequantize`)
    at = fch_in[p // G].astype(jnp.int32)[:, None] == jax.lax.broadcasted_iota(
        jnp.int32, (F, D), 1
    )  # [F, D]
    is_fine = jnp.sum(at.astype(jnp.int32), axis=0) > 0
    lo_full = jnp.sum(jnp.where(at, lo[:, None], 0), axis=0)
    scale = ks_in[p // G].astype(jnp.float32)
    full = jnp.where(is_fine, code * (1 << b) + lo_full, code).astype(jnp.float32)
    step = jnp.where(is_fine, scale / (1 << b), scale)
    k_hat = affine(full, step, kz_in[p // G].astype(jnp.float32))
    v_hat = affine(
        v_codes.astype(jnp.float32), v_scale.astype(jnp.float32), v_zero.astype(jnp.float32)
    )
    score = _ordered_sum((k_leave - k_hat) ** 2) + _ordered_sum(((v_leave - v_hat) ** 2).reshape(D))
    return jnp.where(score != score, jnp.inf, score)


def _heavy_merge(p, score, k_cand, v_cand, hp_in, hs_in, hk_in, hv_in, hp_ref, hs_ref, hk_ref,
                 hv_ref, *, sinks: int, leaving):  # fmt: skip
    """Token p (key and value k_cand, v_cand [D], `score`) merged into the heavy slots
    (`kivi_jax.cache._merge_one_heavy` is the reference): it takes the first empty slot; if none
    is empty and it scores above the worst slot (lowest score, of equal ones the latest), the
    slots from the worst on take the next slot's entry and it takes the last.

    In place: each slot's new entry is computed from values loaded before any store. The
    positions and scores [N] move by a one-hot max over the slots (a reduction across the
    program's threads, which every store waits for); the keys and values a row [D] at a time,
    every row loaded before the first is stored, each row in the same layout, so that a
    channel's entries are loaded and stored by the same thread, in program order."""
    S = sinks
    N = hp_ref.shape[0]
    hp, hs = hp_in[...], hs_in[...]  # [N]
    i = jax.lax.broadcasted_iota(jnp.int32, (N,), 0)
    held = hp >= 0
    count = jnp.sum(held.astype(jnp.int32))
    worst = jnp.min(jnp.where(held, hs, jnp.inf))
    last_worst = jnp.max(jnp.where(held & (hs == worst), i, -1))
    full = count == N
    enters = leaving & (jnp.logical_not(full) | (score > worst))
    write_at = jnp.where(full, N - 1, count)
    moves = full & (i >= last_worst)
    takes = i == write_at

    @pl.when(enters)
    def _merge():
        # x_next[i] = x[min(i + 1, N - 1)], [N, N] one-hot (rows: slots, columns: their source)
        src = jax.lax.broadcasted_iota(jnp.int32, (N, N), 1)
        nxt = src == jnp.minimum(jax.lax.broadcasted_iota(jnp.int32, (N, N), 0) + 1, N - 1)
        hp_next = jnp.max(jnp.where(nxt, hp[None, :], jnp.iinfo(jnp.int32).min), axis=1)
        hs_next = jnp.max(jnp.where(nxt, hs[None, :], -jnp.inf), axis=1)
        hp_ref[...] = jnp.where(takes, p, jnp.where(moves, hp_next, hp))
        hs_ref[...] = jnp.where(takes, score, jnp.where(moves, hs_next, hs))
        for x_in, x_ref, cand in ((hk_in, hk_ref, k_cand), (hv_in, hv_ref, v_cand)):
            rows = [x_in[S + j] for j in range(N)]  # [D] each, all loaded first
            for j in range(N):
                moved = jnp.where(full & (j >= last_worst), rows[min(j + 1, N - 1)], rows[j])
                x_ref[S + j] = jnp.where(write_at == j, cand, moved)


def _mixed_append_kernel(
    lengths_ref, counts_ref, k_ref, v_ref,  # as _append_kernel's
    kc_in, ks_in, kz_in, vc_in, vs_in, vz_in, kr_in, vr_in, sk_in, sv_in, fc_in, fch_in,
    *refs, k_bits: int, v_bits: int, group_size: int, residual_length: int, sinks: int,
    fine_channels: int, heavy: bool,
):  # fmt: skip
    """_append_kernel with a mixed state's sinks, fine key channels and heavy tokens
    (kivi_jax.cache, module doc). refs: the heavy slots' positions and scores (inputs, where
    `heavy`), then the outputs:

        kc_ref ... vr_ref                 as _append_kernel's
        sk_ref, sv_ref  [S + N, D]        the extras' keys and values: the sinks, then the
                                          heavy slots
        fc_ref  uint8 [C // kpb, F]       the fine channels' low codes
        fch_ref uint8 [C // G, F]         each key group's fine channels
        hp_ref  int32 [N], hs_ref f32 [N] (where `heavy`) the heavy slots' positions and scores
    """
    del vc_in, vs_in, vz_in  # written only
    if heavy:
        hp_in, hs_in, *refs = refs
    kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, kr_ref, vr_ref, sk_ref, sv_ref, fc_ref, \
        fch_ref, *heavy_refs = refs  # fmt: skip
    G, R, S, F = group_size, residual_length, sinks, fine_channels
    kpb = 8 // k_bits
    t, n = lengths_ref[...], counts_ref[...]
    slot = t % R
    dtype = ks_ref.dtype

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

    v_leave = vr_in[slot]  # [D // G, G // vpb, vpb], token t - R's, before its slot is written
    quantized = lambda: _quantize_value(v_leave, v_bits, dtype)
    if heavy:  # token t - R leaves the window: scored and merged before its ring slot is written
        p = t - R
        k_leave = kr_in[slot // kpb, slot % kpb]  # [D]
        v_codes, v_scale, v_zero = quantized()
        quantized = lambda: (v_codes, v_scale, v_zero)  # stored as scored, quantized once
        score = _leaving_score(
            jnp.maximum(p, 0), k_leave.astype(jnp.float32), v_leave.astype(jnp.float32),
            v_codes, v_scale, v_zero, kc_in, ks_in, kz_in, fc_in, fch_in,
            k_bits=k_bits, group_size=G,
        )  # fmt: skip
        hp_ref, hs_ref = heavy_refs
        _heavy_merge(
            p, score, k_leave, v_leave.reshape(k_leave.shape[0]), hp_in, hs_in, sk_in, sv_in,
            hp_ref, hs_ref, sk_ref, sv_ref, sinks=S, leaving=(n > 0) & (p >= S),
        )  # fmt: skip
    _value_leaves(t, n, quantized, vc_ref, vs_ref, vz_ref, v_bits=v_bits, residual_length=R)

    _rings_take_the_token(n, slot, k_ref, v_ref, kr_ref, vr_ref, k_bits=k_bits)


def _table_first(kernel, table_ref, *refs):
    """kernel(*refs, table_ref=table_ref): a paged append's Pallas kernel, the row's table its
    first ref."""
    return kernel(*refs, table_ref=table_ref)


@functools.partial(
    jax.jit,
    static_argnames=("k_bits", "v_bits", "group_size", "residual_length", "sinks", "interpret"),
)
def append_kernel(
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual, v_residual,
    lengths, counts, k, v, side=None, table=None,
    *, k_bits: int, v_bits: int, group_size: int, residual_length: int, sinks: int = 0,
    interpret: bool = False,
):  # fmt: skip
    """The kernel over one layer's arrays (kivi_jax.cache's layout); k, v [B, H, D] in the
    cache dtype, counts [B] in {0, 1} (tokens that fit). Returns the 8 arrays, updated.

    side: None, or a mixed state's (extra_k, extra_v, fine_codes, fine_channels) (extras
    [B, H, S + N, D], S = `sinks` sinks first; F fine key channels), with (heavy_pos,
    heavy_score) [B, H, N] after them where it has heavy tokens (chosen by ERROR): then the 12
    or 14 arrays, updated (the extras' sink slots and heavy slots).

    table: None, or int32 [B, M] (plain KIVI over a page pool, kivi_jax.paged): then the six
    quantized arrays are the pool's (k_codes [Pp, H, ps // kpb, D], ..., v_zero [Pp, H, ps,
    D // G]; ps the page size), the rings the rows'."""
    state = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual, v_residual)
    if table is not None and side is not None:
        raise ValueError("append_kernel: a mixed state is not paged by page (kivi_jax.paged)")
    B, H, R, D = k_residual.shape[0], k_residual.shape[1], residual_length, k.shape[-1]
    Pp, C = v_codes.shape[0], v_codes.shape[2]  # pages and a page's tokens, or B and capacity
    G = group_size
    kpb, vpb = 8 // k_bits, 8 // v_bits
    row = lambda b, h: (b,)
    full = lambda *block: pl.BlockSpec(
        (None, None, *block), lambda b, h: (b, h) + (0,) * len(block)
    )
    if table is None:
        quantized = full
    else:  # the KV head's whole pool (every page: the table places the writes)
        quantized = lambda *block: pl.BlockSpec(
            (Pp, None, *block), lambda b, h: (0, h) + (0,) * len(block)
        )
    state_specs = [
        quantized(C // kpb, D),  # k_codes
        quantized(C // G, D),  # k_scale
        quantized(C // G, D),  # k_zero
        quantized(C, D // G, G // vpb),  # v_codes: a token's bytes by channel group
        quantized(C, D // G),  # v_scale
        quantized(C, D // G),  # v_zero
        full(R // kpb, kpb, D),  # k_residual: slots by key byte
        full(R, D // G, G // vpb, vpb),  # v_residual: a value by channel group and byte
    ]
    views = [
        k_codes,
        k_scale,
        k_zero,
        v_codes.reshape(Pp, H, C, D // G, G // vpb),
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
        kernel = functools.partial(_append_kernel, **config)
        tables = ()
        if table is not None:  # the row's table first
            table_spec = pl.BlockSpec((None, table.shape[1]), lambda b, h: (b, 0))
            in_specs, tables = [table_spec, *in_specs], (table,)
            kernel = functools.partial(_table_first, kernel)
        first = len(in_specs)
        out = pl.pallas_call(
            kernel,
            grid=(B, H),
            in_specs=[*in_specs, *state_specs],
            out_specs=state_specs,
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in views],
            input_output_aliases={first + i: i for i in range(8)},
            compiler_params=params,
            interpret=interpret,
            name="kivi_append" if table is None else "kivi_append_paged",
        )(*tables, *inputs, *views)
        return [o.reshape(x.shape) for o, x in zip(out, state, strict=True)]
    E, F = side[0].shape[2], side[2].shape[3]  # extra_k [B, H, S + N, D], fine_codes [.., F]
    heavy = len(side) == 6
    side_specs = [full(E, D), full(E, D), full(C // kpb, F), full(C // G, F)]
    if heavy:
        N = side[4].shape[2]
        side_specs += [full(N), full(N)]
    out = pl.pallas_call(
        functools.partial(
            _mixed_append_kernel, **config, sinks=sinks, fine_channels=F, heavy=heavy
        ),
        grid=(B, H),
        in_specs=[*in_specs, *state_specs, *side_specs],
        out_specs=[*state_specs, *side_specs],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*views, *side)],
        input_output_aliases={4 + i: i for i in range(8 + len(side))},
        compiler_params=params,
        interpret=interpret,
        name="kivi_append_mixed",
    )(*inputs, *views, *side)
    return [o.reshape(x.shape) for o, x in zip(out, (*state, *side), strict=True)]
