"""Tensor parallelism (and a data-parallel batch) over a `jax.sharding.Mesh`.

A mesh has a "model" axis of M devices and optionally a "data" axis. Over "model" every decoder
block is split by heads and MLP width (Megatron's split): shard i holds query heads
[i*N/M, (i+1)*N/M), its share of the KV heads, MLP columns [i*F/M, (i+1)*F/M) and the rows of
`wo` and `w_down` that read them, and the KV state of its KV heads only (codes, scales, zero
points, rings and a mixed state's side arrays alike; the lengths are replicated). Over "data"
the batch (axis `kivi_jax.cache.BATCH_AXIS` of every state array) is split. The embedding,
the norms and the output projection are replicated.

The model's entry points (`llama.prefill`, `llama.decode_step`, `llama.forward`) run under
`jax.shard_map` when their params carry a mesh (`shard_params`): each device runs the
unchanged block code on its shard (the fused Pallas kernels and cuDNN see local arrays), with
the config of one shard, whose `tensor_parallel_axis` sums the outputs of `wo` and `w_down`
over "model" (one all-reduce after attention and one after the MLP, per block). The decode loop
stays one jit: the shard_map sits inside it.

Column order. `w_qkv` is [d, N*D + 2*H*D] (q | k | v) and `w_gate_up` [d, 2F] (gate | up): a
plain column split would give a shard a mix of q and k columns. On a mesh they are stored in
per-shard order instead (shard i's columns contiguous: its q heads | its k heads | its v heads,
and its gate columns | its up columns), so that a plain column split over "model" gives each
shard exactly the fused matrix of its own heads. `unshard_params` restores the ordinary order.
On one device nothing is reordered and the program is the unsharded one.

Fewer KV heads than devices (H < M, M a multiple of H): each KV head is replicated over the
M / H devices whose query heads read it (as serving engines do). The cache then holds M heads,
head e a copy of KV head e // (M / H): its memory is M / H times that of H heads (each device
still holds one head), and `wk`, `wv` are stored M / H times.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kivi_jax import cache as cache_lib
from kivi_jax.models import llama
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import LayerWeights, LlamaParams
from kivi_jax.weights import QuantizedWeight

MODEL_AXIS = "model"
DATA_AXIS = "data"

# The split of each weight over "model" (rows or columns of x @ w); the rest is replicated.
_LAYER_SPECS = {
    "attn_norm": P(),
    "w_qkv": P(None, MODEL_AXIS),  # per-shard column order (module doc)
    "wo": P(MODEL_AXIS, None),
    "mlp_norm": P(),
    "w_gate_up": P(None, MODEL_AXIS),  # per-shard column order
    "w_down": P(MODEL_AXIS, None),
    "b_qkv": P(MODEL_AXIS),  # w_qkv's columns, in their order
    "q_norm": P(),
    "k_norm": P(),
}


def _model_size(mesh: Mesh) -> int:
    return mesh.shape[MODEL_AXIS]


def _data_axis(mesh: Mesh) -> str | None:
    return DATA_AXIS if DATA_AXIS in mesh.axis_names else None


def rows_spec(mesh: Mesh) -> P:
    """The PartitionSpec of a per-row array (rows on axis 0): rows over "data" if the mesh has
    it, else replicated."""
    return P(_data_axis(mesh))


def kv_heads_on_mesh(num_kv_heads: int, mesh: Mesh) -> int:
    """KV heads the state holds on `mesh`: num_kv_heads, or the "model" size M where KV heads
    are fewer than M and each is replicated (module doc)."""
    return max(num_kv_heads, _model_size(mesh))


def check_mesh(mesh, config: LlamaConfig, batch: int | None = None) -> None:
    """Raises unless `mesh` can run `config` (and a batch of `batch` rows, if given).

    Raises:
      TypeError: mesh is not a jax.sharding.Mesh.
      ValueError: no "model" axis, an axis other than "model" and "data", query heads or the
        MLP width not divisible by "model", KV heads neither divisible by "model" nor dividing
        it, a batch not divisible by "data".
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if MODEL_AXIS not in names:
        raise ValueError(
            f"mesh has axes {names}: it needs a {MODEL_AXIS!r} axis (tensor parallelism over "
            f"heads and MLP width; size 1 for none) and may have a {DATA_AXIS!r} axis (batch)"
        )
    other = [n for n in names if n not in (MODEL_AXIS, DATA_AXIS)]
    if other:
        raise ValueError(
            f"mesh axes {other} are not used: a mesh has a {MODEL_AXIS!r} axis and optionally "
            f"a {DATA_AXIS!r} axis, got {names}"
        )
    m, c = _model_size(mesh), config
    if c.num_heads % m:
        raise ValueError(
            f"{c.num_heads} query heads are not divisible by the {MODEL_AXIS!r} axis of {m} devices"
        )
    if c.intermediate_size % m:
        raise ValueError(
            f"the MLP width {c.intermediate_size} is not divisible by the {MODEL_AXIS!r} axis "
            f"of {m} devices"
        )
    h = c.num_kv_heads
    if (h >= m and h % m) or (h < m and m % h):
        raise ValueError(
            f"{h} KV heads are not divisible by the {MODEL_AXIS!r} axis of {m} devices (fewer "
            f"KV heads than devices is allowed where the axis is a multiple of them: each KV "
            f"head is then replicated over {MODEL_AXIS!r} devices)"
        )
    if batch is not None and DATA_AXIS in names and batch % mesh.shape[DATA_AXIS]:
        raise ValueError(
            f"a batch of {batch} rows is not divisible by the {DATA_AXIS!r} axis of "
            f"{mesh.shape[DATA_AXIS]} devices"
        )


