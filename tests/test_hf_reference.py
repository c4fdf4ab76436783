"""The default checkpoint against an independent implementation: HF transformers'
LlamaForCausalLM loading the same GGUF (float32, CPU).

Live when torch and transformers are installed; otherwise against the committed figures in
tests/fixtures/hf_reference.npz (regenerate with tests/fixtures/make_hf_reference.py).
Both implementations dequantize the same Q4_1 weights to float32, so the logits agree to float32
rounding over a 695-token prompt: measured max |diff| ~5e-5 on logits up to ~40.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_reference.npz")
ATOL = 5e-4  # ~10x the measured float32 disagreement; a RoPE or permutation bug is >> 1


def _compare(model, figures):
    assert model.tokenizer.encode(str(figures["text"])) == figures["ids"].tolist()
    logits = np.asarray(kivi_jax.forward(model.params, jnp.asarray(figures["ids"])[None]))[0]
    rows = logits[figures["positions"]]
    np.testing.assert_allclose(
        np.take_along_axis(rows, figures["top_ids"], -1), figures["top_logits"], atol=ATOL, rtol=0
    )
    top = rows.max(-1, keepdims=True)
    lse = np.log(np.exp(rows - top).sum(-1)) + top[:, 0]
    np.testing.assert_allclose(lse, figures["lse"], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(logits.argmax(-1), figures["argmax"])


def test_logits_match_committed_transformers_figures(smollm_f32):
    _compare(smollm_f32, dict(np.load(FIXTURE)))


def test_logits_match_transformers_live(smollm_f32, default_gguf):
    pytest.importorskip("torch", reason="live comparison needs the [hf] extra (torch)")
    pytest.importorskip("transformers", reason="live comparison needs the [hf] extra")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to read GGUF")
    import sys

    sys.path.insert(0, os.path.dirname(FIXTURE))
    try:
        from make_hf_reference import reference
    finally:
        sys.path.pop(0)
    _compare(smollm_f32, reference(default_gguf))


def test_default_model_loads_in_bfloat16_with_chat_template(default_gguf):
    model = kivi_jax.load_model()
    c = model.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.max_context) == (30, 9, 3, 8192)
    assert model.params.embed.dtype == jnp.bfloat16
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    assert model.tokenizer.decode([model.tokenizer.eos_id], skip_special_tokens=False) == (
        "<|im_end|>"
    )


def test_tokenizer_and_chat_template_match_transformers(smollm_f32, default_gguf):
    transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")
    directory, name = os.path.split(default_gguf)
    theirs = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    ours = smollm_f32.tokenizer  # the session's load of the same file
    messages = [{"role": "user", "content": "Écris 12345 mots, s'il te plaît!\n\tOK?"}]
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == rendered
    assert ours.encode(rendered) == theirs(rendered, add_special_tokens=False)["input_ids"]
