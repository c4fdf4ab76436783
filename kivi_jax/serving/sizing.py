"""How many slots fit a device: the engine's bytes on one device, counted before it allocates.

The engine holds, on each device, the bytes already there when it starts (the weights, whatever
else the process keeps), its slots' KV state, the prefill scratch (a chunked prompt's
full-precision K/V and its one-row state), and while a program runs that program's temporaries.
The state and the scratch are counted from their shapes; the temporaries are XLA's own account
of each compiled program (`memory_analysis().temp_size_in_bytes`), so the engine compiles its
programs before it allocates the state (which also leaves XLA's autotuner the free memory it
measures candidate kernels in). The limit is the smaller of the user's budget and the device
allocator's own (`memory_stats()["bytes_limit"]`: on a GPU XLA's allocator may take only
XLA_PYTHON_CLIENT_MEM_FRACTION of the card, 75% unless set, preallocated or not).
"""

from __future__ import annotations

import dataclasses
import math

import jax

# Kept free beside the counted bytes, of the limit (at most RESERVE_BYTES): the allocator's
# fragmentation between the programs' temporaries and the state, and the workspaces libraries
# take at run time (cuBLAS, cuDNN).
RESERVE_SHARE, RESERVE_BYTES = 0.05, 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes on one device (the fullest device of a mesh).

    limit: the budget, or the device allocator's limit, the smaller; None where neither is
      known (a CPU without a budget: nothing is checked).
    in_use: already on the device when the engine starts (the weights, ...).
    slot: one slot's KV state.
    scratch: the prefill scratch and a prompt's one-row state.
    programs: the largest temporaries of the engine's compiled programs (0 before they are
      compiled).
    slots: rows of the state on the device.
    pool: the page pool's part on the device where kv_bytes sizes it (else each slot's pages
      are in `slot`).
    reserve: kept free: RESERVE_SHARE of the limit, at most RESERVE_BYTES.
    """

    limit: int | None
    in_use: int
    slot: int
    scratch: int
    programs: int
    slots: int
    pool: int = 0

    @property
    def reserve(self) -> int:
        return 0 if self.limit is None else min(int(RESERVE_SHARE * self.limit), RESERVE_BYTES)

    @property
    def needed(self) -> int:
        fixed = self.in_use + self.pool + self.scratch + self.programs + self.reserve
        return fixed + self.slots * self.slot

    @property
    def fits(self) -> bool:
        return self.limit is None or self.needed <= self.limit

    def most_slots(self) -> int:
        """Slots that fit the limit beside everything else (0 if none does)."""
        if self.limit is None:
            raise ValueError("no memory limit is known: give the engine a memory_budget")
        rest = self.limit - (self.in_use + self.pool + self.scratch + self.programs + self.reserve)
        return max(rest // self.slot, 0)

    def describe(self) -> str:
        gb = _size
        limit = "no limit known" if self.limit is None else f"limit {gb(self.limit)}"
        return (
            f"{self.slots} slots x {gb(self.slot)} + "
            + (f"page pool {gb(self.pool)} + " if self.pool else "")
            + f"in use {gb(self.in_use)} + prefill "
            f"scratch {gb(self.scratch)} + programs' temporaries {gb(self.programs)} + reserve "
            f"{gb(self.reserve)} = {gb(self.needed)} against the {limit}"
        )

    def check(self) -> None:
        """Raises ValueError naming the numbers where the plan exceeds its limit."""
        if not self.fits:
            most = self.most_slots()
            raise ValueError(
                f"the engine does not fit the device: {self.describe()}; "
                + (f"at most {most} slots fit" if most else "not one slot fits")
            )


def device_limit(devices, budget: int | None) -> int | None:
    """The smaller of `budget` and the allocators' limits of `devices` (None: neither known)."""
    limits = [s["bytes_limit"] for s in _stats(devices) if "bytes_limit" in s]
    if budget is not None:
        limits.append(int(budget))
    return min(limits) if limits else None


def device_in_use(devices, tree) -> int:
    """Bytes in use on the fullest of `devices`, from the allocators' statistics, or where they
    keep none (the CPU) the bytes of `tree`'s arrays on each device."""
    used = [s["bytes_in_use"] for s in _stats(devices) if "bytes_in_use" in s]
    if used:
        return max(used)
    per_device: dict = {}
    for x in jax.tree.leaves(tree):
        for shard in getattr(x, "addressable_shards", ()):
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


def device_bytes(tree) -> int:
    """Bytes of `tree`'s arrays (concrete or jax.ShapeDtypeStruct) on one device: each array's
    shard where it carries a sharding, else the whole array."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = x.shape if sharding is None else sharding.shard_shape(x.shape)
        total += math.prod(shape) * x.dtype.itemsize
    return total


def temp_bytes(compiled) -> int:
    """A compiled program's temporaries on one device (0 where XLA gives no account)."""
    stats = compiled.memory_analysis()
    return 0 if stats is None else int(stats.temp_size_in_bytes)


def _stats(devices) -> list[dict]:
    """The allocator statistics of this process's `devices` (a process reads only its own)."""
    mine = (d for d in devices if d.process_index == jax.process_index())
    return [s for s in (d.memory_stats() for d in mine) if s]


def _size(n: int) -> str:
    """Bytes in GB, MB or kB (1e9, 1e6, 1e3), three significant digits."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"
