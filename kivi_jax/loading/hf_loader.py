"""Hugging Face-style directories: config.json + *.safetensors + tokenizer.json.

model_type "llama" (Llama 3.x, SmolLM), "mistral", "qwen2" and "qwen3", mapped onto the one model's
config switches (docs/design.md). Every config.json field is read or listed as harmless, and
every tensor read: anything else, and features the model does not implement, are refused with a
clear error rather than giving silently wrong logits.
"""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp
import numpy as np

from kivi_jax.loading.errors import ModelLoadError
from kivi_jax.loading.tokenizer import Tokenizer
from kivi_jax.models import rope
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import LayerWeights, LlamaParams, validate_params

_SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Families refused by name (what they need is not implemented).
_GEMMA = ("gemma", "gemma2", "gemma3", "gemma3_text")
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "llama4", "olmoe")

# Every config.json field: read (the model's shape and numerics, or checked below), or known to
# leave the numbers alone. Any other field is a ModelLoadError naming it, never a default.
_READ = frozenset(
    {
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings", "rope_theta", "rope_scaling",
        "rope_parameters", "attention_bias", "mlp_bias", "pretraining_tp", "sliding_window",
        "use_sliding_window", "layer_types", "bos_token_id", "eos_token_id", "rope_interleaved",
    }
)  # fmt: skip
_HARMLESS = {
    "architectures": "the transformers class name",
    "transformers_version": "the version that wrote the file",
    "torch_dtype": "the stored dtype (the tensors carry theirs)",
    "dtype": "the stored dtype (transformers 5's name)",
    "use_cache": "a transformers runtime option",
    "initializer_range": "training only",
    "attention_dropout": "training only",
    "pad_token_id": "the tokenizer's padding, not used",
    "max_window_layers": "Qwen's windowed layers, none with use_sliding_window false",
    "_name_or_path": "where the checkpoint came from",
    "is_llama_config": "nanotron's marker of a Llama config (SmolLM2's checkpoints)",
}


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _rope_fields(cfg: dict, where: str) -> tuple[float, str, dict]:
    """(rope_theta, rope type, the type's other fields) from either spelling: transformers 5's
    `rope_parameters` (rope_theta and rope_type inside it) or the older `rope_theta` +
    `rope_scaling` ("type" in still older files). A missing theta is transformers' 10000."""
    params, scaling = cfg.get("rope_parameters"), cfg.get("rope_scaling")
    if params is not None and scaling is not None:
        raise ModelLoadError(f"{where}: both rope_parameters and rope_scaling are set")
    fields = dict(params if params is not None else scaling or {})
    if any(isinstance(v, dict) for v in fields.values()):
        raise ModelLoadError(f"{where}: RoPE parameters per layer type are not implemented")
    theta = fields.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    if cfg.get("rope_theta", theta) != theta:
        raise ModelLoadError(
            f"{where}: rope_theta {cfg['rope_theta']} and rope_parameters' {theta} differ"
        )
    rope_type = fields.pop("rope_type", fields.pop("type", "default"))
    return float(theta), rope_type, fields


def config_from_hf(cfg: dict, where: str = "config.json") -> LlamaConfig:
    """Maps a transformers config dict to LlamaConfig, refusing what the model does not do."""
    model_type = cfg.get("model_type")
    if model_type in _GEMMA:
        raise ModelLoadError(f"{where}: Gemma models ({model_type!r}) are not implemented")
    if model_type in _MOE:
        raise ModelLoadError(
            f"{where}: mixture-of-experts models ({model_type!r}) are not implemented"
        )
    if model_type not in _SUPPORTED_TYPES:
        raise ModelLoadError(
            f"{where}: unsupported model_type {model_type!r} (supported: {_SUPPORTED_TYPES})"
        )
    unknown = sorted(set(cfg) - _READ - set(_HARMLESS))
    if unknown:
        raise ModelLoadError(
            f"{where}: config fields {unknown} are not implemented (kivi_jax/loading/"
            "hf_loader.py lists the fields it reads and those that leave the numbers alone)"
        )
    layer_types = set(cfg.get("layer_types") or ())
    if layer_types - {"full_attention"}:
        raise ModelLoadError(f"{where}: layer_types {sorted(layer_types)} are not implemented")
    positions = int(cfg.get("max_position_embeddings", 2048))
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    theta, rope_type, scaling = _rope_fields(cfg, where)
    try:
        factors, scale = rope.scaling(
            rope_type, scaling, head_dim=head_dim, theta=theta, max_positions=positions
        )
    except ValueError as e:
        raise ModelLoadError(f"{where}: {e}") from None
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):  # published sizes: use_sliding_window false
        if cfg.get("use_sliding_window"):
            raise ModelLoadError(
                f"{where}: use_sliding_window (a window on Qwen's upper layers only) is not "
                "implemented"
            )
        window = None
    elif window is not None and window >= positions:
        window = None  # no sequence the model takes reaches past it
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):  # Qwen2's q/k/v biases go unsaid
        raise ModelLoadError(
            f"{where}: attention_bias / mlp_bias (biases on the output projection or the MLP) "
            "are not implemented"
        )
    if cfg.get("rope_interleaved"):  # nanotron's GPT-J-style pairs (SmolLM2 writes false)
        raise ModelLoadError(f"{where}: rope_interleaved (GPT-J-style RoPE) is not implemented")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not implemented (only silu)")
    if cfg.get("pretraining_tp", 1) != 1:
        raise ModelLoadError(f"{where}: pretraining_tp != 1 is not implemented")
    return LlamaConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope_theta=theta,
        rope_factors=factors,
        rope_scale=scale,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_context=positions,
        sliding_window=None if window is None else int(window),
    )