def shard_config(config: LlamaConfig, mesh: Mesh) -> LlamaConfig:
    """The config of one shard: its query heads, KV heads and MLP width, and the mesh axis over
    which the attention and MLP outputs are summed (none on a "model" axis of one device: the
    shard is the whole model, and its program holds no all-reduce)."""
    m = _model_size(mesh)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // m,
        num_kv_heads=kv_heads_on_mesh(config.num_kv_heads, mesh) // m,
        intermediate_size=config.intermediate_size // m,
        tensor_parallel_axis=MODEL_AXIS if m > 1 else None,
    )


def _qkv_columns(config: LlamaConfig, m: int) -> np.ndarray:
    """For each column of the per-shard-ordered w_qkv, its column in the ordinary one."""
    n, h, d = config.num_heads, config.num_kv_heads, config.head_dim
    he = max(h, m)
    nl, hl = n // m, he // m
    heads = []
    for i in range(m):
        kv = [e * h // he for e in range(i * hl, (i + 1) * hl)]  # KV head of expanded head e
        heads += [*range(i * nl, (i + 1) * nl), *(n + j for j in kv), *(n + h + j for j in kv)]
    return (np.asarray(heads)[:, None] * d + np.arange(d)).reshape(-1)


def _gate_up_columns(config: LlamaConfig, m: int) -> np.ndarray:
    f = config.intermediate_size
    fl = f // m
    return np.concatenate(
        [np.r_[i * fl : (i + 1) * fl, f + i * fl : f + (i + 1) * fl] for i in range(m)]
    )


def _weight_spec(name: str, w, spec: P, m: int):
    """The spec of weight `name`: `spec` for a float array; for a QuantizedWeight, that of each
    of its arrays. A column split takes each array's columns alike. A row split takes the
    scales' and zero points' rows of the groups that its rows fall in: each shard's rows must
    be whole groups; per-channel scales (one row) are replicated. None for an absent weight
    (a bias or q/k norm the model has not)."""
    if w is None:
        return None
    if not isinstance(w, QuantizedWeight):
        return spec
    scales = spec
    if spec == P(MODEL_AXIS, None):
        n_in, groups = w.shape[0], w.scale.shape[0]
        if groups == 1:
            scales = P()
        elif groups % m:
            raise ValueError(
                f"{name} is quantized in groups of {n_in // groups} input rows, which do not "
                f"divide over the {MODEL_AXIS!r} axis of {m} devices: each shard's {n_in // m} "
                f"rows must be whole groups (the shard width a multiple of the group size)"
            )
    return QuantizedWeight(
        qvalue=spec, scale=scales, zero_point=None if w.zero_point is None else scales
    )


def param_specs(params: LlamaParams, mesh: Mesh | None = None) -> LlamaParams:
    """The PartitionSpec of every weight (a LlamaParams of specs; a QuantizedWeight's arrays
    each have theirs). `mesh` (default: the params') gives the "model" size a row-split
    quantized matrix's groups are checked against.

    Raises:
      ValueError: a row-split quantized matrix (wo, w_down) whose groups do not divide over
        "model".
    """
    mesh = params.mesh if mesh is None else mesh
    m = 1 if mesh is None else _model_size(mesh)
    layers = tuple(
        LayerWeights(
            **{
                name: _weight_spec(f"layers[{i}].{name}", getattr(lw, name), spec, m)
                for name, spec in _LAYER_SPECS.items()
            }
        )
        for i, lw in enumerate(params.layers)
    )
    return dataclasses.replace(
        params,
        embed=P(),
        layers=layers,
        final_norm=P(),
        lm_head=None if params.lm_head is None else jax.tree.map(lambda _: P(), params.lm_head),
    )


def param_sharding(params: LlamaParams, mesh: Mesh) -> LlamaParams:
    """The NamedSharding of every weight on `mesh` (a LlamaParams of shardings)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, mesh))


def shard_params(params: LlamaParams, mesh: Mesh) -> LlamaParams:
    """`params` placed on `mesh`: each device gets its shard (module doc: the per-shard column
    order of w_qkv and w_gate_up). The result carries the mesh, so the model's entry points run
    sharded. Params already on this mesh keep their order, each array moved to its shards where
    it is not there (weights quantized on the mesh: `load_model(..., mesh=, weights="int4")`).

    Arrays on one device (a GGUF or Hugging Face load) are copied into their shards; arrays
    already split over the mesh (`load_model(..., mesh=)` of a saved model) are reordered on
    the devices, one matrix at a time.

    Raises:
      ValueError: the mesh does not fit the model (check_mesh), or params on another mesh.
    """
    if params.mesh is not None:
        if params.mesh != mesh:
            raise ValueError("params are already placed on another mesh: unshard_params first")
        return jax.device_put(params, param_sharding(params, mesh))
    check_mesh(mesh, params.config)
    m = _model_size(mesh)
    cols = {
        "w_qkv": _qkv_columns(params.config, m),
        "b_qkv": _qkv_columns(params.config, m),
        "w_gate_up": _gate_up_columns(params.config, m),
    }
    shardings = param_sharding(params, mesh)

    def place(name, x, sharding):
        if x is None:  # a bias or q/k norm the model has not
            return None
        if name in cols and not np.array_equal(cols[name], np.arange(x.shape[-1])):
            # one reordered matrix at a time (a quantized one's arrays alike, all per column):
            # done before the next one starts
            x = jax.tree.map(lambda a: jnp.take(a, cols[name], axis=-1), x)
            return jax.block_until_ready(jax.device_put(x, sharding))
        return jax.device_put(x, sharding)

    layers = tuple(
        LayerWeights(
            **{
                f.name: place(f.name, getattr(lw, f.name), getattr(sh, f.name))
                for f in dataclasses.fields(LayerWeights)
            }
        )
        for lw, sh in zip(params.layers, shardings.layers, strict=True)
    )
    return dataclasses.replace(
        params,
        embed=jax.device_put(params.embed, shardings.embed),
        layers=layers,
        final_norm=jax.device_put(params.final_norm, shardings.final_norm),
        lm_head=None
        if params.lm_head is None
        else jax.device_put(params.lm_head, shardings.lm_head),
        mesh=mesh,
    )


def restore_targets(abstract: LlamaParams, mesh: Mesh) -> LlamaParams:
    """Shapes of the ordinary-order params with the shardings orbax restores them into: every
    array as `param_sharding` splits it, w_qkv and w_gate_up over their ordinary columns
    (`shard_params` then reorders them on the devices); a matrix whose columns do not divide
    over "model" is read replicated."""
    m = _model_size(mesh)

    def target(x, sharding):
        if tuple(sharding.spec)[-1:] == (MODEL_AXIS,) and x.shape[-1] % m:
            sharding = NamedSharding(mesh, P())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(target, abstract, param_sharding(abstract, mesh))


def unshard_params(params: LlamaParams) -> LlamaParams:
    """Params placed by `shard_params` back in the ordinary column order, without a mesh (the
    arrays stay where they are; `jax.device_get` brings them to the host)."""
    if params.mesh is None:
        return params
    m = _model_size(params.mesh)
    inverse = {}
    for name, cols in (
        ("w_qkv", _qkv_columns(params.config, m)),
        ("b_qkv", _qkv_columns(params.config, m)),
        ("w_gate_up", _gate_up_columns(params.config, m)),
    ):
        _, inverse[name] = np.unique(cols, return_index=True)  # the first copy of each column
    layers = tuple(
        dataclasses.replace(
            lw,
            **{
                n: jax.tree.map(lambda a, idx=idx: jnp.take(a, idx, axis=-1), getattr(lw, n))
                for n, idx in inverse.items()
            },
        )
        for lw in params.layers
    )
    return dataclasses.replace(params, layers=layers, mesh=None)


def cache_specs(caches, mesh: Mesh):
    """The PartitionSpec of every state array (same pytree as `caches`, one layer or a tuple):
    the batch axis over "data" (where the mesh has it), the KV-head axis over "model"."""
    data = _data_axis(mesh)

    def spec(path, x):
        axes = [None] * len(x.shape)
        axes[cache_lib.BATCH_AXIS] = data
        head = cache_lib.kv_head_axis(path)
        if head is not None:
            axes[head] = MODEL_AXIS
        return P(*axes)

    return jax.tree_util.tree_map_with_path(spec, caches)


def cache_sharding(caches, mesh: Mesh):
    """The NamedSharding of every state array on `mesh` (cache_specs)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(caches, mesh))


