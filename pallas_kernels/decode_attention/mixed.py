"""A mixed-precision state (kivi2-mix) through the GPU kernels: what changes between them.

The score kernel writes the base-2 logits of the quantized keys, [B, H, slots, C], and each
program's maximum; the value kernel reads those logits for every token whose key the cache
reads quantized (`kivi_jax.cache`, module doc: t < Qk), and the residual ring for the rest.
A mixed state (`MixedState`: sinks, sliding keys, fine key channels, heavy tokens) changes what
some tokens read; here XLA edits the logits between the two kernels, and adds the
full-precision entries as one more partial softmax, so that the kernels run unchanged:

* Fine key channels: a fine channel's key is hi * k_scale + k_zero + lo * k_scale / 2^b
  (b = k_bits); the kernel computes the first part from the codes it reads, so the logit
  gains sum_f q_f k_scale_f lo_tf / 2^b over the group's F fine channels: a second, small
  dot product per key group (`fine_correction`). The score programs' maxima are raised by a
  bound of that sum (`fine_bound`), so that they stay at or above every logit: the value
  kernels exponentiate against them (weights <= 1, the tensor-core kernel's f16 operands).
* Sliding keys: keys leave the window with their values, so keys of [Pv, l) are read from
  the ring, Pv = max(l - R, 0). The value kernels take the logits of the tail's tokens below
  the plain Qk = l - l % R from the score kernel; those of [Pv, Qk) are overwritten with the
  exact logits of the ring's keys (`ring_logits`).
* Sinks and heavy tokens: full-precision keys and values of tokens whose logits the kernels
  would otherwise read quantized, t < Qx (Qx: Pv with sliding keys, else Qk): the sinks
  t < min(S, l, Qx) and every heavy slot (heavy tokens have left the value window: t < Pv).
  Their logits are set to -inf (weight 0 in both value kernels, the quantized part and the
  tail), and `extras_softmax` computes their partial softmax, which `gpu._merge_splits` merges
  as one more split. Sinks at or past Qx are in the ring, which holds the same key and value:
  the kernels read them there.

The maxima the value kernels use may lie above the logits that remain after masking (a masked
token's quantized logit was the largest): weights are then exponentiated against a larger
max, which changes nothing unless the gap passes ~126 (base 2), where float32 weights
underflow to 0; the extras' own partial softmax is unaffected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from kivi_jax.pallas_kernels.decode_attention import loops

from kivi_jax import quantization

_HI = jax.lax.Precision.HIGHEST


def _fine_weights(qs, k_scale, fine_channels, *, k_bits: int):
    """q_f k_scale_f / 2^b per query head, key group and fine channel: qs f32 [B, H, n_rep, D]
    (the query times q_scale), k_scale [B, H, NG, D], fine_channels uint8 [B, H, NG, F] ->
    [B, H, n_rep, NG, F]."""
    ch = fine_channels.astype(jnp.int32)
    scale = jnp.take_along_axis(quantization.as_float32(k_scale), ch, axis=3)  # [B, H, NG, F]
    q_at = jax.vmap(jax.vmap(lambda qq, cc: qq[:, cc]))(qs, ch)  # [B, H, n_rep, NG, F]
    return q_at * scale[:, :, None] * (1.0 / (1 << k_bits))


def fine_correction(qs, k_scale, fine_codes, fine_channels, *, k_bits: int, group_size: int):
    """What the fine channels' low codes add to each quantized key's logit: [B, H, n_rep, C]
    (fine_codes uint8 [B, H, C // kpb, F], the low b bits, packed along tokens)."""
    w = _fine_weights(qs, k_scale, fine_channels, k_bits=k_bits)
    B, H, n_rep, NG, F = w.shape
    lo = quantization.unpack_codes(fine_codes, k_bits, axis=2).astype(jnp.float32)
    lo = lo.reshape(B, H, 1, NG, group_size, F)
    # A sum over the minor axis F, made in the logits' layout (a dot would put the group axis
    # first: a transpose of [B, H, n_rep, C] after it).
    corr = jnp.sum(w[:, :, :, :, None] * lo, axis=-1)  # [B, H, n_rep, NG, G]
    return corr.reshape(B, H, n_rep, -1)


def fine_bound(qs, k_scale, fine_channels, *, k_bits: int):
    """An upper bound of `fine_correction` over a row's tokens: [B, H, n_rep]."""
    w = _fine_weights(qs, k_scale, fine_channels, k_bits=k_bits)
    return jnp.max(jnp.sum(jnp.abs(w), axis=-1), axis=-1) * ((1 << k_bits) - 1)


def ring_logits(qs, k_residual):
    """The base-2 logits of the ring's keys: [B, H, n_rep, R] (slot order)."""
    return jnp.einsum("bhrd,bhsd->bhrs", qs, k_residual.astype(jnp.float32), precision=_HI)


def _key_window_start(lengths, *, residual_length: int, sliding_keys: bool):
    """Qx [B]: the first token whose key the cache reads from the ring."""
    pv = jnp.maximum(lengths - residual_length, 0)
    return pv if sliding_keys else lengths - lengths % residual_length


def extra_entries(side, lengths, *, residual_length: int, sliding_keys: bool):
    """The full-precision entries that replace quantized ones: (keys, values [B, H, E, D],
    positions int32 [B, H, E], used bool [B, H, E]), E = sinks + heavy slots; None if the
    state has no sinks and no heavy tokens."""
    ks, vs, pos, used = [], [], [], []
    B = lengths.shape[0]
    if side.sink_k is not None:
        _, H, S, _ = side.sink_k.shape
        qx = _key_window_start(lengths, residual_length=residual_length, sliding_keys=sliding_keys)
        t = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, H, S))
        ks.append(side.sink_k)
        vs.append(side.sink_v)
        pos.append(t)
        used.append(t < jnp.minimum(lengths, qx)[:, None, None])
    if side.heavy_pos is not None:
        ks.append(side.heavy_k)
        vs.append(side.heavy_v)
        pos.append(side.heavy_pos)
        used.append(side.heavy_pos >= 0)
    if not ks:
        return None
    cat = lambda xs: jnp.concatenate(xs, axis=2)
    return cat(ks), cat(vs), cat(pos), cat(used)


