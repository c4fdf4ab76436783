"""Today's model families against transformers: tiny random checkpoints made by transformers
itself (`<Family>ForCausalLM(config)` with the family's switches, `save_pretrained` beside a
tokenizer) load through `load_model` to transformers' float32 logits.

Tolerance: test_hf_reference.py's (5e-4 absolute on logits; both sides compute in float32).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TOKENS, write_tokenizer_files

import kivi_jax

torch = pytest.importorskip("torch", reason="needs the [hf] extra (CPU torch)")
transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")

ATOL = 5e-4
PROMPT = 300
TINY = dict(  # 2 layers, 8 query / 2 KV heads of width 32
    vocab_size=len(TOKENS),
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    initializer_range=0.1,  # larger than the default 0.02: attention that a RoPE error moves
    bos_token_id=0,
    eos_token_id=2,
)
CLASSES = {"llama": "LlamaForCausalLM"}


def save_family(directory, model_type: str, **config):
    """A random `model_type` model saved by transformers into `directory` with the tiny
    tokenizer; returns the torch model (float32, eval mode)."""
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, **config})
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[model_type])(cfg).eval()
    model.save_pretrained(directory)
    write_tokenizer_files(str(directory))
    return model


def prompt_ids(n: int = PROMPT, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, len(TOKENS), size=(1, n))


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


def assert_same_logits(directory, model, ids):
    ours = kivi_jax.forward(kivi_jax.load_model(directory, dtype=jnp.float32).params, ids)
    np.testing.assert_allclose(np.asarray(ours), torch_logits(model, ids), atol=ATOL, rtol=0)


def test_rope_parameters_of_transformers_5_are_read(tmp_path):
    """transformers 5 writes rope_theta inside `rope_parameters`: a theta of 500000 must not
    load as the default 10000."""
    model = save_family(tmp_path, "llama", rope_theta=500000.0)
    assert kivi_jax.load_model(tmp_path).config.rope_theta == 500000.0
    assert_same_logits(tmp_path, model, prompt_ids())


LLAMA3 = dict(  # Llama 3.1's rule, its original context (8192) scaled to the tiny model's
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=128,
)


def test_rope_scaling_inside_rope_parameters_is_not_ignored(tmp_path):
    """A Llama 3.1 saved by transformers 5 has its llama3 scaling in `rope_parameters`."""
    save_family(tmp_path, "llama", rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    with pytest.raises(kivi_jax.ModelLoadError, match="rope type 'llama3'"):
        kivi_jax.load_model(tmp_path)
