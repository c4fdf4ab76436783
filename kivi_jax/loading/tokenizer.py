"""Tokenizer and chat template: rebuilt from GGUF metadata or read from tokenizer.json."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

# llama.cpp's token types (gguf.TokenType): CONTROL and USER_DEFINED tokens are matched whole.
_CONTROL, _USER_DEFINED = 3, 4

# The split regexes of Llama 3 ("llama-bpe": digits in runs of up to 3) and Qwen2/Qwen3 ("qwen2":
# each digit alone), as their tokenizer.json files and llama.cpp's llama-vocab.cpp write them.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")


def _split_then_bytes(regex: str):
    """Split on `regex` (each match its own word), then map bytes to byte-level symbols."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# GGUF `tokenizer.ggml.pre` values whose pre-tokenization the byte-level BPE below reproduces.
# smollm: each digit is its own word, then GPT-2's regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM).
_PRE_TOKENIZERS = {
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_REGEX),
    "qwen2": lambda: _split_then_bytes(_QWEN2_REGEX),
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}

# Pre-tokenizers whose models' tokenizer.json normalize the text first: Qwen2's (Qwen2.5, Qwen3)
# composes it to NFC, so "e" + U+0301 and U+00E9 are the same tokens.
_NORMALIZERS = {"qwen2": normalizers.NFC}


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Text <-> token ids. `encode` adds no BOS/EOS; special tokens written in the text (such as
    the chat template's `<|im_start|>`) map to their ids."""

    backend: tokenizers.Tokenizer
    eos_id: int | None = None
    bos_id: int | None = None
    chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Renders the model's chat template (jinja) with a trailing assistant prompt."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use chat=False (--no-chat)")
        import jinja2.sandbox

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        token = lambda i: "" if i is None else self.backend.id_to_token(i)
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=token(self.bos_id),
            eos_token=token(self.eos_id),
        )


def tokenizer_from_gguf_fields(fields: dict) -> Tokenizer:
    """Rebuilds a byte-level BPE tokenizer from `tokenizer.ggml.*` metadata values."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') is rebuilt; "
            "load the Hugging Face directory (with tokenizer.json) instead"
        )
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (supported: {sorted(_PRE_TOKENIZERS)}); "
            "load the Hugging Face directory (with tokenizer.json) instead"
        )
    tokens = list(fields["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    types = list(fields.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    if pre in _NORMALIZERS:
        backend.normalizer = _NORMALIZERS[pre]()
    backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types, strict=True) if ty in (_CONTROL, _USER_DEFINED)]
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in special]
    )
    return Tokenizer(
        backend=backend,
        eos_id=fields.get("tokenizer.ggml.eos_token_id"),
        bos_id=fields.get("tokenizer.ggml.bos_token_id"),
        chat_template=fields.get("tokenizer.chat_template"),
    )
