"""A row's page table inside the GPU kernels (kivi_jax.paged): where a tile of the row's tokens
lies in the pool.

A paged kernel reads the pool's arrays whole (every page of the KV head, one block) and the
row's table [M] as a ref; a tile never crosses a page (the tile sizes divide page_size), so one
table entry, loaded in the kernel, places the whole tile: the same loads as the contiguous
kernel's, from another start. The outputs (logits, maxima, sums) stay in the row's token order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class RowPages:
    """ref: the row's table, int32 [M] (a Pallas ref); per_page: the caller's units (key
    groups, quads, tokens) per page; pages: the pool's pages."""

    ref: Any
    per_page: int
    pages: int

    def locate(self, unit):
        """(page, unit within the page) of the row's unit `unit` (< M * per_page). A missing
        page (NO_PAGE: a tile past the row's length, which a loop loads and does not use) reads
        the pool's last page, so that no load leaves the pool."""
        page = jnp.minimum(self.ref[unit // self.per_page], self.pages - 1)
        return page, unit % self.per_page

    def tile(self, unit, n: int):
        """The index of n units from the row's unit `unit` (within one page): (page, pl.ds)."""
        page, at = self.locate(unit)
        return page, pl.ds(at, n)


def table_first(kernel, *, per_page: int, pages: int):
    """`kernel(*refs, table=RowPages)` as a Pallas kernel whose first ref is the row's table."""

    def run(table_ref, *refs):
        return kernel(*refs, table=RowPages(table_ref, per_page, pages))

    return run


def table_spec(table) -> pl.BlockSpec:
    """The BlockSpec of the table [B, M] in a grid (row, head, program): program's row's [M]."""
    return pl.BlockSpec((None, table.shape[1]), lambda b, h, p: (b, 0))
