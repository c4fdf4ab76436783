"""KIVI decode attention on a TPU: one Pallas (Mosaic) kernel over the packed state.

One decode step: for each sequence ``b`` and query head ``h`` (KV head ``h // n_rep``)

    out[b, h] = softmax_t(q[b, h] . K_t / sqrt(D)) @ V   over t in [0, lengths[b])

Grid ``(B, H, blocks)``: a program holds one KV head's ``n_rep`` query heads (GQA: each KV block
is read from HBM once for the whole query group) and walks the capacity in blocks of
``TpuTuning.block_tokens`` tokens, which Pallas copies into VMEM (double-buffered) and the
kernel computes in chunks of ``chunk_tokens``. The lengths come in by scalar prefetch; the block
index maps clamp each block index to the last block a sequence needs, so the blocks past its
length are never copied again (Pallas skips a copy whose block index has not changed). Over a
page pool (kivi_jax.paged) the table is a second scalar-prefetch operand and the index maps
turn a row's block index into (its page, the block within the page): the same kernel body.

Token regions of a sequence of length ``l`` (``kivi_jax.cache``): keys of ``[0, Qk)``,
``Qk = l - l % R``, and values of ``[0, Pv)``, ``Pv = max(l - R, 0)``, are quantized; the rest
are in the residual rings (token ``t`` at slot ``t % R``).

* Main loop, tokens ``[0, Pv)`` (quantized keys and values), per chunk of ``n`` tokens:

  - keys: the chunk's ``uint8 [n / kpb, D]`` codes are read as int32 words
    (``pltpu.bitcast``: word ``w`` holds packed rows ``4w .. 4w + 3``, row ``4w + r`` in byte
    ``r``), so byte ``r``, field ``j`` of word row ``w`` is the code of token
    ``4 kpb w + kpb r + j``. Each of the ``4 kpb`` (byte, field) planes is shifted, masked,
    converted to float32 and stored with a sublane stride of ``4 kpb`` into a VMEM scratch
    ``[n, D]`` in token order, where one scale and zero row covers ``G`` consecutive rows:
    ``K = codes * scale + zero``. Scores ``s = (q / sqrt(D)) . K`` on the MXU, ``[n_rep, n]``.
  - values: the ``uint8 [n, D / vpb]`` codes as words hold 4 tokens each (byte ``b``: token
    ``4w + b``); plane (byte ``b``, field ``j``) goes with a sublane stride of 4 into lanes
    ``[j D / vpb, (j + 1) D / vpb)`` of a scratch ``[n, D]``, so that rows are tokens and lane
    ``j D / vpb + i`` holds channel ``vpb i + j`` (a fixed permutation of the channels, undone
    once at the end): whole 128-lane rows for the arithmetic and one product, although a token's
    codes are only ``D / vpb`` bytes. Each token's scales and zero points are spread over the
    lanes of their channels by an exact 0/1 product, and ``V = codes * scale + zero``.
  - online softmax: the running max ``m``, the sum ``l`` and the accumulator ``acc += p @ V``
    (``[n_rep, D]``, permuted channels) live in VMEM scratch across the grid steps.

* Tail, at the last grid step, the R ring slots: slot ``s`` holds token
  ``t(s) = Pv + (s - Pv) mod R`` (held if ``t(s) < l``) with its value in ``v_residual[s]``; its
  key is ``k_residual[s]`` if ``t(s) >= Qk``, else quantized. Those quantized keys,
  ``[Pv, Qk)``, lie in ``[Qk - R, Qk)``, which is inside one chunk of the last key block (the
  chunk and the block are multiples of R), still in VMEM: the tail dequantizes that chunk again,
  takes its scores of ``[Pv, Qk)`` and folds them onto their slots (an exact 0/1 product:
  token ``t`` of the chunk to slot ``t % R``). Then ``out = (acc U + w @ v_residual) / l`` with
  ``w`` the slots' softmax weights and ``U`` the 0/1 matrix that undoes the channel permutation.
  A sequence of length 0 gives zeros.

Dequantization, the softmax and every sum are float32. The products over the tokens (scores,
values, the scales' spread) take their operands in `mxu_dtype`: bfloat16 for a bfloat16 cache
(one MXU pass, float32 sums: the roundings of a plain bfloat16 attention; a decode step has only
n_rep query rows, so each pass streams every key and value row through the MXU once), float32
at ``Precision.HIGHEST`` for a float16 cache (the MXU has no float16). The tail's 0/1 products
(fold, unspread) are exact float32. The output is rounded to the query's dtype. Rows past a
sequence's regions (and the garbage of a last block that runs past the capacity) are masked
before they meet a product, so they never turn a result into NaN.

Supported (``supported_config_reason``): k_bits, v_bits in {2, 4}; G a multiple of 16
dividing D; D in {64, 128}; bfloat16 or float16 caches.

Not measured: no TPU was available to the project. The kernel runs in TPU interpret mode on the
CPU (tests/test_decode_attention_tpu.py) and lowers to Mosaic there; the Mosaic compiler's own
checks (vector layouts, strided stores) run only on a TPU. docs/tpu.md gives the floor on paper.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kivi_jax.pallas_kernels.decode_attention import state

_NEG_INIT = -1e30  # running-max start: finite, so an empty row never computes inf - inf
_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuTuning:
    """Block sizes of the TPU kernel (no effect on results beyond float32 summation order).

    block_tokens: tokens per grid step, copied into VMEM as one block of every state array.
    chunk_tokens: tokens computed at a time inside a block.

    Both are rounded up (`tiles`): the chunk to a multiple of R and of the TPU tiling unit
    (`tiling_unit`: 512 tokens at G = 32), the block to a multiple of the chunk, and the block
    is never larger than the capacity rounded up to the chunk. The defaults are not tuned (no
    TPU was available): a TPU user should sweep them (README, docs/tpu.md).
    """

    block_tokens: int = 2048
    chunk_tokens: int = 512

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TpuTuning.{f.name} must be a positive int, got {v!r}")


def tiling_unit(*, k_bits: int, group_size: int) -> int:
    """Tokens a chunk must be a multiple of so that every slice of it is whole TPU tiles: the key
    codes' 8-bit rows in tiles of 32 (32 * kpb tokens), the key scales' 16-bit rows in tiles of
    16 (16 G tokens), the scores' lanes in tiles of 128."""
    return math.lcm(32 * (8 // k_bits), 16 * group_size, 128)


def tiles(
    tuning: TpuTuning, *, capacity: int, k_bits: int, group_size: int, residual_length: int
) -> tuple[int, int]:
    """(block, chunk) in tokens, as `TpuTuning` says: chunk a multiple of R and of the tiling
    unit, block a multiple of the chunk and at most the capacity rounded up to the chunk."""
    unit = math.lcm(tiling_unit(k_bits=k_bits, group_size=group_size), residual_length)
    chunk = -(-tuning.chunk_tokens // unit) * unit
    block = -(-tuning.block_tokens // chunk) * chunk
    return min(block, -(-capacity // chunk) * chunk), chunk


def supported_config_reason(
    *, k_bits: int, v_bits: int, group_size: int, head_dim: int, dtype
) -> str | None:
    """None if the TPU kernel supports this configuration, else a sentence saying why not."""
    if k_bits not in (2, 4) or v_bits not in (2, 4):
        return f"k_bits={k_bits}, v_bits={v_bits}: the TPU kernel supports 2 and 4 bits"
    if head_dim not in (64, 128):
        return f"head_dim={head_dim}: the TPU kernel supports 64 and 128"
    if group_size % 16 or head_dim % group_size:
        return (
            f"group_size={group_size}: the TPU kernel needs a multiple of 16 that divides "
            f"head_dim={head_dim}"
        )
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cache dtype {jnp.dtype(dtype)}: the TPU kernel supports bfloat16 and float16"
    return None


def _div(a, b):
    """a // b for non-negative ints (lax.div: jnp's // adds sign handling Mosaic cannot lower)."""
    return lax.div(a, jnp.int32(b))


def _rem(a, b):
    """a % b for non-negative ints."""
    return lax.rem(a, jnp.int32(b))


def _regions(length, residual_length: int):
    """(Qk, Pv): quantized keys [0, Qk), quantized values [0, Pv) of a sequence of `length`."""
    return length - _rem(length, residual_length), jnp.maximum(length - residual_length, 0)


def _last_block(n_tokens, block: int):
    """Index of the block holding token n_tokens - 1 (0 when there is none)."""
    return _div(jnp.maximum(n_tokens - 1, 0), block)


def mxu_dtype(cache_dtype):
    """The dtype of the operands of the kernel's products over the tokens: bfloat16 for a
    bfloat16 cache (one MXU pass, float32 sums: the rounding of a plain bfloat16 attention),
    float32 otherwise (Precision.HIGHEST: the MXU has no float16)."""
    return jnp.bfloat16 if jnp.dtype(cache_dtype) == jnp.bfloat16 else jnp.float32


def _dot(a, b, dtype, *, transpose_b: bool = False):
    """a @ b (a [m, k], b [k, n]) or a @ b.T (b [n, k]) -> float32 [m, n], the operands rounded
    to `dtype`; float32 operands at Precision.HIGHEST (exact float32 products)."""
    dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
    precision = _HI if dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a.astype(dtype), b.astype(dtype), dims, precision=precision,
                           preferred_element_type=jnp.float32)  # fmt: skip


def _exact(a, b):
    """a @ b in float32 at Precision.HIGHEST, for the 0/1 matrices of the tail (exact)."""
    return _dot(a, b, jnp.float32)


def _zero_one(shape, cond):
    """float32 0/1 matrix of `shape`: 1 where cond(row index, column index)."""
    rows = lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = lax.broadcasted_iota(jnp.int32, shape, 1)
    return cond(rows, cols).astype(jnp.float32)


def spread_matrix(*, head_dim: int, group_size: int, v_bits: int):
    """[D / G, D]: 1 where lane j D / vpb + i of the value scratch (channel vpb i + j) is in
    group g, so that scale [n, D / G] @ it is each token's scale on the lanes of its channels."""
    width, vpb = head_dim // (8 // v_bits), 8 // v_bits
    lanes = group_size // vpb  # lanes of one group within a plane
    return _zero_one(
        (head_dim // group_size, head_dim), lambda g, c: _div(_rem(c, width), lanes) == g
    )


def unspread_matrix(*, head_dim: int, v_bits: int):
    """[D, D]: 1 at (j D / vpb + i, vpb i + j), so that x @ it puts the value scratch's lanes
    back in channel order."""
    width, vpb = head_dim // (8 // v_bits), 8 // v_bits
    return _zero_one((head_dim, head_dim), lambda c, d: d == vpb * _rem(c, width) + _div(c, width))


def fold_matrix(*, tokens: int, residual_length: int):
    """[tokens, R]: 1 at (u, u % R), so that p @ it adds the weight of token u of a chunk that
    starts at a multiple of R to its ring slot."""
    return _zero_one((tokens, residual_length), lambda u, s: _rem(u, residual_length) == s)


def _repeat_rows(x, times: int):
    """[m, D] -> [m * times, D], each row `times` times (sublane broadcasts: times % 8 == 0)."""
    m, d = x.shape
    return jnp.broadcast_to(x[:, None, :], (m, times, d)).reshape(m * times, d)


def _keys(kc_ref, ks_ref, kz_ref, k_scr, c, *, n: int, bits: int, group_size: int):
    """Chunk c of the key block, dequantized: float32 [n, D] in token order."""
    kpb, G = 8 // bits, group_size
    rows = n // kpb  # packed uint8 rows of the chunk
    start = pl.multiple_of(c * rows, rows)
    words = pltpu.bitcast(kc_ref[pl.ds(start, rows), :], jnp.int32)  # [n / (4 kpb), D]
    per_plane = n // (4 * kpb)
    for r in range(4):  # byte r of word row w: packed row 4w + r
        for j in range(kpb):  # field j of that row: token kpb (4w + r) + j
            codes = lax.shift_right_logical(words, 8 * r + bits * j) & ((1 << bits) - 1)
            k_scr[pl.ds(kpb * r + j, per_plane, stride=4 * kpb), :] = codes.astype(jnp.float32)
    groups = n // G
    g0 = pl.multiple_of(c * groups, groups)
    scale = _repeat_rows(ks_ref[pl.ds(g0, groups), :].astype(jnp.float32), G)  # [n, D]
    zero = _repeat_rows(kz_ref[pl.ds(g0, groups), :].astype(jnp.float32), G)
    return k_scr[...] * scale + zero


def _values(vc_ref, vs_ref, vz_ref, v_scr, c, *, n: int, bits: int, group_size: int, mxu):
    """Chunk c of the value block, dequantized: float32 [n, D] in token order, lane
    j D / vpb + i holding channel vpb i + j."""
    vpb = 8 // bits
    D = v_scr.shape[-1]
    width = D // vpb  # bytes of a token
    start = pl.multiple_of(c * n, n)
    words = pltpu.bitcast(vc_ref[pl.ds(start, n), :], jnp.int32)  # [n / 4, D / vpb]
    for b in range(4):  # byte b of word row w: token 4w + b
        for j in range(vpb):  # field j of byte i of a token: channel vpb * i + j
            codes = lax.shift_right_logical(words, 8 * b + bits * j) & ((1 << bits) - 1)
            v_scr[pl.ds(b, n // 4, stride=4), pl.ds(j * width, width)] = codes.astype(jnp.float32)
    spread = spread_matrix(head_dim=D, group_size=group_size, v_bits=bits)
    # [n, D]; exact in `mxu` (the scales and zero points are in the cache dtype)
    scale = _dot(vs_ref[pl.ds(start, n), :], spread, mxu)
    zero = _dot(vz_ref[pl.ds(start, n), :], spread, mxu)
    return v_scr[...] * scale + zero


def _kernel(
    lengths_ref,  # SMEM int32 [B] (scalar prefetch)
    q_ref,  # [n_rep, D] float32, already times 1 / sqrt(D)
    kc_ref,  # uint8 [block / kpb, D]
    ks_ref,  # [block / G, D]
    kz_ref,
    vc_ref,  # uint8 [block, D / vpb]
    vs_ref,  # [block, D / G]
    vz_ref,
    kr_ref,  # [R, D]
    vr_ref,  # [R, D]
    o_ref,  # [n_rep, D]
    m_ref,  # scratch float32 [n_rep, 1]: running max
    l_ref,  # scratch float32 [n_rep, 1]: running sum of exp(s - m)
    acc_ref,  # scratch float32 [n_rep, D]: sum of p V over quantized values, permuted channels
    k_scr,  # scratch float32 [chunk, D]: key codes in token order
    v_scr,  # scratch float32 [chunk, D]: value codes in token order, permuted channels
    *,
    k_bits: int,
    v_bits: int,
    group_size: int,
    residual_length: int,
    block: int,
    chunk: int,
    mxu,
):
    b, i = pl.program_id(0), pl.program_id(2)
    R, n = residual_length, chunk
    length = lengths_ref[b]
    qk, pv = _regions(length, R)
    q = q_ref[...]
    # keys(c), values(c): chunk c of this step's key and value blocks, dequantized
    keys = functools.partial(_keys, kc_ref, ks_ref, kz_ref, k_scr, n=n, bits=k_bits,
                             group_size=group_size)  # fmt: skip
    values = functools.partial(_values, vc_ref, vs_ref, vz_ref, v_scr, n=n, bits=v_bits,
                               group_size=group_size, mxu=mxu)  # fmt: skip

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG_INIT, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def main_chunk(c, carry):
        t0 = i * block + c * n
        k = keys(c)  # [n, D]
        t = t0 + lax.broadcasted_iota(jnp.int32, (1, n), 1)  # [1, n] token of each lane
        s = jnp.where(t < pv, _dot(q, k, mxu, transpose_b=True), -jnp.inf)  # [n_rep, n]
        m_old = m_ref[...]
        m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_old - m_new)
        p = jnp.exp(s - m_new)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_new
        held = t0 + lax.broadcasted_iota(jnp.int32, (n, 1), 0) < pv  # [n, 1]
        v = jnp.where(held, values(c), 0.0)  # past the capacity a block holds garbage (NaN)
        acc_ref[...] = alpha * acc_ref[...] + _dot(p, v, mxu)
        return carry

    @pl.when(i * block < pv)
    def _main():
        n_chunks = jnp.minimum(_div(pv - i * block + n - 1, n), block // n)
        lax.fori_loop(0, n_chunks, main_chunk, 0)

    @pl.when(i == pl.num_programs(2) - 1)
    def _tail():
        # The chunk of the last key block that holds [Qk - R, Qk) (chunk 0 where Qk = 0).
        key_block = _last_block(qk, block)
        c = _div(jnp.maximum(qk - R, 0) - key_block * block, n)
        t = key_block * block + c * n + lax.broadcasted_iota(jnp.int32, (1, n), 1)  # [1, n]
        s_q = jnp.where((t >= pv) & (t < qk), _dot(q, keys(c), mxu, transpose_b=True), -jnp.inf)
        slot = lax.broadcasted_iota(jnp.int32, (1, R), 1)
        t_slot = pv + _rem(slot - _rem(pv, R) + R, R)  # [1, R] token held at each slot
        s_r = jnp.where((t_slot < length) & (t_slot >= qk),
                        _dot(q, kr_ref[...], mxu, transpose_b=True), -jnp.inf)  # fmt: skip
        m_old = m_ref[...]
        m_new = jnp.maximum(
            m_old,
            jnp.maximum(jnp.max(s_q, axis=1, keepdims=True), jnp.max(s_r, axis=1, keepdims=True)),
        )
        alpha = jnp.exp(m_old - m_new)
        fold = fold_matrix(tokens=n, residual_length=R)  # the chunk starts at a multiple of R
        w = _exact(jnp.exp(s_q - m_new), fold) + jnp.exp(s_r - m_new)  # [n_rep, R] slot weights
        total = alpha * l_ref[...] + jnp.sum(w, axis=1, keepdims=True)
        unspread = unspread_matrix(head_dim=acc_ref.shape[-1], v_bits=v_bits)
        out = _dot(w, vr_ref[...], mxu) + _exact(alpha * acc_ref[...], unspread)  # [n_rep, D]
        some = total > 0  # a sequence of length 0 gives zeros
        o_ref[...] = jnp.where(some, out / jnp.where(some, total, 1.0), 0.0).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("k_bits", "v_bits", "group_size", "residual_length", "tuning", "interpret"),
)
def kivi_decode_attention_tpu(
    q,  # [B, Hq, D]
    k_codes,  # uint8 [B, H, C // kpb, D]
    k_scale,  # [B, H, C // G, D]
    k_zero,
    v_codes,  # uint8 [B, H, C, D // vpb]
    v_scale,  # [B, H, C, D // G]
    v_zero,
    k_residual,  # [B, H, R, D]
    v_residual,  # [B, H, R, D]
    lengths,  # int32 [B]
    table=None,  # None, or int32 [B, M]: the arrays above with a token axis are pools of pages
    *,
    k_bits: int,
    v_bits: int,
    group_size: int,
    residual_length: int,
    tuning: TpuTuning = TpuTuning(),
    interpret: bool = False,
):
    """Decode attention over a KIVI state with the TPU kernel -> [B, Hq, D] in q's dtype.

    table: None, or the page table of a kivi_jax.paged pool (k_codes [P, H, ps / kpb, D],
    v_codes [P, H, ps, D / vpb], ..., C = M * ps): a scalar-prefetch operand beside the
    lengths, as in jax's `ops/tpu/paged_attention`; a grid step's block is a block of one page
    (the block must divide page_size), its page id read from the table by the block index
    maps, so the kernel itself is unchanged.
    interpret: run in Pallas TPU interpret mode (on the CPU; uninitialized memory is NaN, so a
    read that is not masked shows up in the result).
    """
    B, Hq, D = q.shape
    _, H, C, width = v_codes.shape  # width = D // vpb
    G, R = group_size, residual_length
    page_size = C
    if table is not None:
        C *= table.shape[1]
    reason = supported_config_reason(
        k_bits=k_bits, v_bits=v_bits, group_size=G, head_dim=D, dtype=k_residual.dtype
    )
    if reason is not None:
        raise NotImplementedError(reason)
    if Hq % H:
        raise ValueError(f"{Hq} query heads are not a multiple of {H} KV heads")
    if R % G or C % G:
        raise ValueError(f"residual_length={R} and capacity={C} must be multiples of G={G}")
    n_rep, kpb = Hq // H, 8 // k_bits
    block, chunk = tiles(tuning, capacity=C, k_bits=k_bits, group_size=G, residual_length=R)
    if table is not None:
        block = math.gcd(block, page_size)  # a block lies in one page
        if block % chunk:
            raise NotImplementedError(
                f"page_size={page_size}: the TPU kernel reads blocks of whole chunks of "
                f"{chunk} tokens (TpuTuning, `tiles`) within one page: a multiple of {chunk}"
            )
    qs = (q.astype(jnp.float32) / math.sqrt(D)).reshape(B, H, n_rep, D)

    def key_block(b, h, i, lengths_ref):
        qk, _ = _regions(lengths_ref[b], R)
        return jnp.minimum(i, _last_block(qk, block))

    def value_block(b, h, i, lengths_ref):
        _, pv = _regions(lengths_ref[b], R)
        return jnp.minimum(i, _last_block(pv, block))

    if table is None:
        scalars, blocks_of = (lengths,), lambda b, h, n, refs: (b, h, n, 0)
        kernel_of = lambda kernel: kernel
    else:  # block n of row b: block n % per_page of its page table[b, n // per_page]
        per_page, pages = page_size // block, k_codes.shape[0]

        def blocks_of(b, h, n, refs):
            page = jnp.minimum(refs[1][b, _div(n, per_page)], pages - 1)  # NO_PAGE: unused
            return page, h, _rem(n, per_page), 0

        scalars = (lengths, table)
        kernel_of = lambda kernel: lambda lengths_ref, table_ref, *refs: kernel(lengths_ref, *refs)

    per_head = lambda b, h, i, *refs: (b, h, 0, 0)
    keys = lambda rows: pl.BlockSpec(
        (None, None, rows, D),
        lambda b, h, i, *refs: blocks_of(b, h, key_block(b, h, i, refs[0]), refs),
    )
    values = lambda lanes: pl.BlockSpec(
        (None, None, block, lanes),
        lambda b, h, i, *refs: blocks_of(b, h, value_block(b, h, i, refs[0]), refs),
    )
    residual = pl.BlockSpec((None, None, R, D), per_head)
    kernel = functools.partial(
        _kernel, k_bits=k_bits, v_bits=v_bits, group_size=G, residual_length=R, block=block,
        chunk=chunk, mxu=mxu_dtype(k_residual.dtype),
    )  # fmt: skip
    out = pl.pallas_call(
        kernel_of(kernel),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(B, H, pl.cdiv(C, block)),
            in_specs=[
                pl.BlockSpec((None, None, n_rep, D), per_head),
                keys(block // kpb),
                keys(block // G),
                keys(block // G),
                values(width),
                values(D // G),
                values(D // G),
                residual,
                residual,
            ],
            out_specs=pl.BlockSpec((None, None, n_rep, D), per_head),
            scratch_shapes=[
                pltpu.VMEM((n_rep, 1), jnp.float32),
                pltpu.VMEM((n_rep, 1), jnp.float32),
                pltpu.VMEM((n_rep, D), jnp.float32),
                pltpu.VMEM((chunk, D), jnp.float32),
                pltpu.VMEM((chunk, D), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((B, H, n_rep, D), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="kivi_decode_tpu" if table is None else "kivi_decode_tpu_paged",
    )(*scalars, qs, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual, v_residual)
    return out.reshape(B, Hq, D)


def unsupported_reason(q: jax.Array, cache) -> str | None:
    """None if `decode_attention_pallas_tpu(q, cache)` runs, else what it does not support."""
    return state.unsupported_reason(
        cache, head_dim=q.shape[-1], dtype=cache.dtype, supported=supported_config_reason,
        reads_mixed=False,
    )  # fmt: skip


def decode_attention_pallas_tpu(
    q: jax.Array, cache, *, interpret: bool = False, tuning: TpuTuning = TpuTuning()
) -> jax.Array:
    """The TPU kernel over one layer's KiviCache: q [B, Hq, D] -> [B, Hq, D] in q's dtype."""
    reason = unsupported_reason(q, cache)
    if reason is not None:
        raise NotImplementedError(f"impl='pallas_tpu': {reason}")
    arrays, config = state.kernel_args(cache)
    return kivi_decode_attention_tpu(q, *arrays, **config, tuning=tuning, interpret=interpret)


def unsupported_paged_reason(q: jax.Array, paged, tuning: TpuTuning = TpuTuning()) -> str | None:
    """None if `decode_attention_pallas_tpu_paged(q, paged)` runs, else what it does not
    support."""
    reason = unsupported_reason(q, paged.rows)
    if reason is not None:
        return reason
    cfg = paged.rows.config
    _, chunk = tiles(tuning, capacity=paged.page_size, k_bits=cfg.k_bits,
                     group_size=cfg.group_size, residual_length=cfg.residual_length)  # fmt: skip
    if paged.page_size % chunk:
        return (
            f"page_size={paged.page_size}: the TPU kernel reads chunks of {chunk} tokens "
            "within one page: a multiple of it"
        )
    return None


def decode_attention_pallas_tpu_paged(
    q: jax.Array, paged, *, interpret: bool = False, tuning: TpuTuning = TpuTuning()
) -> jax.Array:
    """The TPU kernel over one layer's kivi_jax.paged.PagedCache, the table a scalar-prefetch
    operand (`kivi_decode_attention_tpu`): q [B, Hq, D] -> [B, Hq, D] in q's dtype. Plain
    KIVI; page_size a multiple of the kernel's chunk (512 tokens at G = 32, R <= 512)."""
    from kivi_jax.paged import merge

    reason = unsupported_paged_reason(q, paged, tuning)
    if reason is not None:
        raise NotImplementedError(f"impl='pallas_tpu' through the page table: {reason}")
    arrays, config = state.kernel_args(merge(paged.rows, paged.pages))
    return kivi_decode_attention_tpu(
        q, *arrays, paged.table, **config, tuning=tuning, interpret=interpret
    )
