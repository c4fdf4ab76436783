"""The accuracy studies: the model's attention hook, the invariants on the real model, the CLI."""

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from kivi_jax.models import llama
from tiny_model import tiny_params, write_gguf

import kivi_jax as kj
from kivi_jax.eval import cli, data, studies, views

# ----------------------------------------------------------------------------- the model's hook


def test_forward_with_a_full_precision_view_matches_the_default_attention():
    params = tiny_params()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 19)), jnp.int32)
    lengths = jnp.array([19, 11])
    plain = llama.forward(params, tokens, lengths)
    viewed = llama.forward(params, tokens, lengths, attention=views.FullAttention())
    np.testing.assert_allclose(viewed[0], plain[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(viewed[1, :11], plain[1, :11], rtol=1e-5, atol=1e-5)


def test_forward_with_qkv_returns_the_keys_and_values_prefill_stores():
    params = tiny_params()
    c = params.config
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (1, 13)), jnp.int32)
    logits, q, k, v = llama.forward_with_qkv(params, tokens, logits_at=jnp.array([12]))
    assert q.shape == (c.num_layers, 1, 13, c.num_heads, c.head_dim)
    assert k.shape == v.shape == (c.num_layers, 1, 13, c.num_kv_heads, c.head_dim)
    np.testing.assert_allclose(logits, llama.forward(params, tokens)[:, 12], rtol=1e-5, atol=1e-5)
    cache = kj.init_cache(
        None, batch=1, max_len=13, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        dtype=jnp.float32, num_layers=c.num_layers,
    )  # fmt: skip
    last, cache = llama.prefill(params, tokens, jnp.array([13]), cache)
    np.testing.assert_allclose(last, logits, rtol=1e-5, atol=1e-5)
    # One FullCache per layer, each [B, T, H, D]; two float32 programs compiled apart (each
    # layer unrolled into its own fusions), so to the logits' tolerance.
    for i, layer in enumerate(cache):
        np.testing.assert_allclose(layer.k, k[i], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(layer.v, v[i], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def prose(smollm_f32):
    ids, source = data.prose_tokens(smollm_f32.tokenizer, max_tokens=320)
    return ids, source


def test_fp_retrieves_the_key_at_1k_and_kivi_with_r_covering_everything_answers_the_same(
    smollm_f32,
):
    model = smollm_f32
    prompt = data.passkey_prompt(
        model.tokenizer, length=1024, depth=0.5, rng=np.random.default_rng(7)
    )
    width = -(-len(prompt.tokens) // 64) * 64
    covering = kj.KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=width + 64)
    (fp,), (kivi,) = studies.passkey_answers(
        model.params, model.tokenizer, [prompt], [None, covering], width=width
    )
    assert data.passkey_correct(fp, prompt.key), (fp, prompt.key)
    assert kivi == fp


def test_kivi_with_r_covering_the_windows_has_the_fp_perplexity():
    """R = 64 >= every 64-token window: nothing is ever quantized, so the perplexity is the
    full-precision one exactly; with R = 32 the window's older keys and values are quantized.
    (Mechanics: the tiny model; the real model's perplexity below.)"""
    params = tiny_params(tie_embeddings=False)
    ids = np.random.default_rng(2).integers(3, params.config.vocab_size, 3 * 64)
    chunks = studies.windows(ids, 64)
    fp = studies.perplexity(params, chunks, views.FullAttention())
    config = lambda r: kj.KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=r)
    kivi = studies.perplexity(params, chunks, views.StreamingAttention(config(64)))
    assert kivi["ppl"] == fp["ppl"]
    short = studies.perplexity(params, chunks, views.StreamingAttention(config(32)))
    assert short["ppl"] != fp["ppl"]


def test_kivi2_raises_the_real_models_perplexity(smollm_f32, prose):
    ids, _ = prose
    chunks = studies.windows(ids, 256)
    fp = studies.perplexity(smollm_f32.params, chunks, views.FullAttention())
    kivi2 = studies.perplexity(smollm_f32.params, chunks, views.StreamingAttention(kj.KIVI2))
    assert kivi2["ppl"] > fp["ppl"]


def test_error_analysis_on_the_real_model_reproduces_the_papers_observations(smollm_f32, prose):
    ids, source = prose
    r = studies.error_study(smollm_f32.params, ids, source=source, num_queries=32)
    tok, ch = r["per_layer"]["per-token"], r["per_layer"]["per-channel"]
    layers = smollm_f32.config.num_layers
    assert len(tok["key"]) == layers
    # Keys: per-channel grouping isolates the outlier channels (paper Table 2), in every layer.
    assert all(c < t for c, t in zip(ch["key"], tok["key"], strict=True))
    assert r["summary"]["per-channel"]["score"]["mean"] < r["summary"]["per-token"]["score"]["mean"]
    # Values: per-channel is worse on the attention output (paper Table 3), in most layers.
    assert (
        r["summary"]["per-channel"]["output"]["median"]
        > (r["summary"]["per-token"]["output"]["median"])
    )
    assert r["layers_where_per_token_value_output_wins"] > layers // 2


# ----------------------------------------------------------------------------- the CLI


def test_cli_quick_errors_writes_json_markdown_and_plot(
    tmp_path, default_gguf, smollm_f32, monkeypatch
):
    # The CLI loads the model in float32: it gets the session's float32 load of the same file
    # (loading itself is tested in test_loading.py and test_hf_reference.py).
    loads = []
    load = lambda path, **kw: loads.append((path, kw)) or smollm_f32
    monkeypatch.setattr(kj, "load_model", load)
    out = tmp_path / "results"
    assert cli.main(["errors", "--quick", "--out", str(out), "--model", default_gguf]) == 0
    assert loads == [
        (default_gguf, dict(dtype=jnp.float32, weights="float", weight_group_size=None))
    ]
    for ext in ("json", "md", "png"):
        assert (out / f"errors.{ext}").stat().st_size > 0
    result = json.loads((out / "errors.json").read_text())
    assert result["source"].endswith("GPL-3")
    assert "per-channel" in (out / "errors.md").read_text()


def test_cli_missing_text_file_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert cli.main(["ppl", "--quick", "--text", str(missing), "--out", str(tmp_path)]) == 2
    assert f"kivi-eval: error: prose file not found: {missing}" in capsys.readouterr().err
    assert not list(tmp_path.glob("ppl.*"))


def test_cli_unknown_lean_row_fails_before_the_model_loads(tmp_path, capsys):
    argv = ["lean", "--lean-rows", "kivi2-lean", "bogus", "--model", str(tmp_path / "none")]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 2
    assert "--lean-rows: unknown rows ['bogus']" in capsys.readouterr().err


def test_cli_unknown_study_is_a_usage_error(capsys):
    assert cli.main(["bogus"]) == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


@pytest.mark.parametrize("length", ["0", "-5"])
def test_cli_passkey_length_that_is_not_positive_is_a_usage_error(length, capsys):
    assert cli.main(["passkey", "--passkey-lengths", "1024", length]) == 2
    assert f"--passkey-lengths: must be a positive integer, got {length}" in capsys.readouterr().err


def test_cli_passkey_length_beyond_the_context_fails_before_any_study_runs(tmp_path, capsys):
    model = str(tmp_path / "tiny.gguf")
    write_gguf(model, tiny_params(tie_embeddings=False))  # context 256
    out = tmp_path / "results"
    argv = ["all", "--quick", "--passkey-lengths", "300", "--model", model, "--out", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "kivi-eval: error: passkey length 300 is beyond the model's context" in err
    assert "fit 256 tokens for lengths up to 248" in err
    assert not out.exists()  # not even the perplexity study ran


@pytest.mark.parametrize(
    "length, message",
    [
        (9000, "passkey length 9000 is beyond .* 8 answer tokens fit 8192 tokens .* up to 8184"),
        (100_000, "passkey length 100000 is beyond the model's context"),
        (10, "passkey length 10 is too short: the instructions, key and question take"),
    ],
)
def test_passkey_length_out_of_range_fails_before_anything_runs(smollm_f32, length, message):
    with pytest.raises(ValueError, match=message):
        studies.passkey_study(
            smollm_f32.params, smollm_f32.tokenizer, lengths=[1024, length], depths=[0.5]
        )


def test_cli_replot_redraws_the_plots_from_the_json_files_only(tmp_path, capsys):
    results = pathlib.Path(__file__).resolve().parents[1] / "benchmarks/results/accuracy"
    studies_ = ("ppl", "passkey", "ablate", "mix")  # errors.json: the largest plot, left out
    for study in studies_:
        shutil.copy(results / f"{study}.json", tmp_path)
    assert cli.main(["replot", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{s}.{ext}" for s in studies_ for ext in ("json", "png")
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    capsys.readouterr()
    assert cli.main(["replot", "--out", str(empty)]) == 2
    err = capsys.readouterr().err
    assert f"kivi-eval: error: no study results (<study>.json) in {empty}" in err


def test_cli_quick_mix_writes_the_sweep_and_the_held_out_check(tmp_path):
    model = str(tmp_path / "tiny.gguf")
    write_gguf(model, tiny_params(tie_embeddings=False))
    out = tmp_path / "results"
    assert cli.main(["mix", "--quick", "--model", model, "--out", str(out)]) == 0
    r = json.loads((out / "mix.json").read_text())
    assert list(r["settings"]) == list(studies.mix_candidates(cli.QUICK.mix_budgets))
    assert r["settings"]["kivi2"]["bytes_vs_kivi2"] == 1.0
    assert r["settings"]["kivi4"]["bytes_vs_kivi2"] > r["settings"]["error N8"]["bytes_vs_kivi2"]
    (check,) = r["held_out"]
    assert check["source"].endswith("GFDL-1.3") and list(check["settings"]) == list(
        studies.KV_SETTINGS
    )
    assert "Held out" in (out / "mix.md").read_text() and (out / "mix.png").stat().st_size > 0


def test_cli_out_that_is_a_file_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kj, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    taken = tmp_path / "taken"
    taken.write_text("")
    text = tmp_path / "prose.txt"
    text.write_text("words " * 10)
    assert cli.main(["errors", "--quick", "--out", str(taken), "--text", str(text)]) == 2
    err = capsys.readouterr().err
    assert err == f"kivi-eval: error: --out {taken}: {taken} is a file, not a folder\n"
