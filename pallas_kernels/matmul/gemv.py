"""Decode matmuls of one or two rows with quantized weights, without tensor cores (Pallas,
Triton lowering).

x [M, K] (M <= MAX_ROWS) times a `kivi_jax.weights.QuantizedWeight` [K, N] (int8 or int4 codes
q, 16-bit `scale` and optional `zero_point` [K / g, N]):

    y[m, n] = sum_g s[g, n] * (sum_{k in g} x[m, k] * (q[k, n] + o) - (z[g, n] + o) * xs[m, g])

with o the codes' offset (int4 8, int8 128: q + o is the code's bits with its sign bit
flipped) and xs[m, g] the group's sum of x. No tensor-core tile, so M is not padded: a
program owns 32 x `bytes_per_thread` bytes of columns and one split of K, each warp its own
run of rows; a thread reads 4-16 consecutive bytes of a row (staged through shared memory by
cp.async) and turns each code into a float32 with ONE instruction (LOP3): masking the code's
field out of its 32-bit word and flipping the field's top bit leaves the bits (q + o) << pos,
which read as a float32 are the subnormal

    (q + o) * 2^(pos - 149)          (pos: the field's lowest bit, FIELDS)

exactly: below bit 23 a subnormal, at bit 23 the smallest exponent, whose step is the same
2^-149; the 4th byte of a word is shifted down by 8 first (one shift a word). One fused
multiply-add (PTX `fma.rn.f32`, which keeps subnormals) per code and row adds x * 2^A times it
to a float32 accumulator: the product is exact and normal. After each row group the sums are
scaled back by 2^(149 - A - pos) (exact), the offset and zero point taken off with the group's
sum of x, and the scale applied. A code costs 1.125 (int4) or 1.25 (int8) integer
instructions plus one FMA per row, against ~5.5 for the tensor-core kernel (gpu.py) whose
operands must be gathered into the mma layout; docs/performance.md counts the compiled loop.

x must be finite with |x| < 2^(128 - A) = 2^64 (x * 2^A is a float32). Entries below
2^(23 - A) = 2^-41 in magnitude give products below float32's normal range; while a running
sum is that small it is rounded to multiples of 2^-149, at most 2^(-1 - A) = 2^-65 of y's
units an addition.

Grid: (N bytes / block bytes, splits); each split writes float32 partial sums [splits, M, N]
that XLA adds. A warp's loop runs over its rows 8 at a time (their bytes pipelined through
shared memory by cp.async) and applies the scales in a branch at the end of each group.

Interpreted (the CPU flushes subnormals to zero), the program is the same but
for the codes, which are made (q + o) * 2^(pos - 149 + LIFT) by ordinary conversions; the bit
patterns of the PTX are checked against numpy's float32 in tests/test_matmul_kernel.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kivi_jax.pallas_kernels import triton_stages
from kivi_jax.pallas_kernels.matmul.gpu import int4_bytes

# The most rows the kernel takes: each row adds one FMA a code; at 3 rows the compiled loop
# (5.1 instructions a code with its fold, 255 registers a thread) is the tensor-core kernel's
# 5.5 at a fraction of the occupancy, at 4 it spills (docs/performance.md).
MAX_ROWS = 2
# x is scaled by 2^A so that x * (q + o) * 2^(pos - 149) is a normal float32.
A = 64
# Interpreted, the codes are made normal floats by 2^LIFT more (the CPU flushes subnormals).
LIFT = 64

# The codes of a 32-bit word (4 consecutive bytes of a row, byte i in bits 8i..8i+7) as
# (shift of the word, mask of the field) per byte and slot: int4's slots are the byte's low
# nibble (its even column) and high nibble (its odd column); int8's one slot is the byte. A
# field must sit below bit 24 (its bits then read as (q + o) * 2^(pos - 149)), so the 4th byte
# is taken from the word shifted down by 8.
FIELDS = {
    4: (
        ((0, 0xF), (0, 0xF0)),
        ((0, 0xF00), (0, 0xF000)),
        ((0, 0xF0000), (0, 0xF00000)),
        ((8, 0xF0000), (8, 0xF00000)),
    ),
    8: (((0, 0xFF),), ((0, 0xFF00),), ((0, 0xFF0000),), ((8, 0xFF0000),)),
}


def field_position(mask: int) -> int:
    """The bit position of a field's lowest bit."""
    return (mask & -mask).bit_length() - 1


