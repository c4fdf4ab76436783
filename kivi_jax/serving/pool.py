"""The host's account of the engine's page pool (kivi_jax.paged): which pages are free, which
slot holds which, and the page table the device programs read.

The pool's pages are split over the mesh's "data" shards as the slots are (the first
pages // shards pages on the first shard, ...): a slot takes its pages from its own shard's
part, so a page is read and written only by the device holding its slot. Page ids in the table
are global; a shard's programs make them local (kivi_jax.sharding.decode_step).

Shared prefixes: a page whose tokens are final (sealed) may be registered under a key (the
chained hash of its sequence's tokens up to its end); a later prompt that starts with the same
tokens takes it by reference count. A page whose count drops to 0 keeps its contents and key
in a least-recently-freed list, taken back by a hit or, when the free list is empty, reused
(its key dropped), oldest first.
"""

from __future__ import annotations

import collections

import numpy as np

from kivi_jax.paged import NO_PAGE


class PagePool:
    """Free lists per "data" shard, the page table [slots, max_pages] int32 (NO_PAGE where a
    slot has no page), each slot's page count (its pages are table[slot, :held]), and the
    registered pages: reference counts, keys, the freed ones kept by key."""

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
        self._refs = np.zeros(pages, np.int32)
        self._key: dict[int, bytes] = {}  # registered page -> its key
        self._by_key: list[dict[bytes, int]] = [{} for _ in range(shards)]
        # freed registered pages, kept by key, oldest first
        self._kept = [collections.OrderedDict() for _ in range(shards)]

    @property
    def used(self) -> int:
        """Pages held by slots (the kept ones not counted)."""
        return self.total - sum(self.free(s) for s in range(len(self._free)))

    def pages_for(self, length: int) -> int:
        """Pages a sequence of `length` tokens writes."""
        return -(-(length - length % self._unit) // self.page_size)

    def shard(self, slot: int) -> int:
        return slot // self._slots_per_shard

    def free(self, shard: int) -> int:
        """Pages a slot of `shard` can take: the free ones and the kept ones."""
        return len(self._free[shard]) + len(self._kept[shard])

    def missing(self, slot: int, length: int) -> int:
        """Pages the slot lacks to hold `length` tokens."""
        return max(self.pages_for(length) - self._held[slot], 0)

    def grow(self, slot: int, length: int) -> None:
        """The slot's pages for `length` tokens taken from its shard's free list (there are
        enough: the caller checked `missing` against `free`)."""
        shard = self.shard(slot)
        for _ in range(self.missing(slot, length)):
            if self._free[shard]:
                page = self._free[shard].pop()
            else:  # the oldest kept page, its key dropped
                page, _ = self._kept[shard].popitem(last=False)
                del self._by_key[shard][self._key.pop(page)]
            self._put(slot, page)

    def _put(self, slot: int, page: int) -> None:
        self.table[slot, self._held[slot]] = page
        self._held[slot] += 1
        self._refs[page] += 1

    def release(self, slot: int) -> None:
        """The slot's pages given up: those no other slot holds back to its shard's free list,
        or, registered, to the kept ones."""
        shard = self.shard(slot)
        for page in (int(p) for p in self.table[slot, : self._held[slot]][::-1]):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key:
                    self._kept[shard][page] = None
                else:
                    self._free[shard].append(page)
        self.table[slot] = NO_PAGE
        self._held[slot] = 0

    def register(self, slot: int, keys: list[bytes]) -> None:
        """The slot's first len(keys) pages registered under `keys` (sealed: their tokens are
        final), where neither the page nor the key is already."""
        shard = self.shard(slot)
        for page, key in zip(self.table[slot, : len(keys)].tolist(), keys, strict=True):
            if page not in self._key and key not in self._by_key[shard]:
                self._key[page] = key
                self._by_key[shard][key] = page

    def hits(self, shard: int, keys: list[bytes]) -> list[int]:
        """The registered pages of `shard` under the leading run of `keys`."""
        pages = []
        for key in keys:
            page = self._by_key[shard].get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def is_kept(self, page: int) -> bool:
        """Whether the page is free but kept (registered, no slot holding it)."""
        return self._refs[page] == 0

    def share(self, slot: int, pages: list[int]) -> None:
        """`pages` (hits) as the empty slot's first pages, by reference."""
        for page in pages:
            self._kept[self.shard(slot)].pop(page, None)
            self._put(slot, page)
