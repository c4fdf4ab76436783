"""Several processes, one per host, on one mesh: JAX's multi-controller runtime.

Each process calls `initialize()` before anything else touches a device; it then sees every
process's devices in `jax.devices()` (its own in `jax.local_devices()`), and every process runs
the same programs on a mesh over all of them (`global_mesh`). Inputs are host arrays that every
process holds whole (the same prompts in every process); `to_global` places one in its shards,
each process writing the shards of its own devices, and `to_host` reads a global array back
whole in every process. These two are the only host <-> global conversions: `generate` and
`TokenStream` go through them, and on a mesh of one process they are `device_put` and
`np.asarray`.

A process that dies ends the others: the coordination service (in process 0) declares a
process dead after HEARTBEAT_TIMEOUT_S seconds without a heartbeat, and every other process
then aborts, its log naming the lost ones ("The following tasks are unhealthy (stopped
sending heartbeats): <process ids>"). There is no recovery: the group is started again.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kivi_jax.sharding import DATA_AXIS, MODEL_AXIS

# jax.distributed.initialize's heartbeat_timeout_seconds (JAX's default is 100): a process
# silent this long is declared dead, and every other one exits.
HEARTBEAT_TIMEOUT_S = 30


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """Joins this process to the others (`jax.distributed.initialize`); call it first.

    With no arguments JAX reads them from the cluster it runs in (SLURM, Open MPI, a Cloud TPU
    slice, GKE's TPU and GPU pods) or from JAX_COORDINATOR_ADDRESS and the like; elsewhere pass
    all three: the address ("host:port") of process 0, which runs the coordination service,
    the number of processes and this one's id in [0, num_processes). Collectives between CPU
    devices go through gloo (GPUs use NCCL, TPUs their interconnect).
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )


def global_mesh(model: int | None = None) -> Mesh:
    """A mesh over every process's devices: ("model",) over all of them (model None or the
    device count), else ("data", "model") with `model` devices a row, process by process (with
    `model` = jax.local_device_count(), "model" within each host and "data" across hosts)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    model = len(devices) if model is None else model
    if model < 1 or len(devices) % model:
        raise ValueError(f"a 'model' axis of {model} does not divide the {len(devices)} devices")
    if model == len(devices):
        return Mesh(np.asarray(devices), (MODEL_AXIS,))
    return Mesh(np.asarray(devices).reshape(-1, model), (DATA_AXIS, MODEL_AXIS))


def to_global(x, mesh: Mesh, spec: P) -> jax.Array:
    """A host array that every process holds whole, placed in its shards on `mesh` (each
    process writes its own devices' shards; nothing crosses hosts)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def replicated(x: jax.Array) -> jax.Array:
    """`x` whole on every device of its mesh where this process does not hold all of it
    (gathered over the mesh), else `x` itself."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return x
    return _replicator(NamedSharding(x.sharding.mesh, P()))(x)


def to_host(x: jax.Array) -> np.ndarray:
    """A global array read back whole in every process."""
    return np.asarray(replicated(x))


@functools.lru_cache(maxsize=16)
def _replicator(sharding: NamedSharding):
    return jax.jit(lambda x: x, out_shardings=sharding)


def to_host_copy(tree):
    """`tree`'s arrays in host memory, to be put back where they were by `from_host_copy`:
    whole (jax.device_get) where this process holds them, else its own shards only."""
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.device_get(tree), jax.tree.map(lambda x: x.sharding, tree)
    return jax.tree.map(_HostShards.of, tree), None


def from_host_copy(copy):
    """The arrays of `to_host_copy` back on their devices, in their shardings."""
    tree, where = copy
    if where is not None:
        return jax.device_put(tree, where)
    return jax.tree.map(lambda x: x.put(), tree, is_leaf=lambda x: isinstance(x, _HostShards))


@dataclasses.dataclass(frozen=True)
class _HostShards:
    """A global array's shards on this process's devices, in host memory."""

    shape: tuple[int, ...]
    sharding: jax.sharding.Sharding
    shards: tuple  # ((device, np.ndarray), ...)

    @classmethod
    def of(cls, x: jax.Array) -> _HostShards:
        shards = tuple((s.device, np.asarray(s.data)) for s in x.addressable_shards)
        return cls(x.shape, x.sharding, shards)

    def put(self) -> jax.Array:
        arrays = [jax.device_put(data, device) for device, data in self.shards]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, arrays)
