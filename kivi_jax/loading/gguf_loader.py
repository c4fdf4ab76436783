"""GGUF (llama.cpp) checkpoints: metadata -> LlamaConfig, tensors -> LlamaParams.

Tensors are dequantized to the compute dtype, or with weights="gguf" the linear layers stored as
Q8_0, Q4_0 or Q4_1 are kept as `QuantizedWeight`s of the same bits and blocks (32 inputs):
  Q8_0   int8 [32] and an f16 scale d:      w = d * q        -> int8, scale d
  Q4_0   4-bit q [32] and d:                w = d * (q - 8)  -> int4 q - 8, scale d
  Q4_1   4-bit q [32], d and an f16 min m:  w = d * q + m    -> int4 q - 8, scale d,
                                                                zero point -m / d - 8
(exact up to the scale's and zero point's rounding to the compute dtype). Every other type
(F32, F16, BF16, the K-quants, Q5_*, ...) is dequantized, and so is a fused matrix (q/k/v,
gate/up) whose parts are not all of one kept type; embeddings and norms always are.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np

from kivi_jax.loading.errors import ModelLoadError
from kivi_jax.loading.tokenizer import tokenizer_from_gguf_fields
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import LayerWeights, LlamaParams, validate_params
from kivi_jax.weights import QuantizedWeight

_MAGIC = b"GGUF"
# SmolLM, Llama 3.x and Mistral GGUFs are written as "llama" (Q/K rows permuted); "qwen2" (q/k/v
# biases) and "qwen3" (q/k norms) keep the checkpoint's rows (NEOX-style RoPE: rotate-half).
_SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


def is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == _MAGIC
    except OSError:
        return False


def _read(path: str):
    import gguf

    if not os.path.isfile(path):
        raise ModelLoadError(f"no such GGUF file: {path}")
    if not is_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
        fields = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            fields[name] = field.contents()
        tensors = {t.name: t for t in reader.tensors}
        # A truncated file can still parse its header: check every tensor's extent.
        size = os.path.getsize(path)
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise ValueError(f"tensor {t.name} extends past the end of the file")
    except ModelLoadError:
        raise
    except Exception as e:  # the gguf package raises ValueError, IndexError, struct errors...
        raise ModelLoadError(
            f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})"
        ) from e
    return fields, tensors


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _config(fields: dict, path: str) -> LlamaConfig:
    arch = fields.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r} (kivi-jax implements {_SUPPORTED_ARCHS})"
        )

    def get(key, default=None):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ModelLoadError(f"{path}: RoPE scaling {scaling!r} is not implemented")
    if fields.get(f"{arch}.attention.sliding_window"):
        raise ModelLoadError(f"{path}: sliding-window attention is not implemented")
    if fields.get(f"{arch}.expert_count"):
        raise ModelLoadError(f"{path}: mixture-of-experts models are not implemented")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(fields.get(f"{arch}.attention.key_length", hidden // heads))
    if int(fields.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"{path}: key and value head widths differ")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"{path}: partial rotary embeddings are not implemented")
    vocab = fields.get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"])
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        rms_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        tie_embeddings=False,  # decided below from the tensors present
        max_context=int(get("context_length")),
    )


def _dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as float32 numpy in PyTorch layout ([out, in] for a linear layer)."""
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (convert_hf_to_gguf `permute`), back to the Hugging
    Face rotate-half layout: rows (head, D/2, 2) -> (head, 2, D/2)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _blocks(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A Q8_0 / Q4_0 / Q4_1 tensor [out, in] as (q [out, in] int8, d [out, in / 32] float32,
    zero [out, in / 32] float32 or None) with w = (q - zero) * d (module docstring)."""
    import gguf

    kind = gguf.GGMLQuantizationType(tensor.tensor_type).name
    out, n_in = (int(n) for n in reversed(tensor.shape))
    head = 4 if kind == "Q4_1" else 2  # f16 d (and m)
    raw = np.asarray(tensor.data).reshape(out, n_in // 32, -1)  # [out, in / 32, block bytes]
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        return raw[..., 2:].copy().view(np.int8).reshape(out, n_in), d, None
    qs = raw[..., head:]  # [out, in / 32, 16]: element j in the low nibble, j + 16 in the high
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int8) - 8  # [out, in / 32, 32]
    if kind == "Q4_0":
        return q.reshape(out, n_in), d, None
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    flat = d == 0  # every value is m: q = 0 (stored -8), d = m, zero = -1 - 8
    q = np.where(flat[..., None], np.int8(-8), q)
    zero = np.where(flat, -9.0, -m / np.where(flat, 1.0, d) - 8).astype(np.float32)
    return q.reshape(out, n_in), np.where(flat, m, d), zero


_KEPT = ("Q8_0", "Q4_0", "Q4_1")


def load_gguf(path: str, *, dtype=jnp.bfloat16, progress=None, keep_quantized: bool = False):
    """Loads a GGUF file of architecture llama, qwen2 or qwen3. Returns (LlamaParams, Tokenizer).

    keep_quantized: keep Q8_0 / Q4_0 / Q4_1 linear layers as QuantizedWeights (module docstring).
    """
    if progress:
        progress("reading the GGUF file")
    fields, tensors = _read(path)
    config = _config(fields, path)
    tied = "output.weight" not in tensors
    config = LlamaConfig(**{**config.__dict__, "tie_embeddings": tied})
    read = set()  # every tensor the model takes; any other is an error (see the end)
    if "rope_freqs.weight" in tensors:  # llama3 scaling as llama.cpp stores it: the factors
        read.add("rope_freqs.weight")
        factors = tuple(float(f) for f in _dequantize(tensors["rope_freqs.weight"]))
        try:
            config = dataclasses.replace(config, rope_factors=factors)
        except ValueError as e:
            raise ModelLoadError(f"{path}: rope_freqs.weight: {e}") from None

    def tensor(name) -> np.ndarray:
        if name not in tensors:
            raise ModelLoadError(f"{path}: missing tensor {name}")
        read.add(name)
        return _dequantize(tensors[name])

    names = {
        "attn_norm": "attn_norm.weight",
        "wq": "attn_q.weight",
        "wk": "attn_k.weight",
        "wv": "attn_v.weight",
        "wo": "attn_output.weight",
        "mlp_norm": "ffn_norm.weight",
        "w_gate": "ffn_gate.weight",
        "w_up": "ffn_up.weight",
        "w_down": "ffn_down.weight",
    }
    if config.qkv_bias:
        names |= {f"b{p}": f"attn_{p}.bias" for p in "qkv"}
    if config.qk_norm:
        names |= {f"{p}_norm": f"attn_{p}_norm.weight" for p in "qk"}
    # rows permuted by llama.cpp for "llama" only
    arch = fields["general.architecture"]
    heads = {"wq": config.num_heads, "wk": config.num_kv_heads} if arch == "llama" else {}
    fused = (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",))

    def kept(name) -> bool:
        if name not in tensors:
            raise ModelLoadError(f"{path}: missing tensor {name}")
        return keep_quantized and tensors[name].tensor_type.name in _KEPT

    def stored(name, field) -> QuantizedWeight:
        read.add(name)
        q, d, zero = _blocks(tensors[name])  # [out, in], [out, in / 32]
        if field in heads:
            q, d = _unpermute(q, heads[field]), _unpermute(d, heads[field])
            zero = None if zero is None else _unpermute(zero, heads[field])
        as_jax = lambda x, t: jnp.asarray(x.T, t)  # -> [in, out], [in / 32, out]
        return QuantizedWeight(
            qvalue=as_jax(q, jnp.int8 if tensors[name].tensor_type.name == "Q8_0" else jnp.int4),
            scale=as_jax(d, dtype),
            zero_point=None if zero is None else as_jax(zero, dtype),
        )

    layers = []
    for i in range(config.num_layers):
        weights = {}
        vectors = [(f,) for f in names if f in ("bq", "bk", "bv", "q_norm", "k_norm")]
        for group in [("attn_norm",), ("mlp_norm",), *vectors, *fused]:
            gnames = [f"blk.{i}.{names[f]}" for f in group]
            if group in fused and all(kept(n) for n in gnames):
                if len({tensors[n].tensor_type for n in gnames}) == 1:
                    weights |= {f: stored(n, f) for f, n in zip(group, gnames, strict=True)}
                    continue
            for field, name in zip(group, gnames, strict=True):
                w = tensor(name)
                if field in heads:
                    w = _unpermute(w, heads[field])
                weights[field] = jnp.asarray(w if w.ndim == 1 else w.T, dtype)  # [in, out]
        try:
            layers.append(LayerWeights.from_projections(**weights))
        except (ValueError, TypeError) as e:
            raise ModelLoadError(f"{path}: layer {i}: {e}") from e
        if progress:
            progress(f"{i + 1}/{config.num_layers} layers")
    params = LlamaParams(
        embed=jnp.asarray(tensor("token_embd.weight"), dtype),
        layers=tuple(layers),
        final_norm=jnp.asarray(tensor("output_norm.weight"), dtype),
        lm_head=None
        if tied
        else stored("output.weight", "lm_head")
        if kept("output.weight")
        else jnp.asarray(tensor("output.weight").T, dtype),
        config=config,
    )
    unread = sorted(set(tensors) - read)
    if unread:  # e.g. rope_freqs.weight (Llama 3.1's RoPE scaling) or attention biases
        raise ModelLoadError(
            f"{path}: {len(unread)} tensors that kivi-jax does not implement and would change "
            f"the numbers: {', '.join(unread[:8])}{' ...' if len(unread) > 8 else ''}"
        )
    try:
        validate_params(params)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    return params, tokenizer_from_gguf_fields(fields)
