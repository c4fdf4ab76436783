"""GQA key scores on tensor cores: a KV head's codes unpacked once for all its query heads.

With grouped-query attention the n_rep query heads of a KV head read the same key codes. The
CUDA-core score kernel (`gpu.key_scores`) runs one program per query head, so its work grows
with the query heads. Here one program (one warp) per (sequence, KV head, tile of key groups)
scores all n_rep <= 8 heads at once with `mma.sync.m16n8k16` (f16 operands, f32 sums):

    S[t, h] = sum_d c_td (q_hd s_gd) + sum_d q_hd z_gd      (k_td = s_gd c_td + z_gd)

* A (16 x 16, rows = tokens, k = channels): the tile's key codes, unpacked in registers into
  f16 pairs. A key word holds 4 channels of `8 // bits` tokens (one field per token). The
  mma's k is mapped to channels so that a lane's 4 k of a chunk are the 4 channels of one
  word: each lane loads whole words of its own (none twice: with k = channels in order, two
  lanes loaded each word and a load touched 8 bytes of each of 8 rows), in the order bytes
  0, 2, 1, 3: the word holds bytes 0 and 2 in its halves' low bytes, the word shifted right
  by 8 bytes 1 and 3, so a register is one mask of one of them (`code_operand`, one LOP3;
  one shift a word, no byte moved). The mask ORs in the exponent of 1024: the f16 number
  1024 + c * 2**(bits*j) in each half, exact. The 1024s' share of the sums,
  1024 sum_d (q_hd s_gd), the same for every token of a group, is taken off once per group:
  the accumulators start from an mma of B with a constant A of -1024 (8 mma a group at
  D = 128 instead of an HSUB2 per A register, 64; the cancellation costs the float32 sums
  about 10 of their 24 bits: estimated errors ~2**-14 of sum_d |q_hd s_gd|, below the f16
  rounding of B; the GPU tests hold it to the reference).
  Rows g and g + 8 of a fragment are fields j and j + 1 of the same word.
* B (16 x 8, k = channels, n = heads): the query folded into the group's per-channel scales,
  q_hd s_gd, in f16 (relative error 2**-11 per term, sums in float32); heads past n_rep are 0.
  A group's scale and zero-point words are read by whole-warp loads (lane l: word l + 32 r)
  and handed to the lanes that need them by SHFL: 8 lanes share each word, and per-lane
  gathers of them held 32 registers of each group in flight, not 4.
* The field's 2**(bits*j) and the zero points' sum_d q_hd z_gd
  (summed over a head's 4 lanes by two butterfly shuffles) are applied to the accumulators
  per row.

Every operand lives in registers as a [32]-shaped tensor whose element i sits on lane i (one
warp, Triton's 1-D blocked layout: the only layout in the kernel's TTGIR, which holds no layout
conversion and no shared memory), loaded lane by lane (gathers): the fragments are built
where the `mma` reads them, with nothing staged through shared memory (the layout conversion
that made a `pl.dot` kernel slow: docs/history.md, G1). The mma, LOP3, f16 packing and
shuffles are inline PTX (`ptx`); in interpret mode each has a jnp twin that computes the
warp's result on the 32 lanes, so the CPU tests check the fragment bookkeeping exactly.

Outputs as `gpu.key_scores`, but with `head_slots(n_rep)` head slots (lanes whose
accumulator columns lie past them store nothing: masked stores): logits [B, H, slots, C]
(base 2, of q * q_scale; defined for t < Qk, heads < n_rep) and each lane's maximum, 8 per
head and program [B, H, slots, 8 P]; the value kernel reads the first n_rep slots in place
(`gpu.weighted_values`). Each program's loop issues the loads of the key group `prefetch`
groups ahead of the one it computes (`loops.pipelined_loop`): without it the kernel was
latency-bound (docs/history.md, G8).

Supported: group_size 32, head_dim a multiple of 16, n_rep <= 8, k_bits 2 or 4,
bfloat16/float16 scales. Local SASS: `benchmarks/results/sass.md`; on the H200:
`benchmarks/results/attention.md` (docs/performance.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kivi_jax.pallas_kernels.decode_attention import loops, mixed, pages
from kivi_jax.pallas_kernels.decode_attention.ptx import (
    and_or,
    f16_halves,
    mma_m16n8k16,
    pack_f16x2,
    shfl_idx,
    shfl_xor,
)

GROUP_SIZE = 32  # the only key group size this kernel takes (two 16-row blocks per group)
MAX_HEADS = 8  # query heads per KV head: the mma's N
_MAGIC = 0x64006400  # 1024.0 in both f16 halves
_MINUS_MAGIC = 0xE400E400 - (1 << 32)  # -1024.0 in both f16 halves (as an int32)


def head_slots(n_rep: int) -> int:
    """Head slots of the logits for n_rep query heads: the next power of two (at most the
    mma's 8 columns; slot n_rep of 3 heads is written, unused)."""
    return min(MAX_HEADS, 1 << (n_rep - 1).bit_length())


def supported_reason(*, n_rep: int, group_size: int, head_dim: int, k_bits: int) -> str | None:
    """None if `gqa_key_scores` takes this configuration, else a sentence saying why not."""
    if n_rep > MAX_HEADS:
        return f"n_rep={n_rep}: the tensor-core score kernel takes at most {MAX_HEADS}"
    if group_size != GROUP_SIZE:
        return f"group_size={group_size}: the tensor-core score kernel takes {GROUP_SIZE}"
    if head_dim % 16:
        return f"head_dim={head_dim}: the tensor-core score kernel needs a multiple of 16"
    if k_bits not in (2, 4):
        return f"k_bits={k_bits}: the tensor-core score kernel takes 2 and 4"
    return None


def code_operand(x, mask, magic, *, interpret: bool):
    """The field that `mask` keeps in the low byte of each half of int32 [32] x, as an f16
    pair for the mma: ORed into 1024.0's mantissa (`magic`), the f16 number 1024 + field
    exactly, one LOP3 (the caller takes the 1024s off)."""
    return and_or(x, mask, magic, interpret=interpret)


def param_pair(w, dtype):
    """int32 [32] holding two 16-bit floats of `dtype` (lower channel low) -> (lo, hi) f32."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        f32 = lambda bits: lax.bitcast_convert_type(bits, jnp.float32)
        return f32(w << 16), f32(w & -65536)
    return f16_halves(w)


def _kernel(
    len_ref,  # []               int32
    q_ref,  # [n_rep, D]         the queries of one KV head (their dtype; times q_scale here)
    ks_ref,  # [C/G, D/2]        int32 key scales, channels 2i and 2i + 1 per word
    kz_ref,  # [C/G, D/2]        int32 key zero points, likewise
    kw_ref,  # [C/kpb, D/4]      int32 key words: token byte, channel quad
    s_ref,  # out [slots, C]     f32 logits, head slot h, token t
    m_ref,  # out [slots, M]     f32 max of lane (g, t)'s logits of head slot 2t + e at
    #                              [2t + e, 8 p + g] (program p); -1e30 at [., 8 P, M)
    *,
    n_rep: int,
    bits: int,
    residual_length: int,
    program_groups: int,
    prefetch: int,
    q_scale: float,
    param_dtype,
    interpret: bool,
    table: pages.RowPages | None = None,
    fine=None,  # (fine words [C/kpb, Fp/4] int32, weights [n_rep, C/G, Fp] f32): `mixed.fine_last`
):
    slots = s_ref.shape[0]
    D = q_ref.shape[1]
    G, kpb = GROUP_SIZE, 8 // bits
    GB = G // kpb  # token bytes per key group
    lane = lax.broadcasted_iota(jnp.int32, (32,), 0)
    g, t = lane // 4, lane % 4  # the lane's A rows g, g + 8 and B column (head) g
    # The mma's k (16 per chunk c of 16 channels) is ours to map to channels: lane t's k
    # 2t, 2t + 1, 2t + 8, 2t + 9 are the channels 16c + 4t + {0, 2, 1, 3} of key word 4c + t
    # of a token byte (its bytes 0, 2, 1, 3), so that each lane loads whole words of its own
    # and none twice, and a mask keeps a field of two of them in the two halves' low bytes
    # with no byte moved: bytes 0 and 2 of the word itself, bytes 1 and 3 of the word shifted
    # right by 8 (one shift a word). k_order: the lane's channels 16c + 4t + {0, 1, 2, 3}
    # (index 4c + o) in k order. B: those channels of chunk c, head g (0 past n_rep)
    k_order = [4 * c + o for c in range(D // 16) for o in (0, 2, 1, 3)]
    chans = [16 * (x // 4) + 4 * t + x % 4 for x in k_order]
    # The same as pairs (words of two channels): pairs 8c + 2t + {0, 1}. A group's D / 2 scale
    # (and zero-point) words are loaded once by the warp, lane l holding word l + 32 r of load r
    # (wrapped below D / 2), and each lane takes its pairs from the lane that loaded them.
    n_pairs = D // 2
    param_loads = [(lane + 32 * r) % n_pairs for r in range(pl.cdiv(n_pairs, 32))]
    pair_src = [(c // 4, 8 * (c % 4) + 2 * t + o) for c in range(D // 16) for o in (0, 1)]
    head = jnp.minimum(g, n_rep - 1)
    q = [jnp.where(g < n_rep, q_ref[head, ch].astype(jnp.float32) * q_scale, 0.0) for ch in chans]
    magic = jnp.full((32,), _MAGIC, jnp.int32)
    minus_magic = jnp.full((32,), _MINUS_MAGIC, jnp.int32)
    field_masks = [  # field f of both halves' low bytes
        jnp.full((32,), (((1 << bits) - 1) << (bits * f)) * 0x00010001, jnp.int32)
        for f in range(8 // bits)
    ]
    # The lane's accumulator columns 2t, 2t + 1 are head slots; those past `slots` are
    # computed (the mma's 8 columns) but not stored.
    out_slot = [2 * t + e for e in (0, 1)]
    stored = [x < slots for x in out_slot] if slots < MAX_HEADS else [None, None]
    length = len_ref[()]
    qk_groups = (length - length % residual_length) // G
    g0 = pl.program_id(2) * program_groups
    n_groups = jnp.clip(qk_groups - g0, 0, program_groups)
    last_group = s_ref.shape[1] // G - 1
    # row blocks of 16 tokens: (which of the lane's token bytes, field of row g; row g + 8
    # has the next field); at 2 bits both blocks read the same token byte's words
    token_bytes = [g] if bits == 2 else [g, 8 + g]  # of row g, within the group
    blocks = [(0, 0), (0, 2)] if bits == 2 else [(0, 0), (1, 0)]
    # The fine channels (a mixed state): one more k chunk of 16 per 16 fine channels, mapped
    # as the keys' channels are (lane t: fine channels 16c + 4t + {0, 2, 1, 3} of fine word
    # 4c + t), added into the same accumulators.
    fine_chunks = 0 if fine is None else fine[0].shape[1] // 4
    fine_order = [16 * c + 4 * t + o for c in range(fine_chunks) for o in (0, 2, 1, 3)]

    def load(i):
        """Group g0 + i's scale and zero-point pairs and key words of this lane (a group past
        the capacity clamped into it: loaded, not used)."""
        gi = jnp.minimum(g0 + i, last_group)
        at, lg = ((), gi) if table is None else _in_page(table, gi)
        words = [
            kw_ref[(*at, lg * GB + tb, 4 * c + t)] for tb in token_bytes for c in range(D // 16)
        ]
        params = [[r[(*at, lg, w)] for w in param_loads] for r in (ks_ref, kz_ref)]
        if fine is None:
            return *params, words
        fw_ref, weight_ref = fine
        fine_words = [
            fw_ref[gi * GB + tb, 4 * c + t] for tb in token_bytes for c in range(fine_chunks)
        ]
        return *params, words, fine_words, [weight_ref[head, gi, f] for f in fine_order]

    def compute(i, tile, maxima):
        gi = g0 + i
        if fine is None:
            *params, words = tile
        else:
            *params, words, fine_words, weights = tile
            fine_b = [
                pack_f16x2(*(jnp.where(g < n_rep, w, 0.0) for w in weights[k : k + 2]),
                           interpret=interpret)
                for k in range(0, len(weights), 2)
            ]  # fmt: skip
            fine_halves = [y for x in fine_words for y in (x, lax.shift_right_logical(x, 8))]
        ks, kz = ([shfl_idx(x[r], src, interpret=interpret) for r, src in pair_src] for x in params)
        s, z = ([v for w in x for v in param_pair(w, param_dtype)] for x in (ks, kz))
        s, z = [s[x] for x in k_order], [z[x] for x in k_order]
        b = [
            pack_f16x2(q[k] * s[k], q[k + 1] * s[k + 1], interpret=interpret)
            for k in range(0, len(q), 2)
        ]  # b[2c], b[2c + 1]: chunk c's B fragment
        bias = functools.reduce(jnp.add, [x * y for x, y in zip(q, z, strict=True)])
        bias = bias + shfl_xor(bias, 1, interpret=interpret)
        bias = bias + shfl_xor(bias, 2, interpret=interpret)  # head g's sum_d q_d z_gd
        bias = [shfl_idx(bias, 8 * t + 4 * e, interpret=interpret) for e in (0, 1)]  # 2t + e
        # bytes (0, 2) and (1, 3) of each word in the halves' low bytes: k 2t, 2t + 1 and
        # 2t + 8, 2t + 9
        halves = [y for x in words for y in (x, lax.shift_right_logical(x, 8))]
        start = [jnp.zeros((32,), jnp.float32)] * 4
        for c in range(D // 16):  # -1024 sum_d B[d, n] on every row
            start = mma_m16n8k16(
                [minus_magic] * 4, b[2 * c : 2 * c + 2], start, interpret=interpret
            )
        for c in range(fine_chunks):
            start = mma_m16n8k16(
                [minus_magic] * 4, fine_b[2 * c : 2 * c + 2], start, interpret=interpret
            )
        maxima = list(maxima)
        for n, j in blocks:
            masks = [field_masks[f] for f in (j, j + 1)]
            row_words = halves[2 * (D // 16) * n :]
            acc = start
            for c in range(D // 16):
                a = [
                    code_operand(y, m, magic, interpret=interpret)
                    for y in row_words[2 * c : 2 * c + 2]
                    for m in masks
                ]  # a[0]: row g, a[1]: row g + 8 (field j + 1), a[2], a[3]: k + 8
                acc = mma_m16n8k16(a, b[2 * c : 2 * c + 2], acc, interpret=interpret)
            for c in range(fine_chunks):  # the fine codes, fields j and j + 1 likewise
                row_words = fine_halves[2 * fine_chunks * n :]
                a = [
                    code_operand(y, m, magic, interpret=interpret)
                    for y in row_words[2 * c : 2 * c + 2]
                    for m in masks
                ]
                acc = mma_m16n8k16(a, fine_b[2 * c : 2 * c + 2], acc, interpret=interpret)
            for r, (field, e) in enumerate([(j, 0), (j, 1), (j + 1, 0), (j + 1, 1)]):
                score = acc[r] * 2.0 ** (-bits * field) + bias[e]
                token = gi * G + kpb * token_bytes[n] + field
                plgpu.store(s_ref.at[out_slot[e], token], score, mask=stored[e])
                maxima[e] = jnp.maximum(maxima[e], score)
        return tuple(maxima)

    init = jnp.full((32,), loops.NEG_INIT, jnp.float32)
    live = lambda i: i < n_groups
    maxima = loops.pipelined_loop(n_groups, prefetch, load, compute, (init, init), live)
    programs = pl.num_programs(2)
    column = 8 * pl.program_id(2) + g
    pad = 8 * programs + column  # program p also fills pad columns 8 (P + p) + g below M
    in_pad = pad < m_ref.shape[1]
    for e in (0, 1):
        plgpu.store(m_ref.at[out_slot[e], column], maxima[e], mask=stored[e])
        keep = in_pad if stored[e] is None else in_pad & stored[e]
        plgpu.store(m_ref.at[out_slot[e], pad], init, mask=keep)


def _in_page(table: pages.RowPages, unit):
    """((page,), unit within it): `RowPages.locate` as an index prefix."""
    page, at = table.locate(unit)
    return (page,), at


def gqa_key_scores(
    q, k_codes, k_scale, k_zero, lengths, table=None, fine=None, *, q_scale, bits, group_size,
    residual_length, program_groups, prefetch, interpret,
):  # fmt: skip
    """q [B, H, n_rep, D] (any float dtype; logits of q * q_scale), k_codes uint8
    [B, H, C / kpb, D], k_scale / k_zero [B, H, C / G, D] -> logits [B, H, slots, C] (head
    slots, `head_slots(n_rep)`; those below n_rep defined for t < Qk) and maxima
    [B, H, slots, M] (8 per program, P programs of `program_groups` key groups per row,
    their loads issued `prefetch` groups ahead; -1e30 where a lane held no logit; M = 8 P
    rounded up to a power of two, the columns past 8 P -1e30, so that a value program reads
    them in one load where M <= 1024). table: None; or int32 [B, Mp], the keys a pool of pages
    (kivi_jax.paged: k_codes [Pp, H, ps / kpb, D], k_scale / k_zero [Pp, H, ps / G, D]),
    C = Mp * ps, each group read from its page (`pages`). fine: None, or a mixed state's fine
    key channels (`mixed.FineChannels`, contiguous keys only), added to the logits and maxima
    (the weights as f16 B operands: relative error 2**-11 of each term)."""
    B, H, n_rep, D = q.shape
    reason = supported_reason(n_rep=n_rep, group_size=group_size, head_dim=D, k_bits=bits)
    if reason is not None:
        raise NotImplementedError(reason)
    kpb = 8 // bits
    G = group_size
    C = k_codes.shape[2] * kpb if table is None else table.shape[1] * k_codes.shape[2] * kpb
    P = pl.cdiv(C // G, program_groups)
    M = 1 << (8 * P - 1).bit_length()
    slots = head_slots(n_rep)
    lead = (B, H) if table is None else (k_codes.shape[0], H)  # rows, or pages
    n = k_codes.shape[2] * kpb  # tokens a row or a page holds
    words = lax.bitcast_convert_type(k_codes.reshape(*lead, n // kpb, D // 4, 4), jnp.int32)
    pairs = lambda x: lax.bitcast_convert_type(x.reshape(*lead, n // G, D // 2, 2), jnp.int32)
    whole = lambda b, h, p: (b, h, 0, 0)
    kernel = functools.partial(
        _kernel,
        n_rep=n_rep,
        bits=bits,
        residual_length=residual_length,
        program_groups=program_groups,
        prefetch=prefetch,
        q_scale=q_scale,
        param_dtype=k_scale.dtype,
        interpret=interpret,
    )
    if table is None:
        key_specs = [
            pl.BlockSpec((None, None, C // G, D // 2), whole),
            pl.BlockSpec((None, None, C // G, D // 2), whole),
            pl.BlockSpec((None, None, C // kpb, D // 4), whole),
        ]
        table_specs, tables = [], ()
    else:  # the KV head's whole pool; each group's page from the table
        Pp, gpp = lead[0], n // G
        kernel = pages.table_first(kernel, per_page=gpp, pages=Pp)
        pool = lambda b, h, p: (0, h, 0, 0)
        key_specs = [
            pl.BlockSpec((Pp, None, gpp, D // 2), pool),
            pl.BlockSpec((Pp, None, gpp, D // 2), pool),
            pl.BlockSpec((Pp, None, n // kpb, D // 4), pool),
        ]
        table_specs, tables = [pages.table_spec(table)], (table,)
    name = "kivi_scores_mma" if table is None else "kivi_scores_mma_paged"
    fine_specs, fines = [], ()
    if fine is not None:
        if table is not None:
            raise ValueError("the fine key channels are read from the contiguous state")
        Fp = fine.codes.shape[3]
        kernel = mixed.fine_last(kernel)
        fine_specs = [
            pl.BlockSpec((None, None, C // kpb, Fp // 4), whole),
            pl.BlockSpec((None, None, n_rep, C // G, Fp), lambda b, h, p: (b, h, 0, 0, 0)),
        ]
        fines = (
            lax.bitcast_convert_type(fine.codes.reshape(B, H, C // kpb, Fp // 4, 4), jnp.int32),
            fine.weights,
        )
        name = "kivi_scores_mma_fine"
    return pl.pallas_call(
        kernel,
        grid=(B, H, P),
        in_specs=[
            *table_specs,
            pl.BlockSpec((None,), lambda b, h, p: (b,)),
            pl.BlockSpec((None, None, n_rep, D), whole),
            *key_specs,
            *fine_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, slots, C), whole),
            pl.BlockSpec((None, None, slots, M), whole),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, slots, C), jnp.float32),
            jax.ShapeDtypeStruct((B, H, slots, M), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name=name,
    )(*tables, lengths, q, pairs(k_scale), pairs(k_zero), words, *fines)