def field_sign(mask: int) -> int:
    """A field's top bit (the code's sign bit, flipped to add the offset)."""
    return 1 << (mask.bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """A program: 32 x `bytes_per_thread` bytes of columns (a thread's 4, 8 or 16 consecutive
    bytes of a row: one vector load) over one of `splits` runs of K, shared by `num_warps`
    warps, each reading its own run of K / (splits x num_warps) rows (the warps' sums are added
    at the end); `rows_per_step` rows unrolled per loop step, their bytes copied `stages` - 1
    steps ahead into shared memory (cp.async, Triton's pipeliner asked for by
    `triton_stages`): without it ptxas issues each row's load about one row's work before
    its use, ~1 KB in flight a warp."""

    bytes_per_thread: int = 16
    num_warps: int = 4
    splits: int = 1
    rows_per_step: int = 8
    stages: int = 3

    def block_bytes(self) -> int:
        return self.bytes_per_thread * 32


def default_tiling(k: int, n_bytes: int, group: int, *, bits: int = 4, sms: int = 132) -> Tiling:
    """4 warps a program (fewer where K is short) and the fewest K splits that give 4 x sms
    warps (each with two steps of 8 rows x 512 bytes in flight: 4 MB in all, above the read
    bandwidth times ~0.7 us of latency, 2.2 MB), at 16 bytes a thread (the shortest loop:
    docs/performance.md), or 8 or 4 where 16 would need float32 partial sums (written and
    read: 8 bytes a split and column) of more than 1/8 of the weight's bytes; of tilings all
    over that, the one with the fewest partial sums. Not yet timed (benchmarks/matmul.py
    --sweep tries others)."""
    cols = n_bytes * 8 // bits
    options = []
    for per_thread in (16, 8, 4):
        if n_bytes % (per_thread * 32):
            continue
        blocks = n_bytes // (per_thread * 32)
        for warps in (4, 2, 1):
            fits = [
                Tiling(bytes_per_thread=per_thread, num_warps=warps, splits=d)
                for d in range(1, k // (warps * Tiling.rows_per_step) + 1)
            ]
            fits = [t for t in fits if tiling_unsupported_reason(t, k, n_bytes, group) is None]
            if fits:
                break
        t = next((t for t in fits if blocks * t.splits * t.num_warps >= 4 * sms), fits[-1])
        if 8 * t.splits * cols <= k * n_bytes / 8:
            return t
        options.append(t)
    return min(options, key=lambda t: t.splits)


def unsupported_reason(m: int, k: int, n: int, group: int, qdtype, xdtype, sdtype) -> str | None:
    """Why the kernel cannot take x [m, k] (of `xdtype`) @ a QuantizedWeight [k, n] of row
    groups of `group`, codes of `qdtype` and scales of `sdtype`; None where it can."""
    if jnp.dtype(xdtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"x must be bfloat16 or float16, got {jnp.dtype(xdtype)}"
    if jnp.dtype(qdtype) not in (jnp.dtype(jnp.int8), jnp.dtype(jnp.int4)):
        return f"codes must be int8 or int4, got {jnp.dtype(qdtype)}"
    if jnp.dtype(sdtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"scales must be bfloat16 or float16, got {jnp.dtype(sdtype)}"
    if not 1 <= m <= MAX_ROWS:
        return f"x has {m} rows; the kernel takes 1 to {MAX_ROWS}"
    n_bytes = n // 2 if jnp.dtype(qdtype) == jnp.dtype(jnp.int4) else n
    if n_bytes % 128:
        return f"N = {n} is not a whole number of 128-byte column blocks"
    if group != k and (group < 8 or group & (group - 1)):
        return f"row groups of {group}: the kernel takes powers of two >= 8, or K"
    if k % Tiling.rows_per_step:
        return f"K = {k} is not a multiple of {Tiling.rows_per_step} (rows a loop step)"
    return None


def tiling_unsupported_reason(t: Tiling, k: int, n_bytes: int, group: int) -> str | None:
    """Why tiling `t` does not fit K, N's bytes and the row groups (group = K: per channel):
    each warp's run of kw = K / (splits x warps) rows must be whole loop steps and either
    whole groups or, all warps of a split together, within one group."""
    if t.bytes_per_thread not in (4, 8, 16) or n_bytes % t.block_bytes():
        return f"{t.bytes_per_thread} bytes a thread do not tile {n_bytes} bytes of columns"
    if k % (t.splits * t.num_warps * t.rows_per_step):
        return f"K = {k} is not {t.splits} splits x {t.num_warps} warps x {t.rows_per_step} rows"
    kw = k // (t.splits * t.num_warps)
    if group != k and kw % group and group % (kw * t.num_warps):
        return f"runs of {kw} rows x {t.num_warps} warps neither hold nor fit in groups of {group}"
    return None


def _fields_asm(w, bits: int, slot: int):
    """The codes of slot `slot` of bytes w [nb] (uint8) as subnormal float32s (FIELDS), four
    bytes (one 32-bit word) per PTX instance: one LOP3 a code, one shift a word."""
    fields = [FIELDS[bits][byte][slot] for byte in range(4)]
    code = ["{ .reg .b32 t; shr.b32 t, $4, 8;"]
    for byte, (shift, mask) in enumerate(fields):
        src = "t" if shift else "$4"
        code.append(f"lop3.b32 ${byte}, {src}, {mask:#x}, {field_sign(mask):#x}, 0x6A;")
    code.append("}")
    [r] = plgpu.elementwise_inline_asm(
        " ".join(code), args=[w], constraints="=r,=r,=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float32)],
    )  # fmt: skip
    return r


def _fma(a, b, c):
    """a * b + c in float32 with subnormal operands kept (PTX fma.rn.f32, no .ftz)."""
    [r] = plgpu.elementwise_inline_asm(
        "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, jnp.float32)],
    )  # fmt: skip
    return r


def _codes_interpreted(b, bits: int, pos) -> tuple[jax.Array, ...]:
    """What the PTX's fields hold, as normal floats: (q + o) * 2^(pos - 149 + LIFT) per slot."""
    b = b.astype(jnp.int32)
    codes = (b & 0xF, b >> 4) if bits == 4 else (b,)
    flip = 1 << (bits - 1)
    return tuple(
        (c ^ flip).astype(jnp.float32) * _exp2(p - 149 + LIFT)
        for c, p in zip(codes, pos, strict=True)
    )


def _per_slot(v, slots: int, dtype) -> list[jax.Array]:
    """Scales (or zero points) of a program's bytes [..., nb] as float32 per slot: int8's as
    they are; int4's stored as uint32 pairs (the even column's 16 bits low, the odd's high)."""
    if slots == 1:
        return [v.astype(jnp.float32)]
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):  # bfloat16 is float32's high half
        halves = (v << 16, v & jnp.uint32(0xFFFF0000))
        return [jax.lax.bitcast_convert_type(h, jnp.float32) for h in halves]
    return [
        jax.lax.bitcast_convert_type(h.astype(jnp.uint16), dtype).astype(jnp.float32)
        for h in (v & 0xFFFF, v >> 16)
    ]


def _exp2(e):
    """2.0 ** e for an int32 array e in float32's normal range, exactly (by the bits)."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _kernel(x_ref, q_ref, s_ref, *refs, bits: int, rows: int, group: int, warps: int,
            rows_per_step: int, zero: bool, scale_dtype, interpret: bool):  # fmt: skip
    """One program: its nb bytes of columns over its split of K, warp w reading rows
    [w * kw, w * kw + kw) of the split as row w of each [warps, nb] tile. x_ref [M, warps, kw]
    (x's rows of each run), q_ref [K / splits, nb] bytes, s_ref (then z_ref) [K / splits / g,
    nb] ([1, nb] per channel; int4: uint32 pairs); the output [M, block_n]."""
    *z, o_ref = refs
    z_ref = z[0] if zero else None
    ks, nb = q_ref.shape
    kw = ks // warps  # rows of a warp's run
    f32 = jnp.float32
    fields = FIELDS[bits]
    slots = len(fields[0])
    offset = 1 << (bits - 1)
    per_channel = group == 0
    # Rows between applications of a scale: a group (or the run, where a split lies within one
    # group); per channel, the largest power of two up to 256 that divides a run (x's sum over
    # them is one vector load).
    fold = math.gcd(kw, 256) if per_channel else min(group, kw)
    one_row = per_channel or kw < group  # one scale row for the whole split
    # The columns of slot j: byte c's slot j is column c * slots + j.
    cols = [pl.ds(j, nb, stride=slots) if slots > 1 else slice(None) for j in range(slots)]
    byte = jax.lax.broadcasted_iota(jnp.int32, (1, nb), 1) % 4  # position in its word
    pos = []
    for j in range(slots):
        p = jnp.zeros((1, nb), jnp.int32)
        for i in range(4):
            p = jnp.where(byte == i, field_position(fields[i][j][1]), p)
        pos.append(p)
    lift = LIFT if interpret else 0
    # The chunks' units back to x's: 2^(149 - A - pos - lift), a normal float.
    back = [_exp2(149 - A - lift - p) for p in pos]

    def row(k, chunk):  # chunk: [rows][slots] x [warps, nb], row k of each run
        w = q_ref[pl.ds(k, warps, stride=kw), :]  # [warps, nb] uint8
        xa = [  # x * 2^A [warps, nb]
            jnp.broadcast_to(
                x_ref[pl.ds(r, 1), :, pl.ds(k, 1)].reshape(warps, 1).astype(f32) * f32(2.0**A),
                w.shape,
            )
            for r in range(rows)
        ]
        if interpret:
            codes = _codes_interpreted(w, bits, pos)
            fma = lambda a, b, c: c + a * b
        else:
            codes = [_fields_asm(w, bits, j) for j in range(slots)]
            fma = _fma
        return tuple(
            tuple(fma(xa[r], codes[j], chunk[r][j]) for j in range(slots)) for r in range(rows)
        )

    def apply_scale(f, acc, chunk):  # fold f's chunk into acc ([rows][slots] x [warps, nb])
        k0 = f * fold
        xsum = [  # [warps, 1]: each run's sum of x over the fold's rows
            jnp.sum(x_ref[pl.ds(r, 1), :, pl.ds(k0, fold)].astype(f32), axis=2).reshape(warps, 1)
            for r in range(rows)
        ]
        # Each run's scale row: its group (the split's one row: per channel, or within a group).
        srows = pl.ds(0, 1) if one_row else pl.ds(f, warps, stride=kw // group)
        s = _per_slot(s_ref[srows, :], slots, scale_dtype)
        if zero:
            zz = [v + offset for v in _per_slot(z_ref[srows, :], slots, scale_dtype)]
        else:
            zz = [f32(offset)] * slots
        sb = [a * b for a, b in zip(s, back, strict=True)]  # the scale in the chunks' units
        sz = [a * b for a, b in zip(s, zz, strict=True)]
        return tuple(
            tuple(acc[r][j] + sb[j] * chunk[r][j] - sz[j] * xsum[r] for j in range(slots))
            for r in range(rows)
        )

    zeros = tuple(tuple(jnp.zeros((warps, nb), f32) for _ in range(slots)) for _ in range(rows))
    per_fold = fold // rows_per_step  # loop steps a fold

    def step(i, carry):  # one loop over the run (for Triton's pipeliner), folding in a branch
        acc, chunk = carry
        for r in range(rows_per_step):
            chunk = row(i * rows_per_step + r, chunk)
        fold_now = lambda: (apply_scale(i // per_fold, acc, chunk), zeros)
        if per_fold == 1:
            return fold_now()
        last = jax.lax.rem(i + 1, jnp.int32(per_fold)) == 0
        return jax.lax.cond(last, fold_now, lambda: (acc, chunk))

    acc, _ = jax.lax.fori_loop(0, kw // rows_per_step, step, (zeros, zeros))
    for r in range(rows):
        for j in range(slots):
            o_ref[pl.ds(r, 1), cols[j]] = jnp.sum(acc[r][j], axis=0)[None]


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def quantized_gemv(
    x: jax.Array,
    qvalue: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None = None,
    *,
    tiling: Tiling | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x [M, K] @ (qvalue - zero_point) * scale -> [M, N] float32 (module docstring).

    qvalue [K, N] int8 / int4; scale, zero_point [K / g, N] (g = K: one per column).
    """
    m, k = x.shape
    n = qvalue.shape[1]
    group = k // scale.shape[0]
    reason = unsupported_reason(m, k, n, group, qvalue.dtype, x.dtype, scale.dtype)
    if reason is not None:
        raise ValueError(f"quantized_gemv: {reason}")
    bits = 4 if qvalue.dtype == jnp.int4 else 8
    if bits == 4:
        qvalue = int4_bytes(qvalue)
    else:
        qvalue = jax.lax.bitcast_convert_type(qvalue, jnp.uint8)
    n_bytes = qvalue.shape[1]
    t = tiling or default_tiling(k, n_bytes, group, bits=bits)
    reason = tiling_unsupported_reason(t, k, n_bytes, group)
    if reason is not None:
        raise ValueError(f"quantized_gemv: {reason}")
    nb = t.block_bytes()
    ks = k // t.splits  # rows of a split
    kw = ks // t.num_warps  # rows of a warp's run
    per_channel = group == k
    bn = nb * 8 // bits  # columns of a program
    stages = t.stages if t.stages > 1 and (interpret or triton_stages.install()) else 1
    zero = zero_point is not None
    per_group = [scale] + ([zero_point] if zero else [])
    if bits == 4:  # [K / g, N] 16-bit -> [K / g, N / 2] uint32: a byte's two columns together
        per_group = [
            jax.lax.bitcast_convert_type(v.reshape(v.shape[0], n // 2, 2), jnp.uint32)
            for v in per_group
        ]
    if per_channel:
        sspec = pl.BlockSpec((1, nb), lambda j, s: (0, j))
    elif ks < group:  # a split within one group: that group's row
        sspec = pl.BlockSpec((1, nb), lambda j, s: (s * ks // group, j))
    else:
        sspec = pl.BlockSpec((ks // group, nb), lambda j, s: (s, j))
    kernel = functools.partial(
        _kernel, bits=bits, rows=m, group=0 if per_channel else group, warps=t.num_warps,
        rows_per_step=t.rows_per_step, zero=zero, scale_dtype=scale.dtype, interpret=interpret,
    )  # fmt: skip
    partial = pl.pallas_call(
        kernel,
        grid=(n_bytes // nb, t.splits),
        in_specs=[
            pl.BlockSpec((m, t.num_warps, kw), lambda j, s: (0, s, 0)),
            pl.BlockSpec((ks, nb), lambda j, s: (s, j)),
        ]
        + [sspec] * len(per_group),
        out_specs=pl.BlockSpec((None, m, bn), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((t.splits, m, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=stages),
        interpret=interpret,
        name="quantized_gemv"
        if stages == 1
        else triton_stages.staged_name("quantized_gemv", stages),
    )(x.reshape(m, t.splits * t.num_warps, kw), qvalue, *per_group)
    return partial.sum(axis=0)
