"""kivi-generate: streams the answer on stdout, progress and a summary on stderr, clear errors."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest
from tiny_model import tiny_config, tiny_params, write_gguf

import kivi_jax as kj
from kivi_jax.cli import _parser, kv_summary, main
from kivi_jax.generate import StreamStats


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "tiny.gguf")
    write_gguf(path, tiny_params(tie_embeddings=False))
    return path


def _summary(err: str) -> tuple[int, int, str]:
    """(prompt tokens, generated tokens, the KV-cache line) of kivi-generate's stderr."""
    counts = re.search(r"--- (\d+) prompt tokens, (\d+) generated", err).groups()
    prompt, generated = map(int, counts)
    return prompt, generated, re.search(r"--- (KV cache .*)", err).group(1)


# The tiny model's full-precision cache for 64 + 32 tokens (the prompt's bucket and that of 6 new
# tokens): 2 layers x 2 (k, v) x 96 tokens x 2 KV heads x 32 channels x 4 bytes = 98,304 bytes,
# plus 2 x 5 bytes of counters: 96.0 KiB.
FULL_96 = "96.0 KiB"


def test_streams_the_answer_and_summarizes(tiny_gguf, capsys):
    argv = ["the theme", "--model", tiny_gguf, "--kv", "kivi2", "--max-new-tokens", "6"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and len(out) > 1
    assert "6 generated" in err
    assert "prefill" in err and "decode" in err and "tok/s" in err
    # A short chat: nothing quantized, and the allocation (codes for the whole capacity and the
    # 128-token window) is larger than a full-precision cache of the capacity.
    prompt, generated, line = _summary(err)
    assert re.fullmatch(
        rf"KV cache \(kivi2\): {prompt + generated - 1} tokens held in [\d.]+ KiB, none "
        r"quantized yet: the whole sequence fits the full-precision window of R = 128 tokens, "
        r"so KIVI saves nothing until it is longer \| allocated for 96 tokens: [\d.]+ KiB vs "
        rf"{FULL_96} for a full-precision cache of the same capacity \([\d.]+x its size\)",
        line,
    ), line


def test_the_mixed_precision_cache_is_a_kv_choice(tiny_gguf, capsys):
    argv = ["the theme", "--model", tiny_gguf, "--kv", "kivi2-mix", "--max-new-tokens", "4"]
    assert main(argv) == 0
    assert "KV cache (kivi2-mix): " in capsys.readouterr().err


def test_sampling_flags_and_no_chat(tiny_gguf, capsys):
    argv = ["the", "--model", tiny_gguf, "--kv", "full", "--max-new-tokens", "6", "--no-chat",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]  # fmt: skip
    assert main(argv) == 0
    prompt, generated, line = _summary(capsys.readouterr().err)
    assert generated == 6
    # --kv full: the baseline of the kivi2 line above is this cache's own allocation. A token
    # holds 2 x 32 channels x 4 bytes in 2 KV heads of 2 layers: 1 KiB.
    assert line == (
        f"KV cache (full): {prompt + 5} tokens held in {prompt + 5}.0 KiB, all in full precision "
        f"| allocated for 96 tokens: {FULL_96} vs {FULL_96} for a full-precision cache of the "
        "same capacity (1.00x its size)"
    )


def test_the_kv_line_counts_the_tokens_quantized_past_the_window():
    c = tiny_config()  # 2 layers, 2 KV heads of 32 channels; float32
    caches = kj.init_cache(
        kj.KIVI2, batch=1, max_len=204, num_kv_heads=2, head_dim=32, dtype=jnp.float32,
        num_layers=2,
    )  # fmt: skip
    report = kj.memory_report(caches)
    stats = StreamStats(
        held_tokens=163,
        kv_capacity=204,
        kv_bytes=report.total_bytes,
        kv_full_bytes=report.full_precision_bytes,
    )
    # Held, per KV head: keys 128 quantized (2-bit codes 8,192 bits, scales and zeros 4 groups x
    # 32 channels x 64 bits = 8,192), values 35 quantized (2,240 + 35 x 64 = 2,240), 35 keys and
    # 128 values in float32 (163 x 32 x 32 = 166,912): 187,776 bits x 4 heads = 91.7 KiB; in full
    # precision 163 x 2 x 32 x 4 bytes x 4 = 163.0 KiB. Allocated for C = 224 positions: codes,
    # scales and zeros 4 x 1,792 bytes, the window 2 x 128 x 32 x 4, x 4 heads, + 10 bytes of
    # counters = 156.0 KiB; a full-precision cache of 204 tokens 204.0 KiB.
    assert kv_summary("kivi2", stats, c, jnp.float32) == (
        "KV cache (kivi2): 163 tokens held in 91.7 KiB (163.0 KiB in full precision): keys 128 "
        "quantized + 35 in the full-precision window, values 35 + 128 | allocated for 204 tokens: "
        "156.0 KiB vs 204.0 KiB for a full-precision cache of the same capacity (0.76x its size)"
    )


def test_bad_model_path_is_a_clear_error(tmp_path, capsys):
    assert main(["hi", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "kivi-generate: error: no such model file or directory" in capsys.readouterr().err


def test_prompt_beyond_the_context_is_a_clear_error(tiny_gguf, capsys):
    assert main(["the " * 300, "--model", tiny_gguf, "--no-chat"]) == 2
    assert "exceeds the model's context of 256 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[""], ["  \n"], ["", "--no-chat"]])
def test_an_empty_prompt_is_an_error_before_the_model_loads(argv, monkeypatch, capsys):
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("kivi_jax.loading.load_model", load_model)
    assert main(argv) == 2
    assert capsys.readouterr().err == f"kivi-generate: error: the prompt is empty: {argv[0]!r}\n"


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


def test_help_gives_every_option_a_help_text_and_its_default(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    options = capsys.readouterr().out.split("\noptions:\n")[1]
    listed = set(re.findall(r"^  (--?[\w-]+)", options, flags=re.M))
    flat = " ".join(options.split())
    actions = [a for a in _parser()._actions if a.option_strings and a.dest != "help"]
    assert listed == {"-h"} | {a.option_strings[0] for a in actions}
    for a in actions:
        assert a.help and " ".join(a.help.split()) in flat, a.option_strings
        assert "(default: " in a.help, a.option_strings
        if a.default not in (None, False):
            assert f"(default: {a.default})" in a.help, a.option_strings


def test_tensor_parallel_over_more_devices_than_here_is_an_error_before_loading(capsys):
    assert main(["hi", "--tensor-parallel", "3", "--model", "unused"]) == 2
    assert "--tensor-parallel: tensor parallelism over 3 devices, but only 1 are here" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["hi", "--seed", str(2**70)], "seed must lie in [0, 2**32)"),
        (["hi", "--seed", "-1"], "seed must lie in [0, 2**32)"),
        (["caf\udce9"], "the prompt is not valid UTF-8 text"),  # b"caf\xe9" as argv decodes it
    ],
)
def test_a_bad_seed_or_an_undecodable_prompt_is_one_line_before_the_model_loads(
    argv, message, monkeypatch, capsys
):
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("kivi_jax.loading.load_model", load_model)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kivi-generate: error: {message}") and err.count("\n") == 1


def test_one_new_token_is_summarized_without_a_decode_rate(tiny_gguf, capsys):
    assert main(["the theme", "--model", tiny_gguf, "--max-new-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert "1 generated" in err and "no decode step" in err and "nan" not in err
