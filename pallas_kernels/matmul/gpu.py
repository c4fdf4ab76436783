"""A decode step's weight matmul, x [M, K] @ w [K, N] with few rows (Pallas, Triton lowering).

At decode the rows are the batch's new tokens (M = 16 .. 128) and the time is the weights'
bytes: the kernel streams w once. Program (n, s) reads the column block w[Ks*s : Ks*(s+1),
BN*n : BN*(n+1)] in `block_k`-row tiles, pipelined by Triton (`num_stages` tiles in flight as
`cp.async` copies), multiplies each with the rows' matching x tile on the tensor cores and
accumulates in float32. With `splits` S > 1 the programs write float32 partial sums [S, M, N],
summed by XLA in whatever consumes them (a residual add, RoPE, SiLU): the same arrangement
XLA's own split-K GEMMs use. The reference is `jnp.dot` with float32 accumulation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class MatmulTiling:
    block_n: int  # columns per program (a power of two)
    block_k: int  # rows of w per pipelined tile (a power of two dividing K)
    splits: int  # programs along K, each ceil(K / block_k / splits) tiles (partials summed outside)
    num_warps: int = 4
    num_stages: int = 4


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, steps: int, total: int):
    # x_ref [M, K], w_ref [K, BN] (this program's columns), o_ref [M, BN]; tiles
    # [s * steps, min((s + 1) * steps, total)) of the K / block_k (= total) tiles
    s = pl.program_id(1)
    m, bn = o_ref.shape

    def body(i, acc):
        k = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        return acc + jnp.dot(x_ref[:, k], w_ref[k, :], preferred_element_type=jnp.float32)

    start = s * steps
    stop = jnp.minimum(start + steps, total)
    acc = jax.lax.fori_loop(start, stop, body, jnp.zeros((m, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _pow2_at_least(n: int, low: int) -> int:
    return max(low, 1 << (n - 1).bit_length())


def matmul_partials(x: jax.Array, w: jax.Array, tiling: MatmulTiling, *, interpret: bool = False):
    """x [M, K] @ w [K, N] as float32 partial sums [S, M, N] (S = tiling.splits); their sum
    over S is the product. M is padded to a power of two of at least 16 (the dot's rows)."""
    (M, K), (K2, N) = x.shape, w.shape
    t = tiling
    if K != K2:
        raise ValueError(f"x [M, K] {x.shape} and w [K, N] {w.shape} disagree on K")
    if N % t.block_n or K % t.block_k or t.splits > K // t.block_k:
        raise ValueError(
            f"tiling {t} does not fit w [K, N] = {w.shape}: block_n must divide N, block_k "
            "K, and the splits be at most K / block_k"
        )
    Mp = _pow2_at_least(M, 16)
    xp = jnp.pad(x, ((0, Mp - M), (0, 0))) if Mp != M else x
    total = K // t.block_k
    steps = -(-total // t.splits)
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=t.block_k, steps=steps, total=total),
        grid=(N // t.block_n, t.splits),
        in_specs=[
            pl.BlockSpec((Mp, K), lambda n, s: (0, 0)),
            pl.BlockSpec((K, t.block_n), lambda n, s: (0, n)),
        ],
        out_specs=pl.BlockSpec((None, Mp, t.block_n), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((t.splits, Mp, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name="skinny_matmul",
    )(xp, w)
    return out[:, :M]


def matmul(x: jax.Array, w: jax.Array, tiling: MatmulTiling, *, interpret: bool = False):
    """x [M, K] @ w [K, N] in x's dtype (float32 accumulation)."""
    return jnp.sum(matmul_partials(x, w, tiling, interpret=interpret), axis=0).astype(x.dtype)
