"""GQA value sums on tensor cores: a KV head's value codes unpacked once for all its query heads.

The CUDA-core value kernel (`gpu.weighted_values`) runs one program per query head, so with
grouped-query attention the n_rep heads of a KV head read and unpack its value words in turn.
Here one program (one warp) per (sequence, KV head, token split) sums the values of all
n_rep <= 8 heads at once with `mma.sync.m16n8k16` (f16 operands, f32 sums):

    O[d, h] = sum_t c_td (p_ht s_tg) + sum_t p_ht z_tg       (v_td = s_tg c_td + z_tg)

for channel d of channel group g (G = 32 channels), p_ht = 2**(logit - m_h) the softmax
weight of head h against the program's max for it.

* A (16 x 16, rows = 16 channels of one channel group, k = 16 tokens): the value codes,
  unpacked in registers into exact f16 integers as `gqa_scores.code_operand` makes them (a
  LOP3 with the exponent of 1024, then an HSUB2 of 1024). A value byte holds `8 // bits`
  channels of one token; lane l = 4 i + t owns, in each channel group, the 4 channels of its
  byte(s) (1 byte at 2 bits, 2 at 4) and the tokens t, t + 4, t + 8, t + 12 of each block of
  16 (k 2t, 2t + 1, 2t + 8, 2t + 9), so that the 4 lanes of a head read 4 adjacent logits per
  load. The 8 lanes of a t load their 4 tokens' words between them, one word of 8 each (and
  one scale and one zero-point word of 8), and each takes per group and token the word
  holding its byte(s) from the lane that loaded it (SHFL: a load serves 8 lanes, and a block
  of 16 tokens in flight holds 10 registers a lane at 2 bits and D = 128, not 36). One PRMT
  per pair of tokens puts byte b of each in the two halves, one LOP3 per field keeps a
  channel's code. Of the group's two 16-row tiles, rows i and i + 8 are the lane's fields
  (2u, 2u + 1) at 2 bits, fields (0, 1) of byte u at 4 bits.
* B (16 x 8, k = tokens, n = heads): p_ht s_tg in f16 (p <= 1; relative error 2**-11 per
  term, sums in float32), computed by the lane for its head i and its 4 tokens; heads past
  n_rep are 0.
* The field's 2**(bits*j), the zero points' sum_t p_ht z_tg and
  the weights' sum_t p_ht (float32 on CUDA cores, each lane over its 4 tokens, then summed
  over a head's 4 lanes by two butterfly shuffles) are applied to the accumulators at the end.

Before its tokens, a program takes its share of the residual tail for each head and the row's
max over the score programs' maxima (`residual`), as the CUDA-core kernel does; its outputs
are that kernel's (`_merge_splits` merges them). Lane-level operations (inline PTX with jnp
twins for interpret mode) are `ptx`'s.

Supported: group_size 32, head_dim a multiple of 32, n_rep <= 8, v_bits 2 or 4,
bfloat16/float16 scales; f16 operands, so p s must stay within f16's range (|s| < 65504).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kivi_jax.pallas_kernels.decode_attention import loops, pages, residual
from kivi_jax.pallas_kernels.decode_attention.gqa_scores import (
    _MAGIC,
    MAX_HEADS,
    code_operand,
    param_pair,
)
from kivi_jax.pallas_kernels.decode_attention.ptx import (
    exp2_ftz,
    mma_m16n8k16,
    pack_f16x2,
    prmt,
    shfl_idx,
    shfl_xor,
    sub_f16x2,
)

GROUP_SIZE = 32  # the only value group size this kernel takes (two 16-row tiles per group)
BLOCK = 16  # tokens per mma (its k)


def supported_reason(*, n_rep: int, group_size: int, head_dim: int, v_bits: int) -> str | None:
    """None if `gqa_weighted_values` takes this configuration, else a sentence saying why."""
    if n_rep > MAX_HEADS:
        return f"n_rep={n_rep}: the tensor-core value kernel takes at most {MAX_HEADS}"
    if group_size != GROUP_SIZE:
        return f"group_size={group_size}: the tensor-core value kernel takes {GROUP_SIZE}"
    if head_dim % GROUP_SIZE:
        return f"head_dim={head_dim}: the tensor-core value kernel needs a multiple of 32"
    if v_bits not in (2, 4):
        return f"v_bits={v_bits}: the tensor-core value kernel takes 2 and 4"
    return None


def _select(values, index):
    """int32 [32] index -> float32 [32]: values[index] of a list of scalars."""
    out = jnp.full((32,), values[0], jnp.float32)
    for h, v in enumerate(values[1:], 1):
        out = jnp.where(index == h, v, out)
    return out


def _kernel(
    len_ref,  # []              int32
    bm_ref,  # [slots, Pm]       f32 the score programs' maxima, head slot h
    s_ref,  # [slots, C]         f32 logits, head slot h
    vw_ref,  # [C, D/vpb/4]      int32 value words: token, 4 bytes of vpb channels each
    vs_ref,  # [C, D/G/2]        int32 value scales, groups 2i and 2i + 1 per word
    vz_ref,  # [C, D/G/2]        int32 value zero points, likewise
    q_ref,  # [n_rep, D]         the queries (their dtype; times q_scale here)
    kr_ref,  # [R, D]            residual keys, token t at ring slot t % R
    vr_ref,  # [R, D]            residual values
    m_ref,  # out [n_rep]        f32 per head the program's max logit m
    o_ref,  # out [n_rep, D]     f32 sum_t p_t v_t over the split's quantized values
    ot_ref,  # out [n_rep, D]    f32 sum_t p_t v_t over the program's tail share
    l_ref,  # out [n_rep]        f32 sum_t p_t over both, p_t = 2**(s_t - m)
    *,
    bits: int,
    splits: int,
    blocks: int,
    tokens_per_split: int,
    interleave: bool,
    tail_slots: int,
    max_chunk: int,
    q_scale: float,
    param_dtype,
    prefetch: int,
    interpret: bool,
    table: pages.RowPages | None = None,
    sliding_keys: bool = False,
):
    n_rep, D = q_ref.shape
    C = s_ref.shape[1]
    R = kr_ref.shape[0]
    G, vpb = GROUP_SIZE, 8 // bits
    n_groups = D // G
    lane = lax.broadcasted_iota(jnp.int32, (32,), 0)
    i, t = lane // 4, lane % 4  # the lane's A rows i, i + 8 and B column (head) i
    length = len_ref[()]
    split = pl.program_id(2)
    pv = jnp.maximum(length - R, 0)
    step = BLOCK * blocks  # tokens per iteration
    tile_start, end, n_tiles = residual.split_tiles(
        pv, split=split, splits=splits, step=step, tokens_per_split=tokens_per_split,
        interleave=interleave,
    )  # fmt: skip
    # The lane's bytes of a token: in group g, bytes g G/vpb + i 4/vpb (+ u at 4 bits), all
    # within one word.
    group_bytes, lane_bytes = G // vpb, 4 // vpb
    first_byte = [g * group_bytes + i * lane_bytes for g in range(n_groups)]
    words = [b // 4 for b in first_byte]
    tiles = [(g, u) for g in range(n_groups) for u in range(2)]
    byte = [first_byte[0] % 4 + (u if vpb == 2 else 0) for u in range(2)]  # within the word
    selector = [b | ((4 + b) << 8) for b in byte]  # byte b of two tokens -> the two halves
    fields = [(2 * u, 2 * u + 1) if vpb == 4 else (0, 1) for u in range(2)]  # rows i, i + 8
    magic = jnp.full((32,), _MAGIC, jnp.int32)
    field_masks = [
        jnp.full((32,), (((1 << bits) - 1) << (bits * f)) * 0x00010001, jnp.int32)
        for f in range(vpb)
    ]
    head = jnp.minimum(i, n_rep - 1)

    def token(start, n, a):
        """The lane's token a (0..3, or a per-lane index) of block n of the tile at `start`."""
        return start + BLOCK * n + t + 4 * a

    def tokens(k, n, start=None):
        """The lane's 4 tokens of block n of tile k (or of the tile at `start`)."""
        start = tile_start(k) if start is None else start
        return [token(start, n, a) for a in range(4)]

    # The 8 lanes of a t share their 4 tokens' words: each loads its share and takes the words
    # it needs from the others by shuffles, so that a load serves 8 lanes, not 1. Value words:
    # lane (i', t) loads word i' + 8 r (mod W) of each token; lane (i, t) needs word words[g]
    # of group g, from lane (words[g] % 8, t)'s load r = code_load[g]. Scales and zero
    # points: lane (i', t) loads item i' (mod 4 NP) of each, word w of token a at item
    # a NP + w.
    W, NP = vw_ref.shape[-1], n_groups // 2
    code_loads = -(-W // 8)
    code_src = [4 * (w % 8) + t for w in words]
    code_load = [(g * group_bytes // 4) // 8 for g in range(n_groups)]  # the same for every i
    param_a, param_w = (i % (4 * NP)) // NP, (i % (4 * NP)) % NP

    def load(k):
        """Tile k, per block: this lane's share of its t's 4 tokens' value words, scale and
        zero-point words, and head i's logit of each token. A tile past the capacity (past
        n_tiles: not used) is clamped into it as a whole."""
        out = []
        start = jnp.minimum(tile_start(k), C - step)  # step divides C
        if table is None:
            at = lambda x: (x,)
        else:  # the tile's page (step divides page_size)
            page, first = table.locate(start)
            at = lambda x: (page, x - start + first)
        for n in range(blocks):
            toks = tokens(k, n, start)
            codes = [[vw_ref[(*at(x), (i + 8 * r) % W)] for x in toks] for r in range(code_loads)]
            tok = token(start, n, param_a)
            params = (vs_ref[(*at(tok), param_w)], vz_ref[(*at(tok), param_w)])
            out.append((codes, params, [s_ref[head, x] for x in toks]))
        return tuple(out)

    # The first tiles' loads are issued first, to be in flight during the row's maxima (each
    # reduced at once: n_rep rows of maxima held over the tail share cost registers) and the
    # tail share.
    ring = tuple(load(k) for k in range(prefetch))
    maxima = [
        residual.row_max(lambda ds, h=h: bm_ref[h, ds], bm_ref.shape[1], max_chunk)()
        for h in range(n_rep)
    ]
    qs = [q_ref[h, :].astype(jnp.float32)[None, :] * q_scale for h in range(n_rep)]
    tails = residual.tail_share(
        length, qs, kr_ref, vr_ref, lambda h, tok: s_ref[h, jnp.minimum(tok, C - 1)],
        split=split, splits=splits, slots=tail_slots, prefetch=prefetch,
        sliding_keys=sliding_keys,
    )  # fmt: skip
    m, l_tail = [], []
    for h, (m_t, o_t, l_t) in enumerate(tails):
        m.append(jnp.maximum(maxima[h], m_t))
        ot_ref[h, :] = o_t * jnp.exp2(m_t - m[h])
        l_tail.append(l_t * jnp.exp2(m_t - m[h]))
    m_lane = _select(m, head)  # head i's max

    def unpack(x, f):
        """f16 pair of field f: c * 2**(bits*f), exact."""
        y = code_operand(x, field_masks[f], magic, interpret=interpret)
        return sub_f16x2(y, magic, interpret=interpret)

    def compute(k, tile, carry):
        acc, pz, ls = list(carry[0]), list(carry[1]), carry[2]
        for n, (codes, (sc, zp), logits) in enumerate(tile):
            toks = tokens(k, n)
            shfl = functools.partial(shfl_idx, interpret=interpret)
            # w[a][g]: token a's word holding the lane's bytes of group g; sc[a][v], zp[a][v]:
            # token a's scale and zero-point words v
            w = [[shfl(codes[code_load[g]][a], code_src[g]) for g in range(n_groups)]
                 for a in range(4)]  # fmt: skip
            sc, zp = ([[shfl(x, 4 * (a * NP + v) + t) for v in range(NP)] for a in range(4)]
                      for x in (sc, zp))  # fmt: skip
            p = [
                jnp.where((i < n_rep) & (x < end), exp2_ftz(s - m_lane, interpret=interpret), 0.0)
                for x, s in zip(toks, logits, strict=True)
            ]
            s = [[v for x in row for v in param_pair(x, param_dtype)] for row in sc]  # [a][g]
            z = [[v for x in row for v in param_pair(x, param_dtype)] for row in zp]
            ls = ls + functools.reduce(jnp.add, p)
            for g in range(n_groups):
                for a in range(4):  # a chain of fused multiply-adds
                    pz[g] = pz[g] + p[a] * z[a][g]
                b = [
                    pack_f16x2(p[a] * s[a][g], p[a + 1] * s[a + 1][g], interpret=interpret)
                    for a in (0, 2)
                ]  # b[0]: k 2t, 2t + 1 (tokens t, t + 4); b[1]: k 2t + 8, 2t + 9
                for u in range(2):
                    x01, x23 = (
                        prmt(w[a][g], w[a + 1][g], selector[u], interpret=interpret) for a in (0, 2)
                    )
                    f0, f1 = fields[u]
                    a = [unpack(x01, f0), unpack(x01, f1), unpack(x23, f0), unpack(x23, f1)]
                    acc[2 * g + u] = mma_m16n8k16(a, b, acc[2 * g + u], interpret=interpret)
        return tuple(acc), tuple(pz), ls

    zeros = jnp.zeros((32,), jnp.float32)
    carry = (tuple([zeros] * 4 for _ in tiles), tuple(zeros for _ in range(n_groups)), zeros)
    live = lambda k: tile_start(k) < end  # k < n_tiles
    acc, pz, ls = loops.pipelined_loop(n_tiles, prefetch, load, compute, carry, live, ring)

    def head_totals(x):
        """Lane (i, t)'s partial sums of head i -> head i's total on each of its lanes."""
        x = x + shfl_xor(x, 1, interpret=interpret)
        return x + shfl_xor(x, 2, interpret=interpret)

    # the totals of heads 2t and 2t + 1 (the lane's accumulator columns)
    pz = [[shfl_idx(head_totals(x), 8 * t + 4 * e, interpret=interpret) for e in (0, 1)]
          for x in pz]  # fmt: skip
    ls = head_totals(ls)
    for h in range(n_rep):
        m_ref[h] = m[h]
        l_ref[h] = jnp.sum(jnp.where(lane == 4 * h, ls, 0.0)) + l_tail[h]
    out_head = [2 * t + e for e in (0, 1)]  # the lane's accumulator columns
    stored = [x < n_rep for x in out_head]  # (a masked lane's index, past the block, unused)
    for (g, u), regs in zip(tiles, acc, strict=True):
        f0, f1 = fields[u]
        for r, (f, e) in enumerate([(f0, 0), (f0, 1), (f1, 0), (f1, 1)]):
            channel = (first_byte[g] + (u if vpb == 2 else 0)) * vpb + f
            value = regs[r] * 2.0 ** (-bits * f) + pz[g][e]
            plgpu.store(o_ref.at[out_head[e], channel], value, mask=stored[e])


def gqa_weighted_values(
    q, scores, block_max, v_codes, v_scale, v_zero, k_residual, v_residual, lengths,
    table=None, *, q_scale, bits, group_size, splits, blocks, tokens_per_split, interleave,
    tail_slots, max_chunk, prefetch, interpret, sliding_keys=False,
):  # fmt: skip
    """q [B, H, n_rep, D], scores [B, H, slots, C] and block_max [B, H, slots, Pm] (either
    score kernel's; slot h < n_rep read), v_codes uint8 [B, H, C, D / vpb], v_scale / v_zero
    [B, H, C, D / G], k_residual / v_residual [B, H, R, D] -> as `gpu.weighted_values`: per
    split its max m [B, H, n_rep, S], the sums over its quantized values and over its tail
    share [B, H, n_rep, S, D], and the weights' sum [B, H, n_rep, S]. S = `splits` programs
    per (sequence, KV head), `blocks` blocks of 16 tokens per iteration, tokens_per_split (a
    multiple of 16 blocks) tokens each, their loads `prefetch` iterations ahead; the tail in
    chunks of `tail_slots` ring slots, the maxima read `max_chunk` at a time. table: None; or
    int32 [B, Mp], the values a pool of pages [Pp, H, ps, .] (kivi_jax.paged), C = Mp * ps,
    16 * blocks dividing ps: each tile read from its page (`pages`). sliding_keys: as
    `gpu.weighted_values`."""
    B, H, n_rep, D = q.shape
    reason = supported_reason(n_rep=n_rep, group_size=group_size, head_dim=D, v_bits=bits)
    if reason is not None:
        raise NotImplementedError(reason)
    slots, C = scores.shape[2:]
    Pm, R = block_max.shape[3], k_residual.shape[2]
    G, vpb = group_size, 8 // bits
    lead = (B, H) if table is None else (v_codes.shape[0], H)  # rows, or pages
    n = v_codes.shape[2]  # tokens a row or a page holds
    words = lax.bitcast_convert_type(v_codes.reshape(*lead, n, D // vpb // 4, 4), jnp.int32)
    pairs = lambda x: lax.bitcast_convert_type(x.reshape(*lead, n, D // G // 2, 2), jnp.int32)
    whole = lambda b, h, s: (b, h, 0, 0)
    kernel = functools.partial(
        _kernel,
        bits=bits,
        splits=splits,
        blocks=blocks,
        tokens_per_split=tokens_per_split,
        interleave=interleave,
        tail_slots=tail_slots,
        max_chunk=max_chunk,
        q_scale=q_scale,
        param_dtype=v_scale.dtype,
        prefetch=prefetch,
        interpret=interpret,
        sliding_keys=sliding_keys,
    )
    if table is None:
        value_specs = [
            pl.BlockSpec((None, None, C, D // vpb // 4), whole),
            pl.BlockSpec((None, None, C, D // G // 2), whole),
            pl.BlockSpec((None, None, C, D // G // 2), whole),
        ]
        table_specs, tables = [], ()
    else:  # the KV head's whole pool; each tile's page from the table
        if n % (BLOCK * blocks):
            raise ValueError(f"page_size={n}: tiles of {BLOCK * blocks} tokens must divide it")
        Pp = lead[0]
        kernel = pages.table_first(kernel, per_page=n, pages=Pp)
        pool = lambda b, h, s: (0, h, 0, 0)
        value_specs = [
            pl.BlockSpec((Pp, None, n, D // vpb // 4), pool),
            pl.BlockSpec((Pp, None, n, D // G // 2), pool),
            pl.BlockSpec((Pp, None, n, D // G // 2), pool),
        ]
        table_specs, tables = [pages.table_spec(table)], (table,)
    return pl.pallas_call(
        kernel,
        grid=(B, H, splits),
        in_specs=[
            *table_specs,
            pl.BlockSpec((None,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, None, slots, Pm), whole),
            pl.BlockSpec((None, None, slots, C), whole),
            *value_specs,
            pl.BlockSpec((None, None, n_rep, D), whole),
            pl.BlockSpec((None, None, R, D), whole),
            pl.BlockSpec((None, None, R, D), whole),
        ],
        out_specs=[  # the heads' rows of split s (no transpose before `_merge_splits`)
            pl.BlockSpec((None, None, n_rep, None), lambda b, h, s: (b, h, 0, s)),
            pl.BlockSpec((None, None, n_rep, None, D), lambda b, h, s: (b, h, 0, s, 0)),
            pl.BlockSpec((None, None, n_rep, None, D), lambda b, h, s: (b, h, 0, s, 0)),
            pl.BlockSpec((None, None, n_rep, None), lambda b, h, s: (b, h, 0, s)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, n_rep, splits), jnp.float32),
            jax.ShapeDtypeStruct((B, H, n_rep, splits, D), jnp.float32),
            jax.ShapeDtypeStruct((B, H, n_rep, splits, D), jnp.float32),
            jax.ShapeDtypeStruct((B, H, n_rep, splits), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="kivi_values_mma" if table is None else "kivi_values_mma_paged",
    )(
        *tables, lengths, block_max, scores, words, pairs(v_scale), pairs(v_zero), q,
        k_residual, v_residual,
    )  # fmt: skip
