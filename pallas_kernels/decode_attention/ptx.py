"""Lane-level PTX for the GPU kernels (Pallas-Triton inline assembly), each with a jnp twin.

On the GPU each function is one instruction (the mma one per output register, which ptxas
keeps as one) written as inline PTX through `plgpu.elementwise_inline_asm`, where Triton would
spend more or has no equivalent. With `interpret=True` each computes the same result with
jnp, so the kernels run on the CPU: the integer and byte operations exactly, `exp2_ftz`
as jnp.exp2 with its flush, the mma as a float32 matrix product of the f16 fragments. The
warp-level ones (`shfl_*`, `mma_m16n8k16`) take [32]-shaped operands whose element i sits on
lane i (one warp, Triton's 1-D blocked layout); their twins compute the warp's result on
those 32 elements. tests/test_ptx.py holds each twin to its definition; the kernels' GPU
tests run the PTX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu


def asm(code: str, args, constraints: str, dtype=jnp.int32):
    """One inline-PTX result, shaped like args[0] (jax's lowering takes one result per asm)."""
    [r] = plgpu.elementwise_inline_asm(
        code,
        args=args,
        constraints=constraints,
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, dtype)],
    )
    return r


def f16_halves(x):
    """int32 -> (low, high) f16 halves as float32 (no PTX: plain bit arithmetic)."""
    half = lambda bits: lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)
    return (
        half(x & 0xFFFF).astype(jnp.float32),
        half(lax.shift_right_logical(x, 16)).astype(jnp.float32),
    )


def pack_f16x2(lo, hi, *, interpret: bool):
    """float32 pair -> int32: f16(lo) in the low half, f16(hi) in the high half."""
    if interpret:
        bits = lambda x: lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16)
        return bits(lo).astype(jnp.int32) | (bits(hi).astype(jnp.int32) << 16)
    return asm("cvt.rn.f16x2.f32 $0, $1, $2;", [hi, lo], "=r,f,f")


def and_or(x, mask, bits, *, interpret: bool):
    """(x & mask) | bits of int32s in one LOP3 (ptxas would spend two where both constants are
    immediates)."""
    if interpret:
        return (x & mask) | bits
    return asm("lop3.b32 $0, $1, $2, $3, 0xEA;", [x, mask, bits], "=r,r,r,r")


def sub_f16x2(x, y, *, interpret: bool):
    """Halfwise f16 x - y of int32 words."""
    if interpret:
        (x0, x1), (y0, y1) = f16_halves(x), f16_halves(y)
        return pack_f16x2(x0 - y0, x1 - y1, interpret=True)
    return asm("sub.f16x2 $0, $1, $2;", [x, y], "=r,r,r")


def prmt(a, b, selector, *, interpret: bool):
    """PRMT: byte i of the result is byte (selector >> 4i) & 7 of the 8 bytes of (b, a), a's
    first. selector: an int (an immediate of the instruction) or int32 like a (per lane)."""
    if interpret:
        out = jnp.zeros_like(a)
        for i in range(4):
            k = (selector >> (4 * i)) & 7
            byte = lax.shift_right_logical(jnp.where(k < 4, a, b), 8 * (k % 4)) & 0xFF
            out = out | (byte << (8 * i))
        return out
    if isinstance(selector, int):
        return asm(f"prmt.b32 $0, $1, $2, {selector:#06x};", [a, b], "=r,r,r")
    return asm("prmt.b32 $0, $1, $2, $3;", [a, b, selector], "=r,r,r,r")


def dp4a(a, b, c, *, interpret: bool):
    """c + sum_i a_i * b_i over the 4 bytes of int32 words: a's unsigned, b's signed (IDP.4A)."""
    if interpret:
        for i in range(4):
            a_i = lax.shift_right_logical(a, 8 * i) & 0xFF
            b_i = lax.shift_right_arithmetic(lax.shift_left(b, 24 - 8 * i), 24)
            c = c + a_i * b_i
        return c
    return asm("dp4a.u32.s32 $0, $1, $2, $3;", [a, b, c], "=r,r,r,r")


