"""Decode matmuls with quantized weights as one GPU kernel each (Pallas, Triton lowering).

x [M, K] (a decode step's rows, M <= 64) times a `kivi_jax.weights.QuantizedWeight` [K, N]
(int8 or int4 `qvalue`, float `scale` and optional `zero_point` of shape [K / g, N]) with

    w = (qvalue - zero_point) * scale     (the scale and zero point of row group k // g)

read as stored: each program loads its columns' integer codes one row group at a time (int4 as
the bytes XLA packs two columns in: the even columns' low nibbles and the odd columns' high
nibbles are two operands, two dots), widens them to x's dtype in registers (exact: |q| <= 127)
and multiplies on the tensor cores, then applies the group's scale and zero point to the
[M, bn] partial sum:

    x_g @ w_g = (x_g @ q_g - (sum_k x_g[:, k]) * z_g) * s_g

so the weight's bytes cross the memory bus once, where XLA's dequantize-then-dot (the
reference, kivi_jax.weights.dense) writes and reads a dequantized copy. One scale per output
channel (g = K, int8's format) is applied once to the whole sum, outside the kernel. Grid:
(column blocks of `block_n`, K splits); each split writes float32 partial sums [splits, M', N]
(M' = M padded to a power of two >= 16, the tensor cores' smallest tile) that XLA adds.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# The most rows the kernel takes: a decode step's batch. Larger M (prefill) is compute bound and
# runs XLA's dequantize-then-dot, whose copy of the weight costs little next to its FLOPs.
MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class Tiling:
    """block_n columns per program, at most block_k rows per loop step (per-channel scales only;
    grouped weights step one group), splits of K across programs, Triton's warps and pipeline
    stages."""

    block_n: int = 128
    block_k: int = 128
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3


# The most K splits default_tiling takes: beyond the sweep's range (benchmarks/matmul.py --sweep).
MAX_SPLITS = 8


def default_tiling(k: int, n: int, group: int, *, sms: int = 132) -> Tiling:
    """What the H100 sweep at batch 16 chose on Llama-3-8B's layers (benchmarks/results/matmul.md,
    best tilings): columns in blocks of 128 (64 where N is not a multiple of 128), K split in
    two while fewer than 4 x sms programs, up to MAX_SPLITS, each split a whole number of loop
    steps and at least 4 of them; 4 warps, 3 pipeline stages."""
    block_n = 128 if n % 128 == 0 else 64
    step = row_step(k, group, 128)
    splits = 1
    while (
        (n // block_n) * splits < 4 * sms
        and splits < MAX_SPLITS
        and k % (splits * 2 * step) == 0
        and k // (splits * 2 * step) >= 4
    ):
        splits *= 2
    return Tiling(block_n=block_n, block_k=128, splits=splits)


def row_step(k: int, group: int, block_k: int) -> int:
    """Rows a loop step reads: one row group, or (one scale per column) the largest power of two
    up to block_k that divides K."""
    if group != k:
        return group
    return max(s for s in (16, 32, 64, 128, 256) if s <= max(block_k, 16) and k % s == 0)


def unsupported_reason(m: int, k: int, n: int, group: int, qdtype, xdtype) -> str | None:
    """Why the kernel cannot take x [m, k] (of `xdtype`) @ a QuantizedWeight [k, n] of row
    groups of `group` and codes of `qdtype`; None where it can."""
    if jnp.dtype(xdtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return (
            f"x must be bfloat16 or float16 (the tensor cores' operands), got {jnp.dtype(xdtype)}"
        )
    if jnp.dtype(qdtype) not in (jnp.dtype(jnp.int8), jnp.dtype(jnp.int4)):
        return f"codes must be int8 or int4, got {jnp.dtype(qdtype)}"
    if not 1 <= m <= MAX_ROWS:
        return f"x has {m} rows; the kernel takes 1 to {MAX_ROWS} (a decode step)"
    if n % 64:
        return f"N = {n} is not a multiple of 64"
    if group != k and (group < 16 or group > 128 or group & (group - 1)):
        return f"row groups of {group}: the kernel takes powers of two in [16, 128], or K"
    if group == k and k % 16:
        return f"K = {k} is not a multiple of 16"
    return None


def _padded_rows(m: int) -> int:
    return max(16, 1 << (m - 1).bit_length())


# int4 nibbles to 16-bit floats by their bits: a nibble n's bits (n ^ 8: its signed value + 8)
# or'd into the exponent of `base` (128.0 in bfloat16, 1024.0 in float16: one unit per
# mantissa step) give base + 8 + q, and one fused multiply-add takes base + 8 off.
_MAGIC = {  # dtype: (base's bits, -(base + 8) as a pair of halves, 1.0 as a pair, PTX type)
    jnp.dtype(jnp.bfloat16): (0x4300, 0xC308C308, 0x3F803F80, "bf16x2"),
    jnp.dtype(jnp.float16): (0x6400, 0xE408E408, 0x3C003C00, "f16x2"),
}


def _nibbles_asm(b, dtype, *, high: bool):
    """The low (or high) nibbles of uint8 b as signed values in `dtype`, four bytes per PTX
    instance: two PRMTs spread the bytes into 16-bit halves, one LOP3 each masks the nibble,
    flips its sign bit and sets the exponent, one FMA each takes the offset off."""
    base, offset, one, kind = _MAGIC[jnp.dtype(dtype)]
    bits = f"{base | 8:#06x}{base | 8:04x}"
    shift = "shr.b32 x, x, 4; " if high else ""
    code = (
        "{ .reg .b32 x, t0, t1, one, off; "
        f"mov.b32 x, $2; {shift}mov.b32 one, {one:#010x}; mov.b32 off, {offset:#010x}; "
        "prmt.b32 t0, x, 0, 0x4140; prmt.b32 t1, x, 0, 0x4342; "
        f"lop3.b32 t0, t0, 0x000F000F, {bits}, 0x6A; "
        f"lop3.b32 t1, t1, 0x000F000F, {bits}, 0x6A; "
        f"fma.rn.{kind} $0, t0, one, off; fma.rn.{kind} $1, t1, one, off; }}"
    )
    [r] = plgpu.elementwise_inline_asm(
        code, args=[b], constraints="=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(b.shape, dtype)],
    )  # fmt: skip
    return r


def _codes(q_ref, rows, packed: bool, dtype, interpret: bool) -> tuple[jax.Array, ...]:
    """The codes of `rows` widened to `dtype` (exact): int8 -> ([step, bn],); int4 bytes ->
    (even columns, odd columns), each [step, bn / 2]: a byte's low nibble is its even column
    (bitcast_convert_type's order). On the GPU by `_nibbles_asm`; interpreted, each nibble
    sign-extended by two shifts of the int8 byte."""
    b = q_ref[rows, :]
    if not packed:
        return (b.astype(dtype),)
    if not interpret:
        return _nibbles_asm(b, dtype, high=False), _nibbles_asm(b, dtype, high=True)
    b = jax.lax.bitcast_convert_type(b, jnp.int8)
    four = jnp.int8(4)
    lo = jax.lax.shift_right_arithmetic(jax.lax.shift_left(b, four), four)
    hi = jax.lax.shift_right_arithmetic(b, four)
    return lo.astype(dtype), hi.astype(dtype)


def _kernel(x_ref, q_ref, *refs, step: int, steps: int, per_channel: bool, zero: bool,
            packed: bool, interpret: bool):  # fmt: skip
    """One program: columns [n * bn, n * bn + bn) over K split s (steps of `step` rows); refs:
    the scale and zero point refs of grouped weights (per_channel: none), then the output.
    packed (int4): q_ref holds bytes [K, bn / 2] and the even and odd columns are two dots
    whose sums are stored to the output's even and odd columns (strided stores)."""
    *sz, o_ref = refs
    s_ref, z_ref = (*sz, None, None)[:2]
    mp, bn = o_ref.shape[-2:]
    parts = 2 if packed else 1
    width = bn // parts
    # Column c of part p is output column c * parts + p.
    cols = [pl.ds(p, width, stride=parts) if packed else slice(None) for p in range(parts)]
    k0 = pl.program_id(1) * steps * step
    f32 = jnp.float32

    def body(i, accs):  # accs: parts x [M', bn / parts] float32
        rows = pl.ds(k0 + i * step, step)
        xg = x_ref[:, rows]  # [M', step]
        ws = _codes(q_ref, rows, packed, xg.dtype, interpret)  # parts x [step, bn / parts], exact
        xsum = jnp.sum(xg.astype(f32), axis=1, keepdims=True) if zero and not per_channel else None
        out = []
        for acc, w, c in zip(accs, ws, cols, strict=True):
            part = jnp.dot(xg, w, preferred_element_type=f32)
            if not per_channel:  # per channel: scale and zero point applied to the whole sum
                g = (k0 + i * step) // step
                if zero:
                    part = part - xsum * z_ref[pl.ds(g, 1), c].astype(f32)
                part = part * s_ref[pl.ds(g, 1), c].astype(f32)
            out.append(acc + part)
        return tuple(out)

    zeros = tuple(jnp.zeros((mp, width), f32) for _ in range(parts))
    for acc, c in zip(jax.lax.fori_loop(0, steps, body, zeros), cols, strict=True):
        o_ref[:, c] = acc


def int4_bytes(qvalue: jax.Array) -> jax.Array:
    """int4 codes [K, N] as their bytes uint8 [K, N / 2], two codes each (the same memory)."""
    k, n = qvalue.shape
    return jax.lax.bitcast_convert_type(qvalue.reshape(k, n // 2, 2), jnp.uint8)


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def quantized_matmul(
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
    reason = unsupported_reason(m, k, n, group, qvalue.dtype, x.dtype)
    if reason is not None:
        raise ValueError(f"quantized_matmul: {reason}")
    t = tiling or default_tiling(k, n, group)
    per_channel = group == k
    step = row_step(k, group, t.block_k)
    if k % (t.splits * step):
        raise ValueError(f"K = {k} does not split into {t.splits} x steps of {step}")
    mp = _padded_rows(m)
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    zero = zero_point is not None
    grouped = [] if per_channel else [scale] + ([zero_point] if zero else [])
    packed = qvalue.dtype == jnp.int4
    if packed:
        qvalue = int4_bytes(qvalue)
    cols = lambda rows, width=t.block_n: pl.BlockSpec((rows, width), lambda j, s: (0, j))
    kernel = functools.partial(
        _kernel,
        step=step,
        steps=k // (t.splits * step),
        per_channel=per_channel,
        zero=zero,
        packed=packed,
        interpret=interpret,
    )
    partial = pl.pallas_call(
        kernel,
        grid=(n // t.block_n, t.splits),
        in_specs=[pl.BlockSpec((mp, k), lambda j, s: (0, 0)), cols(k, t.block_n // (1 + packed))]
        + [cols(k // group)] * len(grouped),
        out_specs=pl.BlockSpec((None, mp, t.block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((t.splits, mp, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name="quantized_matmul",
    )(xp, qvalue, *grouped)
    y = partial.sum(axis=0)[:m]  # [M, N]
    if per_channel:
        s32 = scale.astype(jnp.float32)
        if zero:
            y = y - jnp.sum(x, axis=1, keepdims=True, dtype=jnp.float32) * zero_point.astype(
                jnp.float32
            )
        y = y * s32
    return y
