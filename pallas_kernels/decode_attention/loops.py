"""Loops shared by the GPU kernels: the register prefetch, and the running max's start."""

from __future__ import annotations

import functools

from jax import lax
from jax.experimental import pallas as pl

NEG_INIT = -1e30  # running-max start: finite, so an empty row never computes inf - inf


def pipelined_loop(n_tiles, depth: int, load, compute, carry, live, ring=None):
    """carry = compute(k, load(k), carry) for k in [0, n_tiles), loads issued `depth` tiles ahead.

    Each step first issues the load of tile k + depth, then computes tile k, so a load has
    `depth` computations' time to arrive, in registers (Triton pipelines a loop's loads only
    where they feed a dot or the loop is marked: `triton_stages`). With depth 0 the loop is
    plain, compute(k, load(k), carry) in step k with no branch, for Triton's pipeliner.
    Otherwise the computation sits in a branch on `live(k)` (true for every k < n_tiles, in a
    form the compiler cannot fold): without a branch between them ptxas may move the loads below the
    arithmetic, to the end of the loop body, where nothing overlaps their latency (it did in
    the 2-bit MHA value kernel: docs/history.md, R2). The
    body is unrolled `depth` times over a ring of tiles; the last round may run up to
    depth - 1 tiles past n_tiles, and the loads of the last `depth` steps go past it too:
    `load` must clamp such tiles into bounds, and `live` must be false for them or their
    computation harmless. `ring`: the first `depth` tiles, where the caller issued their loads
    earlier (to overlap them with other work).
    """
    if depth == 0:
        return lax.fori_loop(0, n_tiles, lambda k, c: compute(k, load(k), c), carry)
    ring = tuple(load(k) for k in range(depth)) if ring is None else ring

    def body(i, state):
        carry, ring = state
        ring = list(ring)
        for u in range(depth):
            k = i * depth + u
            ahead = load(k + depth)
            carry = lax.cond(live(k), functools.partial(compute, k, ring[u]), lambda c: c, carry)
            ring[u] = ahead
        return carry, tuple(ring)

    carry, _ = lax.fori_loop(0, pl.cdiv(n_tiles, depth), body, (carry, ring))
    return carry
