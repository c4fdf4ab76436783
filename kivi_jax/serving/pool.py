"""The host's account of the engine's page pool (kivi_jax.paged): which pages are free, which
slot holds which, and the page table the device programs read.

The pool's pages are split over the mesh's "data" shards as the slots are (the first
pages // shards pages on the first shard, ...): a slot takes its pages from its own shard's
part, so a page is read and written only by the device holding its slot. Page ids in the table
are global; a shard's programs make them local (kivi_jax.sharding.decode_step).
"""

from __future__ import annotations

import numpy as np

from kivi_jax.paged import NO_PAGE


class PagePool:
    """Free lists per "data" shard, the page table [slots, max_pages] int32 (NO_PAGE where a
    slot has no page) and each slot's page count (its pages are table[slot, :held])."""

    def __init__(self, *, pages: int, shards: int, slots: int, max_pages: int, page_size: int,
                 unit: int):  # fmt: skip
        """pages: the pool's (a multiple of shards); unit: a KIVI state's group size G (its
        token-axis arrays hold the complete key groups, [0, l - l % G)), 1 for a full one."""
        self.total, self.page_size, self._unit = pages, page_size, unit
        self._per_shard, self._slots_per_shard = pages // shards, slots // shards
        self._free = [
            list(range((s + 1) * self._per_shard - 1, s * self._per_shard - 1, -1))
            for s in range(shards)
        ]  # popped from the end: lowest id first
        self.table = np.full((slots, max_pages), NO_PAGE, np.int32)
        self._held = [0] * slots

    @property
    def used(self) -> int:
        return self.total - sum(len(f) for f in self._free)

    def pages_for(self, length: int) -> int:
        """Pages a sequence of `length` tokens writes."""
        return -(-(length - length % self._unit) // self.page_size)

    def shard(self, slot: int) -> int:
        return slot // self._slots_per_shard

    def free(self, shard: int) -> int:
        return len(self._free[shard])

    def missing(self, slot: int, length: int) -> int:
        """Pages the slot lacks to hold `length` tokens."""
        return max(self.pages_for(length) - self._held[slot], 0)

    def grow(self, slot: int, length: int) -> None:
        """The slot's pages for `length` tokens taken from its shard's free list (there are
        enough: the caller checked `missing` against `free`)."""
        free = self._free[self.shard(slot)]
        for _ in range(self.missing(slot, length)):
            self.table[slot, self._held[slot]] = free.pop()
            self._held[slot] += 1

    def release(self, slot: int) -> None:
        """The slot's pages back to its shard's free list."""
        free = self._free[self.shard(slot)]
        free.extend(int(p) for p in self.table[slot, : self._held[slot]][::-1])
        self.table[slot] = NO_PAGE
        self._held[slot] = 0