def edit_logits(
    qs, scores, block_max, k_scale, k_residual, lengths, side, extras, *, k_bits: int,
    group_size: int, residual_length: int, sliding_keys: bool,
):  # fmt: skip
    """The score kernel's logits [B, H, slots, C] and maxima [B, H, slots, M] for a mixed state
    (module doc): fine channels added (maxima raised by their bound), the ring's exact logits
    in [Pv, Qk) with sliding keys, -inf at the positions of `extras` (`extra_entries`) in use.
    qs: f32 [B, H, n_rep, D], the query times q_scale; slots >= n_rep (the slots past n_rep
    unused). The fine channels and the ring's logits are selects over the logits by token
    position (one fused pass over them); the extras' -inf one scatter of their positions."""
    *_, slots, C = scores.shape
    n_rep = qs.shape[2]
    pad = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, slots - n_rep)] + [(0, 0)] * (x.ndim - 3))
    if side.fine_codes is not None:
        corr = fine_correction(
            qs, k_scale, side.fine_codes, side.fine_channels, k_bits=k_bits,
            group_size=group_size,
        )  # fmt: skip
        scores = scores + pad(corr)
        bound = fine_bound(qs, k_scale, side.fine_channels, k_bits=k_bits)
        block_max = block_max + pad(bound)[..., None]
    if sliding_keys:  # token t in [Pv, Qk) reads ring slot t % R
        t = jnp.arange(C)  # token positions
        R = residual_length
        pv = jnp.maximum(lengths - R, 0)[:, None, None, None]
        qk = (lengths - lengths % R)[:, None, None, None]
        ring = pad(ring_logits(qs, k_residual))  # [B, H, slots, R]
        by_token = jnp.tile(ring, (1, 1, 1, -(-C // R)))[..., :C]  # [B, H, slots, C]
        scores = jnp.where((t >= pv) & (t < qk), by_token, scores)
    if extras is not None:  # one scatter of B H E entries (a comparison would cost E x C)
        _, _, pos, used = extras  # [B, H, E]
        B, H, _ = pos.shape
        at = jnp.where(used, pos, C)  # C: past the logits, dropped
        b, h = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
        scores = scores.at[b, h, :, at].set(-jnp.inf, mode="drop")
    return scores, block_max


def extras_softmax(qs, extras):
    """The partial softmax of the full-precision entries that replace quantized ones
    (`extra_entries`), in the value kernels' form (one split): m [B, H, n_rep, 1] (-1e30 if
    none is used), sum_e 2**(s_e - m) v_e [B, H, n_rep, 1, D] and sum_e 2**(s_e - m)
    [B, H, n_rep, 1]."""
    k, v, _, used = extras
    s = jnp.einsum("bhrd,bhed->bhre", qs, k.astype(jnp.float32), precision=_HI)
    s = jnp.where(used[:, :, None], s, -jnp.inf)
    m = jnp.maximum(jnp.max(s, axis=-1), loops.NEG_INIT)  # [B, H, n_rep]
    p = jnp.exp2(s - m[..., None])  # 0 where unused
    o = jnp.einsum("bhre,bhed->bhrd", p, v.astype(jnp.float32), precision=_HI)
    return m[..., None], o[:, :, :, None], jnp.sum(p, axis=-1)[..., None]
