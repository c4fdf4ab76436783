"""kivi-generate: streams the answer on stdout, progress and a summary on stderr, clear errors."""

from __future__ import annotations

import pytest
from tiny_model import tiny_params, write_gguf

from kivi_jax.cli import main


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "tiny.gguf")
    write_gguf(path, tiny_params(tie_embeddings=False))
    return path


def test_streams_the_answer_and_summarizes(tiny_gguf, capsys):
    argv = ["the theme", "--model", tiny_gguf, "--kv", "kivi2", "--max-new-tokens", "6"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and len(out) > 1
    assert "6 generated" in err
    assert "prefill" in err and "decode" in err and "tok/s" in err
    assert "KV cache (kivi2, capacity" in err and "in full precision" in err


def test_the_mixed_precision_cache_is_a_kv_choice(tiny_gguf, capsys):
    argv = ["the theme", "--model", tiny_gguf, "--kv", "kivi2-mix", "--max-new-tokens", "4"]
    assert main(argv) == 0
    assert "KV cache (kivi2-mix, capacity" in capsys.readouterr().err


def test_sampling_flags_and_no_chat(tiny_gguf, capsys):
    argv = ["the", "--model", tiny_gguf, "--kv", "full", "--max-new-tokens", "4", "--no-chat",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]  # fmt: skip
    assert main(argv) == 0
    assert "4 generated" in capsys.readouterr().err


def test_bad_model_path_is_a_clear_error(tmp_path, capsys):
    assert main(["hi", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "kivi-generate: error: no such model file or directory" in capsys.readouterr().err


def test_prompt_beyond_the_context_is_a_clear_error(tiny_gguf, capsys):
    assert main(["the " * 300, "--model", tiny_gguf, "--no-chat"]) == 2
    assert "exceeds the model's context of 256 tokens" in capsys.readouterr().err


def test_unknown_kv_is_rejected_by_the_parser(tiny_gguf, capsys):
    with pytest.raises(SystemExit) as e:
        main(["hi", "--model", tiny_gguf, "--kv", "kivi3"])
    assert e.value.code == 2
    assert "invalid choice: 'kivi3'" in capsys.readouterr().err


def test_default_model_answers_with_a_kivi2_cache(default_gguf, capsys):
    """The README's first command: SmolLM2-135M-Instruct, KIVI-2 cache, greedy."""
    prompt = "What is the capital of France? Answer in one sentence."
    assert main([prompt, "--kv", "kivi2", "--max-new-tokens", "24"]) == 0
    out, _ = capsys.readouterr()
    assert "Paris" in out
