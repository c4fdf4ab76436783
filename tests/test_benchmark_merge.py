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