def dp2a(a, b, c, *, high: bool, interpret: bool):
    """c + a_0 * b_k + a_1 * b_(k+1): a's two signed 16-bit halves times two of b's unsigned
    bytes, k = 0 (bytes 0 and 1) or, with `high`, 2 (bytes 2 and 3) (IDP.2A)."""
    k = 2 if high else 0
    if interpret:
        for i in range(2):
            a_i = lax.shift_right_arithmetic(lax.shift_left(a, 16 - 16 * i), 16)
            b_i = lax.shift_right_logical(b, 8 * (k + i)) & 0xFF
            c = c + a_i * b_i
        return c
    return asm(f"dp2a.{'hi' if high else 'lo'}.s32.u32 $0, $1, $2, $3;", [a, b, c], "=r,r,r,r")


def exp2_ftz(x, *, interpret: bool):
    """2**x of float32 x in one MUFU.EX2 (`ex2.approx.ftz.f32`): results below 2**-126 (the
    smallest normal float32) flush to 0, where jnp.exp2's lowering spends a compare and two
    multiplies per element to keep them; otherwise the same instruction."""
    if interpret:
        r = jnp.exp2(x)
        return jnp.where(r < jnp.finfo(jnp.float32).tiny, 0.0, r)
    return asm("ex2.approx.ftz.f32 $0, $1;", [x], "=f,f", x.dtype)


def shfl_xor(x, mask: int, *, interpret: bool):
    """Lane i gets float32 x of lane i ^ mask."""
    if interpret:
        return x[jnp.arange(32) ^ mask]
    bits = lax.bitcast_convert_type(x, jnp.int32)
    r = asm(f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, 0xffffffff;", [bits], "=r,r")
    return lax.bitcast_convert_type(r, jnp.float32)


def shfl_idx(x, src, *, interpret: bool):
    """Lane i gets x (float32 or int32 [32]) of lane src[i]."""
    if interpret:
        return x[src]
    bits = lax.bitcast_convert_type(x, jnp.int32) if x.dtype == jnp.float32 else x
    r = asm("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", [bits, src], "=r,r,r")
    return lax.bitcast_convert_type(r, jnp.float32) if x.dtype == jnp.float32 else r


def mma_m16n8k16(a, b, c, *, interpret: bool):
    """The warp's D = A B + C, `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`.

    Fragments as the PTX ISA lays them out ("Matrix Fragments for mma.m16n8k16 with floating
    point type"): lane l = 4 g + t holds A (16 x 16 f16) as a[0]: row g, k 2t and 2t + 1 (low
    half first); a[1]: row g + 8; a[2]: row g, k 2t + 8, 2t + 9; a[3]: row g + 8, k 2t + 8,
    2t + 9;
    B (16 x 8) as b[0]: k 2t, 2t + 1 of column g; b[1]: k 2t + 8, 2t + 9; C and D (16 x 8
    float32) as c[0], c[1]: row g, columns 2t, 2t + 1; c[2], c[3]: row g + 8.
    """
    if interpret:
        lane = jnp.arange(32)
        g, t = lane // 4, lane % 4
        A = jnp.zeros((16, 16), jnp.float32)
        for reg, (row, k) in zip(
            a, [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)], strict=True
        ):
            lo, hi = f16_halves(reg)
            A = A.at[row, k].set(lo).at[row, k + 1].set(hi)
        Bm = jnp.zeros((16, 8), jnp.float32)
        for reg, k in zip(b, [2 * t, 2 * t + 8], strict=True):
            lo, hi = f16_halves(reg)
            Bm = Bm.at[k, g].set(lo).at[k + 1, g].set(hi)
        prod = jnp.dot(A, Bm, precision=lax.Precision.HIGHEST)
        return [
            c[0] + prod[g, 2 * t],
            c[1] + prod[g, 2 * t + 1],
            c[2] + prod[g + 8, 2 * t],
            c[3] + prod[g + 8, 2 * t + 1],
        ]
    out = []
    for i in range(4):  # the same mma for each output register: ptxas keeps one
        code = (
            "{ .reg .f32 t<4>; mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{t0, t1, t2, t3}, {$1, $2, $3, $4}, {$5, $6}, {$7, $8, $9, $10}; "
            f"mov.b32 $0, t{i}; }}"
        )
        out.append(asm(code, [*a, *b, *c], "=f," + ",".join("r" * 6) + ",f,f,f,f", jnp.float32))
    return out
