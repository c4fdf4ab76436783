"""kivi-jax: KIVI 2-bit KV-cache quantization for JAX, with a Llama model to run it on."""

from kivi_jax.loading import Model, ModelLoadError, Tokenizer, load_model, save_model
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import LlamaParams, forward, init_params

__all__ = [
    "LlamaConfig",
    "LlamaParams",
    "Model",
    "ModelLoadError",
    "Tokenizer",
    "forward",
    "init_params",
    "load_model",
    "save_model",
]
