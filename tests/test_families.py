"""Today's model families against transformers: tiny random checkpoints made by transformers
itself (`<Family>ForCausalLM(config)` with the family's switches, `save_pretrained` beside a
tokenizer) load through `load_model` to transformers' float32 logits.

Tolerance: test_hf_reference.py's (5e-4 absolute on logits; both sides compute in float32).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TOKENS, gguf_from_hf_dir, write_tokenizer_files

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
CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def save_family(directory, model_type: str, **config):
    """A random `model_type` model saved by transformers into `directory` with the tiny
    tokenizer; returns the torch model (float32, eval mode). Biases and norm weights, which
    transformers initializes to 0 and 1, are drawn at random too, so that a bias or norm read
    wrongly shows in the logits."""
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, **config})
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[model_type])(cfg).eval()
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("bias"):
                w.normal_(0.0, 0.5)
            elif "norm" in name:
                w.normal_(1.0, 0.2)
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


SCALINGS = {
    "llama3": LLAMA3,
    "linear": dict(rope_type="linear", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=128),
}


@pytest.mark.parametrize("rule", SCALINGS)
def test_rope_scaling_matches_transformers(tmp_path, rule):
    """Each scaling rule over a prompt past the original context (300 > 128 positions), in
    transformers 5's spelling (rope_parameters) and the older one (rope_scaling, rope_theta)."""
    model = save_family(tmp_path, "llama", rope_parameters={**SCALINGS[rule], "rope_theta": 5e5})
    ids = prompt_ids()
    assert_same_logits(tmp_path, model, ids)
    config = json.loads((tmp_path / "config.json").read_text())
    scaling = config.pop("rope_parameters")
    config |= {"rope_theta": scaling.pop("rope_theta"), "rope_scaling": scaling}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_same_logits(tmp_path, model, ids)


def test_llama3_gguf_with_rope_freqs_gives_the_safetensors_logits(tmp_path):
    """llama.cpp stores llama3 scaling as the rope_freqs tensor (tiny_model.gguf_from_hf_dir
    writes it as its converter does)."""
    save_family(tmp_path, "llama", rope_parameters={**LLAMA3, "rope_theta": 5e5})
    gguf_from_hf_dir(str(tmp_path / "m.gguf"), str(tmp_path), "llama")
    ids = prompt_ids()
    hf = kivi_jax.load_model(tmp_path, dtype=jnp.float32)
    gg = kivi_jax.load_model(tmp_path / "m.gguf", dtype=jnp.float32)
    assert gg.config.rope_factors == pytest.approx(hf.config.rope_factors, rel=1e-6)
    np.testing.assert_allclose(
        kivi_jax.forward(gg.params, ids), kivi_jax.forward(hf.params, ids), atol=ATOL, rtol=0
    )
    kivi_jax.save_model(hf, tmp_path / "saved")  # the factors survive a save (JSON lists)
    assert kivi_jax.load_model(tmp_path / "saved").config == hf.config


@pytest.mark.parametrize(
    "rope_parameters, message",
    [
        (dict(rope_type="longrope", rope_theta=1e4), "rope type 'longrope' is not implemented"),
        (dict(rope_type="linear", factor=2.0, partial_rotary_factor=0.5, rope_theta=1e4),
         r"fields \['partial_rotary_factor'\] are not implemented"),
        (dict(rope_type="llama3", factor=8.0, rope_theta=1e4), "lacks"),
    ],
)  # fmt: skip
def test_rope_rules_not_implemented_are_refused(tmp_path, rope_parameters, message):
    save_family(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"rope_parameters": rope_parameters}))
    with pytest.raises(kivi_jax.ModelLoadError, match=message):
        kivi_jax.load_model(tmp_path)


# Each family with its switches, as its published sizes set them (README's table).
FAMILIES = {
    "llama3.2": (
        "llama",
        dict(tie_word_embeddings=True, rope_parameters={**LLAMA3, "rope_theta": 5e5}),
    ),
    "qwen2.5": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("qwen3", dict(head_dim=64, rope_theta=1e6)),
    "mistral": ("mistral", dict(sliding_window=64)),  # a window shorter than the prompt
}
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
NEW = 16


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(directory, torch model, name) of one family's tiny checkpoint, made once per module."""
    model_type, config = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    return directory, save_family(directory, model_type, **config), request.param


def test_logits_match_transformers(family):
    directory, model, _ = family
    assert_same_logits(directory, model, prompt_ids())