def init_cache(
    config,
    *,
    mesh: Mesh,
    batch: int,
    max_len: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
    num_layers: int | None = None,
):
    """`kivi_jax.init_cache` made directly in its shards on `mesh` (no device holds the whole
    state). `num_kv_heads` is the model's; the state holds kv_heads_on_mesh of them."""
    kw = dict(batch=batch, max_len=max_len, head_dim=head_dim, num_layers=num_layers)
    heads = kv_heads_on_mesh(num_kv_heads, mesh)
    return _cache_maker(config, mesh, heads, jnp.dtype(dtype), tuple(sorted(kw.items())))()


@functools.lru_cache(maxsize=64)
def _cache_maker(config, mesh: Mesh, num_kv_heads: int, dtype, kw: tuple):
    """One compiled program per state shape (a fresh jit per call would compile every time)."""

    def make():
        return cache_lib.init_cache(config, num_kv_heads=num_kv_heads, dtype=dtype, **dict(kw))

    return jax.jit(make, out_shardings=cache_sharding(jax.eval_shape(make), mesh))


# ----------------------------------------------------------------------------- sharded entry points


def _local(params: LlamaParams, mesh: Mesh) -> LlamaParams:
    """Inside shard_map: one shard's weights with the config of one shard."""
    return dataclasses.replace(params, config=shard_config(params.config, mesh), mesh=None)


