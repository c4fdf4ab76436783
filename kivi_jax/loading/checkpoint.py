"""Converted params saved with orbax-checkpoint, for fast reloads (no dequantization, no parsing).

A saved model is a directory:
  kivi_model.json   format marker, the LlamaConfig, dtype, tokenizer ids and chat template
  tokenizer.json    the tokenizer (tokenizers' own format)
  params/           the weights as an orbax checkpoint of a nested dict of arrays; a quantized
                    matrix (kivi_jax.weights.QuantizedWeight) is a dict of its qvalue, scale and
                    zero_point (absent when None)
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from kivi_jax.loading.errors import ModelLoadError
from kivi_jax.loading.tokenizer import Tokenizer
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import LayerWeights, LlamaParams, validate_params
from kivi_jax.weights import QuantizedWeight

MARKER = "kivi_model.json"
_FORMAT = "kivi-jax-orbax-v4"  # v4: matrices may be quantized (dicts); v3 reads the same way
_READABLE = ("kivi-jax-orbax-v3", _FORMAT)


def is_saved_model(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def _entry(w):
    """A float array as is; a QuantizedWeight as a dict of its arrays."""
    if not isinstance(w, QuantizedWeight):
        return w
    entry = {"qvalue": w.qvalue, "scale": w.scale}
    return entry if w.zero_point is None else entry | {"zero_point": w.zero_point}


def _weight(entry):
    return QuantizedWeight(**entry) if isinstance(entry, dict) else entry


def _from_tree(tree: dict, config: LlamaConfig) -> LlamaParams:
    return LlamaParams(
        embed=tree["embed"],
        layers=tuple(
            LayerWeights(**{k: _weight(v) for k, v in lw.items()}) for lw in tree["layers"]
        ),
        final_norm=tree["final_norm"],
        lm_head=_weight(tree.get("lm_head")),
        config=config,
    )


def _first_sentence(e: Exception) -> str:
    """TensorStore's message runs to ~60 lines: its first sentence."""
    first = str(e).strip().split("See full TensorStore")[0].strip().splitlines()
    return first[0][:200] if first else type(e).__name__


def _to_tree(params: LlamaParams) -> dict:
    tree = {
        "embed": params.embed,
        "final_norm": params.final_norm,
        "layers": [
            {
                f.name: _entry(getattr(lw, f.name))
                for f in dataclasses.fields(LayerWeights)
                if getattr(lw, f.name) is not None  # a bias or q/k norm the model has not
            }
            for lw in params.layers
        ],
    }
    if params.lm_head is not None:
        tree["lm_head"] = _entry(params.lm_head)
    return tree


def save_model(params: LlamaParams, tokenizer: Tokenizer, directory: str) -> None:
    """Writes params + tokenizer to `directory` (created; must not already hold a checkpoint).
    Params on a mesh are written in the ordinary column order, each device its part."""
    import orbax.checkpoint as ocp

    from kivi_jax.sharding import unshard_params

    params = unshard_params(params)
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(directory, "params"), _to_tree(params))
    checkpointer.wait_until_finished()
    tokenizer.backend.save(os.path.join(directory, "tokenizer.json"))
    meta = {
        "format": _FORMAT,
        # a model's config: tensor_parallel_axis is None (only a shard's config sets it)
        "config": {
            k: v
            for k, v in dataclasses.asdict(params.config).items()
            if k != "tensor_parallel_axis"
        },
        "dtype": jnp.dtype(params.dtype).name,
        "eos_id": tokenizer.eos_id,
        "bos_id": tokenizer.bos_id,
        "chat_template": tokenizer.chat_template,
    }
    with open(os.path.join(directory, MARKER), "w") as f:
        json.dump(meta, f, indent=1)


def restore_model(directory: str, *, dtype=None, mesh=None):
    """Reads a directory written by `save_model`. Returns (LlamaParams, Tokenizer).

    With a `mesh` (kivi_jax.sharding), orbax restores every array straight into its shards
    on the mesh (each device reads its part of the checkpoint; no host holds the whole
    model), and the params come back placed on it (`sharding.shard_params`). The shards
    follow the arrays as saved (their shapes and dtypes from the checkpoint's metadata), so a
    quantized model is restored as one.

    Raises:
      ModelLoadError: an unreadable or damaged directory.
      ValueError: a mesh the model does not fit (sharding.check_mesh), or quantized groups
        that do not divide over it (sharding.param_specs).
    """
    import orbax.checkpoint as ocp
    import tokenizers

    directory = os.path.abspath(directory)
    try:
        with open(os.path.join(directory, MARKER)) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{directory}: unreadable {MARKER} ({e})") from e
    if meta.get("format") not in _READABLE:
        raise ModelLoadError(
            f"{directory}: saved-model format {meta.get('format')!r}, this version reads "
            f"{_FORMAT!r} (save the model again with this version's save_model)"
        )
    try:
        # JSON gives lists where the config holds tuples (rope_factors)
        as_tuple = lambda v: tuple(v) if isinstance(v, list) else v
        config = LlamaConfig(**{k: as_tuple(v) for k, v in meta["config"].items()})
        saved_dtype = jnp.dtype(meta["dtype"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(
            f"{directory}: {MARKER} has no valid config and dtype ({type(e).__name__}: {e})"
        ) from None
    saved_params = os.path.join(directory, "params")
    damaged = lambda e: ModelLoadError(
        f"{directory}: cannot restore the params checkpoint, damaged or incomplete "
        f"({_first_sentence(e)})"
    )
    target = None  # without a mesh: the arrays as saved (shapes and dtypes from the metadata)
    if mesh is not None:  # each array restored straight into its shards
        from kivi_jax import sharding

        sharding.check_mesh(mesh, config)
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                saved = checkpointer.metadata(saved_params).item_metadata.tree
            abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), saved)
            abstract = _from_tree(abstract, config)
        except Exception as e:
            raise damaged(e) from None
        target = _to_tree(sharding.restore_targets(abstract, mesh))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = _from_tree(checkpointer.restore(saved_params, target), config)
    except Exception as e:
        raise damaged(e) from None
    try:
        validate_params(params)
    except ValueError as e:
        raise ModelLoadError(f"{directory}: {e}") from None
    if dtype is not None and jnp.dtype(dtype) != saved_dtype:
        params = params.astype(dtype)
    if mesh is not None:
        params = sharding.shard_params(params, mesh)
    tokenizer = Tokenizer(
        backend=tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json")),
        eos_id=meta.get("eos_id"),
        bos_id=meta.get("bos_id"),
        chat_template=meta.get("chat_template"),
    )
    return params, tokenizer
