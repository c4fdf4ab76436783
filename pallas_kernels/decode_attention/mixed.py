"""A mixed-precision state (kivi2-mix) through the GPU kernels: what changes between them.

The score kernel writes the base-2 logits of the quantized keys, [B, H, slots, C], and each
program's maximum; the value kernel reads those logits for every token whose key the cache
reads quantized (`kivi_jax.cache`, module doc: t < Qk), and the residual ring for the rest.
A mixed state (`MixedState`: sinks, sliding keys, fine key channels, heavy tokens) changes what
some tokens read: the score kernels add the fine channels, the value kernels read the sliding
keys from the ring; XLA sets the logits of the full-precision entries to -inf between the two
kernels and adds those entries as one more partial softmax:

* Fine key channels: a fine channel's key is hi * k_scale + k_zero + lo * k_scale / 2^b
  (b = k_bits); the score kernels compute the first part from the codes they read and add
  sum_f w_f lo_tf, w_f = q_f k_scale_f / 2^b, over the group's F fine channels: a second,
  small dot product per key group on the fine codes, with the weights w precomputed here
  (`fine_operands`: [B, H, n_rep, NG, F], F padded to a power of two >= 16). The kernels'
  maxima include it (exact), so the value kernels exponentiate against maxima at or above
  every logit (weights <= 1, the tensor-core kernel's f16 operands). `fine_correction_reference`
  is what they add.
* Sliding keys: keys leave the window with their values, so keys of [Pv, l) are read from
  the ring, Pv = max(l - R, 0): the value kernels compute every tail token's logit from the
  ring's key (`residual.tail_share` with sliding_keys), where plain KIVI takes those below
  Qk = l - l % R from the score kernel.
* Sinks and heavy tokens: full-precision keys and values of tokens whose logits the kernels
  would otherwise read quantized, t < Qx (Qx: Pv with sliding keys, else Qk): the sinks
  t < min(S, l, Qx) and every heavy slot (heavy tokens have left the value window: t < Pv).
  Their logits are set to -inf (weight 0 in both value kernels, the quantized part and the
  tail), and `extras_softmax` computes their partial softmax, which `gpu._merge_splits` merges
  as one more split. Sinks at or past Qx are in the ring, which holds the same key and value:
  the kernels read them there.

The maxima the value kernels use may lie above the logits they read (a masked token's
quantized logit was the largest, or with sliding keys a quantized logit of [Pv, Qk), which
they read from the ring instead): weights are then exponentiated against a larger
max, which changes nothing unless the gap passes ~126 (base 2), where float32 weights
underflow to 0; the extras' own partial softmax is unaffected.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from kivi_jax.pallas_kernels.decode_attention import loops

from kivi_jax import quantization

_HI = jax.lax.Precision.HIGHEST


class FineChannels(NamedTuple):
    """What the score kernels read of the fine key channels: codes uint8 [B, H, C // kpb, Fp]
    (the low b bits, packed along tokens as the key codes are) and weights f32
    [B, H, n_rep, NG, Fp] (q_f k_scale_f / 2^b of each query head, key group and fine channel);
    Fp = F, or F padded with zero codes and weights to a power of two >= 16."""

    codes: jax.Array
    weights: jax.Array


def _fine_weights(qs, k_scale, fine_channels, *, k_bits: int):
    """q_f k_scale_f / 2^b per query head, key group and fine channel: qs f32 [B, H, n_rep, D]
    (the query times q_scale), k_scale [B, H, NG, D], fine_channels uint8 [B, H, NG, F] ->
    [B, H, n_rep, NG, F]."""
    ch = fine_channels.astype(jnp.int32)
    scale = jnp.take_along_axis(quantization.as_float32(k_scale), ch, axis=3)  # [B, H, NG, F]
    q_at = jax.vmap(jax.vmap(lambda qq, cc: qq[:, cc]))(qs, ch)  # [B, H, n_rep, NG, F]
    return q_at * scale[:, :, None] * (1.0 / (1 << k_bits))


def fine_operands(qs, k_scale, fine_codes, fine_channels, *, k_bits: int) -> FineChannels:
    """The fine channels as the score kernels read them (`FineChannels`); a copy of the codes
    only where F is not already a power of two >= 16 (KIVI2_MIX's 16 is)."""
    w = _fine_weights(qs, k_scale, fine_channels, k_bits=k_bits)
    F = w.shape[-1]
    Fp = max(16, 1 << (F - 1).bit_length())
    if Fp != F:
        widen = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, Fp - F)])
        fine_codes, w = widen(fine_codes), widen(w)
    return FineChannels(fine_codes, w)