def _batch_spec(mesh: Mesh, x):
    return None if x is None else P(_data_axis(mesh))


def _shard_map(fn, mesh, in_specs, out_specs):
    # check_vma off: the Pallas kernels and cuDNN's attention inside have no replication rules;
    # every output declared replicated over "model" follows the all-reduces.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def decode_step(params: LlamaParams, tokens, positions, caches, active=None):
    """`llama.decode_step` on the mesh that `params` carry (same arguments and results)."""
    mesh = params.mesh
    cspecs = cache_specs(caches, mesh)

    def step(p, tokens, positions, caches, active):
        caches = _local_pages(caches, mesh)
        return llama.decode_step(_local(p, mesh), tokens, positions, caches, active)

    b = P(_data_axis(mesh))
    in_specs = (param_specs(params), b, b, cspecs, _batch_spec(mesh, active))
    return _shard_map(step, mesh, in_specs, (b, cspecs))(params, tokens, positions, caches, active)


def _local_pages(caches, mesh: Mesh):
    """Inside shard_map: each PagedCache's table with the shard's own page ids (global ids
    minus the pages of the "data" shards before it; kivi_jax.serving.pool: a slot's pages are
    its shard's)."""
    from kivi_jax.paged import NO_PAGE, PagedCache

    def local(c):
        if not isinstance(c, PagedCache) or _data_axis(mesh) is None:
            return c
        first = jax.lax.axis_index(DATA_AXIS) * c.num_pages
        return dataclasses.replace(c, table=jnp.where(c.table == NO_PAGE, NO_PAGE, c.table - first))

    return tuple(local(c) for c in caches)


