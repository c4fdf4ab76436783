"""`benchmarks/generate_gpu.py merge`: how searches of the largest batch from several device
calls combine (CPU; the calls' files written here, no GPU)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import generate_gpu

SEARCH = dict(model="Llama-2-7B", kv="kivi2", budget_gb=142.6, prompt=2048, new_tokens=128)
MEMORY = dict(tokens_per_s=8890.0, peak_gb=139.8, weights_gb=13.5, kv_bytes_gb=123.1)


def _call(tmp_path: Path, call: str, tried: dict[int, bool]) -> Path:
    """A call's folder: one search of SEARCH that tried these batches (batch -> it ran)."""
    d = tmp_path / call
    d.mkdir()
    describe = {"call": call, "device": "H200", "versions": {"jax": "0.11.2"}}
    (d / f"call_{call}.json").write_text(json.dumps(describe))
    ran = [b for b, ok in tried.items() if ok]
    failed = min((b for b, ok in tried.items() if not ok and b > max(ran, default=0)), default=None)
    for b, ok in tried.items():
        result = {**SEARCH, "batch": b, "call": call}
        result |= MEMORY if ok else {"error": f"RESOURCE_EXHAUSTED at {b}"}
        (d / f"try_{b}.json").write_text(json.dumps(result))
    search = {**SEARCH, "batch": max(ran, default=None), "failed_batch": failed, "call": call,
              "failed_error": failed and f"RESOURCE_EXHAUSTED at {failed}"}  # fmt: skip
    (d / "maxbatch_kivi2.json").write_text(json.dumps(search))
    return d


def _merged(tmp_path: Path, *dirs: Path) -> dict:
    generate_gpu.main(["merge", *map(str, dirs), "--out", str(tmp_path / "out")])
    return json.loads((tmp_path / "out/generate_gpu.json").read_text())


def test_a_later_search_keeps_an_earlier_failure_above_its_largest_batch(tmp_path):
    # one call tried 450 and 462 (neither fit), a later one 424 and 438 (both ran): the bound
    # 438 <= largest < 450 needs both calls, so the failure stays, with the call that found it
    first = _call(tmp_path, "c3", {450: False, 462: False})
    second = _call(tmp_path, "c4", {424: True, 438: True})
    result = _merged(tmp_path, first, second)
    [search] = result["max_batch"]
    assert (search["batch"], search["failed_batch"], search["call"]) == (438, 450, "c4")
    assert search["failed_call"] == "c3"
    tries = sorted((t["batch"], t["call"]) for t in result["max_batch_tries"])
    assert tries == [(424, "c4"), (438, "c4"), (450, "c3")]
    table = (tmp_path / "out/generate_gpu.md").read_text()
    assert "| 438 | 450 (c3) |" in table


def test_a_later_search_with_its_own_failure_replaces_the_earlier_one(tmp_path):
    first = _call(tmp_path, "c3", {400: True, 450: False})
    second = _call(tmp_path, "c4", {424: True, 438: False})
    [search] = _merged(tmp_path, first, second)["max_batch"]
    assert (search["batch"], search["failed_batch"], search.get("failed_call")) == (424, 438, None)


def test_an_earlier_failure_at_or_below_the_later_largest_batch_is_dropped(tmp_path):
    # a batch that failed once and ran later (at or above it) bounds nothing
    first = _call(tmp_path, "c3", {430: False})
    second = _call(tmp_path, "c4", {438: True})
    [search] = _merged(tmp_path, first, second)["max_batch"]
    assert (search["batch"], search["failed_batch"]) == (438, None)


def _row(call: str, kv: str, weights: str | None, tokens_per_s: float) -> dict:
    row = dict(model="Llama-3-8B", kv=kv, batch=16, prompt=2048, new_tokens=128, call=call,
               step_ms=16e3 / tokens_per_s, floor_ms=1.0, pct_floor=50.0,
               tokens_per_s=tokens_per_s, peak_gb=20.0, compile_s=9.0, programs=8, recompiled=0,
               idle_ms_per_step=0.1,
               kernels_per_step={"gemm_fusion": {"launches": 4, "ms": 2.0},
                                 "loop_convert_fusion": {"launches": 2, "ms": 0.5}})  # fmt: skip
    return row if weights is None else row | {"weights": weights}


def test_rows_of_other_weights_are_kept_apart_and_compared_within_their_weights(tmp_path):
    d = tmp_path / "c1"
    d.mkdir()
    describe = {"call": "c1", "device": "H200", "versions": {"jax": "0.11.2"}}
    (d / "call_c1.json").write_text(json.dumps(describe))
    rows = {
        "full": _row("c1", "full", None, 1000.0),  # written before rows carried weights: bf16
        "kivi2": _row("c1", "kivi2", "bf16", 1500.0),
        "full_int4": _row("c1", "full", "int4", 2000.0),
        "kivi2_int4": _row("c1", "kivi2", "int4", 4000.0),
    }
    for name, row in rows.items():
        (d / f"row_{name}.json").write_text(json.dumps(row))
    result = _merged(tmp_path, d)
    assert sorted((r["weights"], r["kv"]) for r in result["rows"]) == [
        ("bf16", "full"), ("bf16", "kivi2"), ("int4", "full"), ("int4", "kivi2")
    ]  # fmt: skip
    table = (tmp_path / "out/generate_gpu.md").read_text()
    assert "| bf16 | kivi2 | 16 | 2048 + 128 |" in table and "| 1500 | 1.50x |" in table
    assert "| int4 | kivi2 | 16 | 2048 + 128 |" in table and "| 4000 | 2.00x |" in table
    # the int4 rows' convert kernel counts with the matmuls (2.0 + 0.5), the bf16 rows' not
    assert "| int4 | full | 16 | 2048 + 128 | 2.50 | 0.50 |" in table
    assert "| bf16 | full | 16 | 2048 + 128 | 2.00 | 0.00 |" in table


def test_random_quantized_weights_are_made_directly_and_counted_in_bits():
    import jax

    from kivi_jax.weights import QuantizedWeight

    row = generate_gpu.Row.parse("smoke:kivi2:2:40+8:int4")
    assert (row.weights, row.spec) == ("int4", "smoke:kivi2:2:40+8:int4")
    assert generate_gpu.Row.parse("smoke:kivi2:2:40+8", "int8").weights == "int8"
    params = generate_gpu.random_params(row.config, jax.random.key(0), "int4")
    w = params.layers[0].w_gate_up
    assert isinstance(w, QuantizedWeight) and w.qvalue.dtype == "int4"
    assert params.embed.dtype == "bfloat16"
    sizes = {
        weights: generate_gpu.weight_bytes(generate_gpu.abstract_params(row.config, weights))
        for weights in generate_gpu.WEIGHTS
    }
    assert generate_gpu.weight_bytes(params) == sizes["int4"]
    assert sizes["int4"] < sizes["int8"] < sizes["bf16"]
    c = row.config  # int4: half a byte per matrix element, and 2 bf16 per group of 128 inputs
    d, F = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    block = d * (q + 2 * kv) + q * d + d * 2 * F + F * d
    groups = (d // 128) * (q + 2 * kv + 2 * F) + (q // 128) * d + (F // 128) * d
    other = 2 * (c.vocab_size * d + d + c.num_layers * 2 * d)  # embed, norms in bf16
    lm_head = d * c.vocab_size // 2 + (d // 128) * c.vocab_size * 4
    assert sizes["int4"] == c.num_layers * (block // 2 + groups * 4) + other + lm_head
