"""A tiny random-weight Llama and writers that store it as a GGUF file or a Hugging Face directory,
so every loading path is tested end to end in milliseconds, without the real checkpoint."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from kivi_jax.models import llama
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import LlamaParams, init_params
from tokenizers import decoders, models, pre_tokenizers

import kivi_jax
from kivi_jax.generate import resolve_kv

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte-level symbols
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
TOKENS = SPECIAL + ALPHABET + [a + b for a, b in (m.split(" ") for m in MERGES)]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def tiny_config(**overrides) -> LlamaConfig:
    """2 layers, 4 query / 2 KV heads of width 32 (one KIVI group of 32 channels)."""
    fields = dict(
        vocab_size=len(TOKENS),
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rms_eps=1e-5,
        tie_embeddings=True,
        max_context=256,
    )
    return LlamaConfig(**{**fields, **overrides})


def tiny_params(seed: int = 0, dtype=jnp.float32, **overrides) -> LlamaParams:
    return init_params(tiny_config(**overrides), jax.random.key(seed), dtype)


def teacher_forced_logits(params: LlamaParams, kv, *, batch=2, prompt=200, steps=140,
                          max_len=512) -> jax.Array:  # fmt: skip
    """Logits [steps, batch, V] of decode steps fed random tokens after a random prompt (row 1
    50 tokens shorter), attending through whatever `llama.decode_attention` is when called."""
    c = params.config
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, c.vocab_size, size=(batch, prompt + steps)), jnp.int32)
    lengths = jnp.array([prompt - 50 * (i % 2) for i in range(batch)], jnp.int32)
    cache = kivi_jax.init_cache(
        resolve_kv(kv), batch=batch, max_len=max_len, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, dtype=jnp.bfloat16, num_layers=c.num_layers,
    )  # fmt: skip
    # fresh lambdas: jit would reuse a trace of llama's functions made with another attention
    _, cache = jax.jit(lambda *a: llama.prefill(*a))(params, tokens[:, :prompt], lengths, cache)
    step = jax.jit(lambda *a: llama.decode_step(*a))
    logits = []
    for t in range(steps):
        out, cache = step(params, tokens[:, prompt + t], lengths + t, cache)
        logits.append(out)
    return jnp.stack(logits)


def gguf_tokenizer_fields() -> dict:
    types = [3] * len(SPECIAL) + [1] * (len(TOKENS) - len(SPECIAL))
    return dict(tokens=TOKENS, merges=MERGES, types=types)


def hf_tokenizer() -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(TOKENS)},
            merges=[tuple(m.split(" ")) for m in MERGES],
        )
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIAL])
    return backend


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `permute` (HF rotate-half rows -> llama.cpp interleaved rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_weights(params: LlamaParams) -> dict[str, np.ndarray]:
    """Params as transformers' LlamaForCausalLM state dict (float32 numpy, [out, in])."""
    out = {
        "model.embed_tokens.weight": np.asarray(params.embed, np.float32),
        "model.norm.weight": np.asarray(params.final_norm, np.float32),
    }
    if params.lm_head is not None:
        out["lm_head.weight"] = np.asarray(params.lm_head, np.float32).T
    names = {
        "attn_norm": "input_layernorm",
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj",
        "mlp_norm": "post_attention_layernorm",
        "w_gate": "mlp.gate_proj",
        "w_up": "mlp.up_proj",
        "w_down": "mlp.down_proj",
    }
    for i, lw in enumerate(params.layers):
        for field, hf in names.items():
            w = np.asarray(getattr(lw, field), np.float32)
            out[f"model.layers.{i}.{hf}.weight"] = w if w.ndim == 1 else w.T
    return out


def write_gguf(
    path: str, params: LlamaParams, *, arch: str = "llama", quant=None, extra=None
) -> None:
    """Writes params in llama.cpp's GGUF layout (Q/K rows permuted); `quant` quantizes matrices;
    `extra` ({name: float32 array}) adds tensors."""
    import gguf

    c = params.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_context)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    tok = gguf_tokenizer_fields()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tok["tokens"])
    w.add_token_merges(tok["merges"])
    w.add_token_types(tok["types"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    def add(name, x):
        x = np.ascontiguousarray(x, np.float32)
        if quant is not None and x.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(x, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, x)

    hf = _hf_weights(params)
    add("token_embd.weight", hf["model.embed_tokens.weight"])
    add("output_norm.weight", hf["model.norm.weight"])
    if "lm_head.weight" in hf:
        add("output.weight", hf["lm_head.weight"])
    gguf_names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(c.num_layers):
        for hf_name, g_name in gguf_names.items():
            x = hf[f"model.layers.{i}.{hf_name}.weight"]
            if g_name == "attn_q":
                x = llama_cpp_permute(x, c.num_heads)
            elif g_name == "attn_k":
                x = llama_cpp_permute(x, c.num_kv_heads)
            add(f"blk.{i}.{g_name}.weight", x)
    for name, x in (extra or {}).items():
        add(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_hf_dir(directory: str, params: LlamaParams, **config_overrides) -> None:
    """Writes config.json + model.safetensors + tokenizer files like transformers would."""
    from safetensors.numpy import save_file

    c = params.config
    os.makedirs(directory, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "max_position_embeddings": c.max_context,
        "hidden_act": "silu",
        "rope_scaling": None,
        "bos_token_id": 0,
        "eos_token_id": 2,
        **config_overrides,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    weights = _hf_weights(params)
    save_file(
        {k: np.ascontiguousarray(v) for k, v in weights.items()},
        os.path.join(directory, "model.safetensors"),
    )
    write_tokenizer_files(directory)


def write_tokenizer_files(directory: str) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) of the tiny vocabulary."""
    hf_tokenizer().save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "eos_token": "<|im_end|>",
                "bos_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            },
            f,
        )


def _llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs tensor for llama3 scaling: per frequency 1 (short
    wavelengths), `factor` (long ones) or 1 / the blend between them."""
    import math

    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < old / high:
            out.append(1.0)
        elif wavelength > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def gguf_from_hf_dir(path: str, directory: str, arch: str) -> None:
    """A Hugging Face directory saved by transformers (config.json in transformers 5's
    spelling, model.safetensors) written as llama.cpp's converter writes architecture `arch`:
    "llama" permutes the Q/K rows and stores llama3 scaling as a rope_freqs tensor; "qwen2" and
    "qwen3" keep the rows (NEOX RoPE), qwen2 adds attn_{q,k,v}.bias, qwen3 attn_{q,k}_norm."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    hf = load_file(os.path.join(directory, "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim") is not None:  # the converter writes it where the config has one
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    tok = gguf_tokenizer_fields()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tok["tokens"])
    w.add_token_merges(tok["merges"])
    w.add_token_types(tok["types"])
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(rope, head_dim))
    add = lambda name, x: w.add_tensor(name, np.ascontiguousarray(x, np.float32))
    add("token_embd.weight", hf["model.embed_tokens.weight"])
    add("output_norm.weight", hf["model.norm.weight"])
    if "lm_head.weight" in hf:
        add("output.weight", hf["lm_head.weight"])
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, g_name in names.items():
            x = hf.get(f"model.layers.{i}.{hf_name}")
            if x is None:
                continue
            if arch == "llama" and g_name.startswith(("attn_q.", "attn_k.")):
                x = llama_cpp_permute(x, heads if g_name.startswith("attn_q.") else kv_heads)
            add(f"blk.{i}.{g_name}", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