def prefill(params: LlamaParams, tokens, lengths, caches, *, rows: int | None = None):
    """`llama.prefill` on the mesh that `params` carry; `rows` counts the rows of one "data"
    shard."""
    mesh = params.mesh
    cspecs = cache_specs(caches, mesh)

    def run(p, tokens, lengths, caches):
        return llama.prefill(_local(p, mesh), tokens, lengths, caches, rows=rows)

    b = P(_data_axis(mesh))
    in_specs = (param_specs(params), b, b, cspecs)
    return _shard_map(run, mesh, in_specs, (b, cspecs))(params, tokens, lengths, caches)


def scratch_spec(mesh: Mesh) -> P:
    """The PartitionSpec of a chunked prefill's full-precision K/V scratch [B, P, H, D]
    (`llama.prefill_chunk`): rows over "data", KV heads over "model", as the state's."""
    return P(_data_axis(mesh), None, MODEL_AXIS, None)


def prefill_chunk(params: LlamaParams, tokens, offset, count, scratch, caches, *,
                  every_position: bool = False):  # fmt: skip
    """`llama.prefill_chunk` on the mesh that `params` carry; the scratch as `scratch_spec`."""
    mesh = params.mesh
    cspecs = cache_specs(caches, mesh)
    sspecs = jax.tree.map(lambda _: scratch_spec(mesh), scratch)

    def run(p, tokens, offset, count, scratch, caches):
        return llama.prefill_chunk(
            _local(p, mesh), tokens, offset, count, scratch, caches, every_position=every_position
        )

    b = P(_data_axis(mesh))
    in_specs = (param_specs(params), b, P(), b, sspecs, cspecs)
    out_specs = (b, sspecs, cspecs)
    return _shard_map(run, mesh, in_specs, out_specs)(
        params, tokens, offset, count, scratch, caches
    )


def forward(params: LlamaParams, tokens, lengths=None, *, attention=None):
    """`llama.forward` on the mesh that `params` carry."""
    mesh = params.mesh

    def run(p, tokens, lengths):
        return llama.forward(_local(p, mesh), tokens, lengths, attention=attention)

    b = P(_data_axis(mesh))
    in_specs = (param_specs(params), b, _batch_spec(mesh, lengths))
    return _shard_map(run, mesh, in_specs, b)(params, tokens, lengths)


def mesh_for(params: LlamaParams, mesh: Mesh | None) -> Mesh | None:
    """The mesh a call runs on: `mesh`, or the one `params` were placed on (ValueError if both
    are given and differ)."""
    if mesh is not None and params.mesh is not None and mesh != params.mesh:
        raise ValueError("mesh differs from the mesh the params are placed on (params.mesh)")
    return params.mesh if mesh is None else mesh


def tensor_parallel_mesh(n: int, devices=None) -> Mesh:
    """A mesh of the first `n` devices (default: jax.devices()) on one "model" axis."""
    devices = jax.devices() if devices is None else list(devices)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor parallelism needs a positive number of devices, got {n!r}")
    if n > len(devices):
        raise ValueError(f"tensor parallelism over {n} devices, but only {len(devices)} are here")
    return Mesh(np.asarray(devices[:n]), (MODEL_AXIS,))