def fine_last(kernel):
    """`kernel(*inputs, *outputs, fine=(codes_ref, weights_ref))` (two outputs) as a Pallas
    kernel whose last two inputs are the fine codes and weights."""

    def run(*refs):
        *inputs, codes_ref, weights_ref, s_ref, m_ref = refs
        return kernel(*inputs, s_ref, m_ref, fine=(codes_ref, weights_ref))

    return run


def fine_correction_reference(
    qs, k_scale, fine_codes, fine_channels, *, k_bits: int, group_size: int
):  # fmt: skip
    """What the fine channels' low codes add to each quantized key's logit, the score kernels'
    reference: [B, H, n_rep, C] (fine_codes uint8 [B, H, C // kpb, F])."""
    w = _fine_weights(qs, k_scale, fine_channels, k_bits=k_bits)
    B, H, n_rep, NG, F = w.shape
    lo = quantization.unpack_codes(fine_codes, k_bits, axis=2).astype(jnp.float32)
    lo = lo.reshape(B, H, NG, group_size, F)
    return jnp.einsum("bhrgf,bhgtf->bhrgt", w, lo, precision=_HI).reshape(B, H, n_rep, -1)


def _key_window_start(lengths, *, residual_length: int, sliding_keys: bool):
    """Qx [B]: the first token whose key the cache reads from the ring."""
    pv = jnp.maximum(lengths - residual_length, 0)
    return pv if sliding_keys else lengths - lengths % residual_length


def extra_entries(side, lengths, *, residual_length: int, sliding_keys: bool):
    """The full-precision entries that replace quantized ones, as the state holds them (the
    extras: S sinks, then N heavy slots): (keys, values [B, H, E, D], positions int32
    [B, H, E], used bool [B, H, E]), E = S + N; None if the state has no sinks and no heavy
    tokens."""
    if side.extra_k is None:
        return None
    B, H, E, _ = side.extra_k.shape
    S = side.sinks
    slot = jnp.arange(E, dtype=jnp.int32)
    pos = jnp.broadcast_to(slot, (B, H, E))  # a sink's position is its slot
    used = slot < 0
    if S:
        qx = _key_window_start(lengths, residual_length=residual_length, sliding_keys=sliding_keys)
        used = (slot < S) & (slot < jnp.minimum(lengths, qx)[:, None, None])
    if side.heavy_pos is not None:
        heavy_pos = jnp.pad(side.heavy_pos, [(0, 0), (0, 0), (S, 0)])  # [B, H, E]
        pos = jnp.where(slot < S, pos, heavy_pos)
        used = used | ((slot >= S) & (heavy_pos >= 0))
    return side.extra_k, side.extra_v, pos, jnp.broadcast_to(used, (B, H, E))


def mask_extras(scores, extras):
    """The score kernels' logits [B, H, slots, C] with -inf at the positions of `extras`
    (`extra_entries`, or None) in use: one scatter of B H E entries (a comparison of every
    position with each would cost E x C a row)."""
    if extras is None:
        return scores
    _, _, pos, used = extras  # [B, H, E]
    B, H, _ = pos.shape
    C = scores.shape[3]
    at = jnp.where(used, pos, C)  # C: past the logits, dropped
    b, h = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    return scores.at[b, h, :, at].set(-jnp.inf, mode="drop")


def extras_softmax(qs, extras):
    """The partial softmax of the full-precision entries that replace quantized ones
    (`extra_entries`), in the value kernels' form (one split): m [B, H, n_rep] (-1e30 if none
    is used), sum_e 2**(s_e - m) v_e [B, H, n_rep, D] and sum_e 2**(s_e - m) [B, H, n_rep].
    Products summed over D and over E, which XLA fuses with the exponentials into
    reductions. An unused entry weighs 0 and its value is read as 0 (a slot past the row's
    entries may hold anything, a non-finite value included)."""
    k, v, _, used = extras
    s = jnp.sum(qs[:, :, :, None, :] * k[:, :, None].astype(jnp.float32), axis=-1)  # [.., E]
    s = jnp.where(used[:, :, None], s, -jnp.inf)
    m = jnp.maximum(jnp.max(s, axis=-1), loops.NEG_INIT)  # [B, H, n_rep]
    p = jnp.exp2(s - m[..., None])  # 0 where unused
    v = jnp.where(used[..., None], v.astype(jnp.float32), 0.0)  # [B, H, E, D]
    o = jnp.sum(p[..., None] * v[:, :, None], axis=-2)
    return m, o, jnp.sum(p, axis=-1)
