"""What both value kernels (`gpu.weighted_values`, `gqa_values.gqa_weighted_values`) share: a
split's tiles of the quantized values, and before them the row's max over the score programs'
maxima and a program's share of the residual tail (the last R tokens, full-precision values),
for one or several query heads."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kivi_jax.pallas_kernels.decode_attention import loops


def split_tiles(pv, *, split, splits: int, step: int, tokens_per_split: int, interleave: bool):
    """The tiles of `step` tokens that value split `split` of `splits` takes of a row's
    quantized values [0, pv) -> (tile_start(k), end, n_tiles): tile k starts at tile_start(k)
    and its tokens below `end` are this split's (tiles a loop runs past n_tiles start at or
    past `end`). interleave: tile k of this split is tile k * splits + split of the row (the
    row's splits walk neighbouring tiles together); else one contiguous range of
    tokens_per_split tokens each."""
    cap = tokens_per_split // step
    if interleave:
        n_tiles = jnp.clip(pl.cdiv(pl.cdiv(pv, step) - split, splits), 0, cap)
        return (lambda k: (k * splits + split) * step), pv, n_tiles
    lo = split * tokens_per_split
    end = jnp.minimum(lo + tokens_per_split, pv)
    return (lambda k: lo + k * step), end, jnp.clip(pl.cdiv(end - lo, step), 0, cap)


def row_max(read, P: int, chunk: int):
    """Max of a row's P score-program maxima, read(pl.ds) -> [chunk] `chunk` (a power of two
    dividing P) at a time; -1e30 where the row has no quantized keys. Returns a function that
    computes it from the loads issued here (all of them, where there are at most 4 chunks)."""
    if P // chunk <= 4:
        parts = [read(pl.ds(i * chunk, chunk)) for i in range(P // chunk)]
        return lambda: functools.reduce(jnp.maximum, [jnp.max(x) for x in parts], loops.NEG_INIT)
    return lambda: lax.fori_loop(
        0,
        P // chunk,
        lambda i, m: jnp.maximum(m, jnp.max(read(pl.ds(i * chunk, chunk)))),
        jnp.float32(loops.NEG_INIT),
    )


def tail_share(length, qs, kr_ref, vr_ref, logits, *, split, splits, slots, prefetch,
               sliding_keys=False):  # fmt: skip
    """A value-kernel program's share of the residual tail, the R tokens [Pv, Pv + R) at ring
    slots t % R: chunks c = split, split + splits, ... (c < R / slots) of `slots` slots each,
    each chunk's keys and values loaded once for all the heads. Per head h, its logits
    (logits(h, tok) [slots] from the score kernel where t < Qk, else q_h . k_residual; with
    `sliding_keys` (a mixed state's keys leave the window with their values) every tail
    token's from k_residual: Qk taken as Pv, `logits` not read), with
    an online softmax -> (m, sum 2**(s_t - m) v_t [D], sum 2**(s_t - m)), m their max (-1e30
    if none). qs: per head its query times q_scale, float32 [1, D]; kr_ref / vr_ref [R, D]
    (the residual keys and values)."""
    R, D = kr_ref.shape
    n_chunks = R // slots
    if sliding_keys:
        qk = pv = jnp.maximum(length - R, 0)
    else:
        qk, pv = length - length % R, jnp.maximum(length - R, 0)
    rot = pv % R  # the slot of token pv

    def chunk(i):
        return jnp.minimum(split + i * splits, n_chunks - 1)  # past the last: masked below

    def tokens(i):
        """(token at each slot of chunk i, whether this program holds it) [slots]."""
        slot = chunk(i) * slots + lax.broadcasted_iota(jnp.int32, (slots,), 0)
        tok = pv - rot + slot + jnp.where(slot < rot, R, 0)  # pv + (slot - pv) mod R
        return tok, (tok < length) & (split + i * splits < n_chunks)

    def load(i):
        """Chunk i's residual keys and values [slots, D]: a key only where the score kernel
        has none (t >= Qk), a value only where it is held (masked loads read no bytes)."""
        c = pl.ds(chunk(i) * slots, slots)
        tok, held = tokens(i)
        k = plgpu.load(kr_ref.at[c, :], mask=(held & (tok >= qk))[:, None], other=0.0)
        return k, plgpu.load(vr_ref.at[c, :], mask=held[:, None], other=0.0)

    def compute(i, tile, carry):
        k, v = (x.astype(jnp.float32) for x in tile)
        tok, held = tokens(i)
        out = []
        for h, (q, (m, o, l_sum)) in enumerate(zip(qs, carry, strict=True)):
            s_res = jnp.sum(k * q, axis=1)  # [slots]
            if sliding_keys:
                s = jnp.where(held, s_res, -jnp.inf)
            else:
                s = jnp.where(held, jnp.where(tok < qk, logits(h, tok), s_res), -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s))  # finite: m starts at -1e30
            p = jnp.exp2(s - m_new)  # 0 where the logit is -inf
            scale = jnp.exp2(m - m_new)
            o = o * scale + jnp.sum(p[:, None] * v, axis=0)
            out.append((m_new, o, l_sum * scale + jnp.sum(p)))
        return tuple(out)

    n_iter = pl.cdiv(n_chunks, splits)
    empty = (jnp.float32(loops.NEG_INIT), jnp.zeros((D,), jnp.float32), jnp.float32(0.0))
    carry = tuple(empty for _ in qs)
    return loops.pipelined_loop(n_iter, prefetch, load, compute, carry, lambda i: i < n_iter)