def test_greedy_full_cache_tokens_match_transformers_generate(family):
    directory, model, _ = family
    ids = prompt_ids()
    model.generation_config.eos_token_id = None  # 16 tokens, as ours without an eos
    with torch.no_grad():
        theirs = model.generate(torch.as_tensor(ids), max_new_tokens=NEW, do_sample=False)
    params = kivi_jax.load_model(directory, dtype=jnp.float32).params
    ours = kivi_jax.generate(params, ids, kv="full", max_new_tokens=NEW)
    np.testing.assert_array_equal(np.asarray(ours), theirs[:, ids.shape[1] :].numpy())


@pytest.mark.parametrize("kv", ["kivi2", "kivi2-mix"])
def test_kivi_caches_run_through_generate_and_the_engine(family, kv):
    """The quantized caches through generate and the engine: the engine's greedy tokens for a
    prompt are generate's for it alone."""
    from kivi_jax.serving import Engine

    directory, _, _ = family
    params = kivi_jax.load_model(directory, dtype=jnp.float32).params
    ids = prompt_ids(200, seed=1)
    alone = np.asarray(kivi_jax.generate(params, ids, kv=kv, max_new_tokens=NEW))[0]
    assert alone.shape == (NEW,) and ((alone >= 0) & (alone < len(TOKENS))).all()
    engine = Engine(params, kv=kv, slots=1, max_len=256, prefill_chunk=128, decode_steps=8)
    handle = engine.submit(ids[0].tolist(), max_new_tokens=NEW)
    while engine.step():
        pass
    assert handle.result() == alone.tolist()


def test_gguf_gives_the_safetensors_logits(family):
    """The same weights written as llama.cpp's converter writes the family's architecture."""
    directory, _, name = family
    if FAMILIES[name][0] not in GGUF_ARCH:
        pytest.skip("llama.cpp writes Mistral as 'llama' without its window")
    arch = GGUF_ARCH[FAMILIES[name][0]]
    path = str(directory / f"{arch}.gguf")
    gguf_from_hf_dir(path, str(directory), arch)
    ids = prompt_ids()
    hf = kivi_jax.load_model(directory, dtype=jnp.float32)
    gg = kivi_jax.load_model(path, dtype=jnp.float32)
    np.testing.assert_allclose(
        kivi_jax.forward(gg.params, ids), kivi_jax.forward(hf.params, ids), atol=ATOL, rtol=0
    )


def test_sliding_window_reaches_the_reference_only(rng):
    """The fused kernels do not apply a window: impl="pallas" says so, "auto" takes the
    reference, which reads only the last W tokens (checked by hand, to bf16 output rounding)."""
    cache = kivi_jax.init_cache(
        kivi_jax.KIVI2, batch=2, max_len=256, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16
    )
    k, v = (jnp.asarray(rng.normal(size=(2, 200, 2, 64)), jnp.bfloat16) for _ in range(2))
    cache = kivi_jax.prefill(cache, k, v, lengths=jnp.asarray([200, 90]))
    q = jnp.asarray(rng.normal(size=(2, 8, 64)), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="sliding window"):
        kivi_jax.decode_attention(q, cache, impl="pallas", interpret=True, window=64)
    out = np.asarray(kivi_jax.decode_attention(q, cache, window=64), np.float32)
    # By hand: each row's query heads over its last 64 held tokens only (HF Mistral's window:
    # the token itself and the 63 before it), in float64 over the dequantized state.
    k, v = (np.asarray(x, np.float64) for x in kivi_jax.dequantize(cache, jnp.float32))
    qf = np.asarray(q, np.float64)
    for b, n in enumerate([200, 90]):
        for head in range(8):
            keys, vals = k[b, n - 64 : n, head // 4], v[b, n - 64 : n, head // 4]
            s = keys @ qf[b, head] / 8.0
            p = np.exp(s - s.max())
            want = p @ vals / p.sum()
            np.testing.assert_allclose(out[b, head], want, atol=2e-2, rtol=2e-2)
    assert not np.allclose(out, kivi_jax.decode_attention(q, cache), atol=1e-2)


def test_a_replaced_prompt_attention_runs_where_the_window_cannot_matter():
    """kivi-eval's views replace the prompt attention, which applies no window: a prompt no
    longer than the window runs (its logits the model's own), a longer one is refused."""
    from kivi_jax.models.llama import LlamaConfig, init_params

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=8, max_context=128, sliding_window=16,
    )  # fmt: skip
    params = init_params(config, jax.random.key(0), jnp.float32)

    def causal(q, k, v, lengths):  # [B, S, N, D] full-precision causal attention
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    ids = jnp.asarray(prompt_ids(16, seed=2) % 64)
    np.testing.assert_allclose(
        kivi_jax.forward(params, ids, attention=causal), kivi_jax.forward(params, ids),
        atol=1e-5, rtol=0,
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="a prompt of 17 tokens reaches past"):
        kivi_jax.forward(params, jnp.asarray(prompt_ids(17, seed=2) % 64), attention=causal)