def _tensors(path: str) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files (PyTorch .bin is not supported)")
    out = {}
    for file in files:
        try:
            with safe_open(file, framework="flax") as f:  # flax keeps bfloat16 (numpy cannot)
                for name in f.keys():
                    out[name] = f.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({e})") from e
    return out


def _first(*values):
    return next((v for v in values if v is not None), None)


def _tokenizer(path: str, cfg: dict) -> Tokenizer:
    import tokenizers

    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise ModelLoadError(f"{path}: no tokenizer.json")
    backend = tokenizers.Tokenizer.from_file(file)
    tok_cfg = {}
    if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            tok_cfg = json.load(f)

    def token_id(key):
        token = tok_cfg.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return backend.token_to_id(token) if isinstance(token, str) else None

    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    template = tok_cfg.get("chat_template")
    if template is None and os.path.isfile(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja")) as f:
            template = f.read()
    return Tokenizer(
        backend=backend,
        eos_id=_first(token_id("eos_token"), eos),
        bos_id=_first(token_id("bos_token"), cfg.get("bos_token_id")),
        chat_template=template if isinstance(template, str) else None,
    )


def load_hf(path: str, *, dtype=jnp.bfloat16, progress=None):
    """Loads a Hugging Face directory (module doc). Returns (LlamaParams, Tokenizer)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}/config.json: unreadable ({e})") from e
    config = config_from_hf(cfg, f"{path}/config.json")
    tensors = _tensors(path)
    prefix = "model." if "model.embed_tokens.weight" in tensors else ""

    read = set()  # every tensor the model takes; any other is an error (see the end)

    def get(name) -> np.ndarray:
        key = prefix + name
        if key not in tensors:
            raise ModelLoadError(f"{path}: missing tensor {key}")
        read.add(key)
        return tensors[key]

    names = {
        "attn_norm": "input_layernorm.weight",
        **({f"b{p}": f"self_attn.{p}_proj.bias" for p in "qkv"} if config.qkv_bias else {}),
        **({f"{p}_norm": f"self_attn.{p}_norm.weight" for p in "qk"} if config.qk_norm else {}),
        "wq": "self_attn.q_proj.weight",
        "wk": "self_attn.k_proj.weight",
        "wv": "self_attn.v_proj.weight",
        "wo": "self_attn.o_proj.weight",
        "mlp_norm": "post_attention_layernorm.weight",
        "w_gate": "mlp.gate_proj.weight",
        "w_up": "mlp.up_proj.weight",
        "w_down": "mlp.down_proj.weight",
    }
    layers = []
    for i in range(config.num_layers):
        weights = {}
        for field, suffix in names.items():
            w = get(f"layers.{i}.{suffix}")
            weights[field] = jnp.asarray(w if w.ndim == 1 else w.T, dtype)  # linear: [in, out]
        try:
            layers.append(LayerWeights.from_projections(**weights))
        except (ValueError, TypeError) as e:
            raise ModelLoadError(f"{path}: layer {i}: {e}") from e
        if progress:
            progress(f"{i + 1}/{config.num_layers} layers")
    lm_head = None
    if not config.tie_embeddings:
        if "lm_head.weight" not in tensors:
            raise ModelLoadError(f"{path}: missing lm_head.weight (and tie_word_embeddings=false)")
        lm_head = jnp.asarray(tensors["lm_head.weight"], dtype).T
        read.add("lm_head.weight")
    elif "lm_head.weight" in tensors and np.array_equal(
        np.asarray(tensors["lm_head.weight"]), np.asarray(get("embed_tokens.weight"))
    ):
        read.add("lm_head.weight")  # tied, and stored anyway
    params = LlamaParams(
        embed=jnp.asarray(get("embed_tokens.weight"), dtype),
        layers=tuple(layers),
        final_norm=jnp.asarray(get("norm.weight"), dtype),
        lm_head=lm_head,
        config=config,
    )
    # RoPE's frequencies, stored by some older conversions, are the config's
    read |= {n for n in tensors if n.endswith("rotary_emb.inv_freq")}
    unread = sorted(set(tensors) - read)
    if unread:
        raise ModelLoadError(
            f"{path}: {len(unread)} tensors that kivi-jax does not implement and would change "
            f"the numbers: {', '.join(unread[:8])}{' ...' if len(unread) > 8 else ''}"
        )
    try:
        validate_params(params)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    return params, _tokenizer(path, cfg)
