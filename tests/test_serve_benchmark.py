"""`benchmarks/serve.py`: the engine's load benchmark, as a smoke run on a tiny random model
(CPU), and its result files."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serve

ROW_FIELDS = {
    "device", "mode", "model", "kv", "layout", "slots", "pages", "kv_gb", "budget_gb", "rate",
    "requests", "req_per_s", "out_tok_per_s", "predicted_out_tok_per_s", "ttft_p50_ms",
    "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "peak_gb", "call", "mean_live_slots",
    "preemptions",
}  # fmt: skip
SHARED_FIELDS = {
    "device", "model", "kv", "layout", "slots", "sharing", "prefix", "requests",
    "prompt_tokens", "prompt_tokens_computed", "prefix_hit_tokens", "prefill_calls",
    "ttft_p50_ms", "ttft_p99_ms", "call",
}  # fmt: skip
# The smoke model (benchmarks/generate_gpu.py), KIVI-2 (R = 128: pages of 128 tokens), slots of
# 384 tokens; the shared prefix is one page, each prompt a page and a bit more after it.
SMOKE = ["run", "--model", "smoke", "--kvs", "kivi2", "--requests", "4", "--max-len", "384",
         "--prompt-range", "8", "40", "--output-range", "3", "6", "--prefill-chunk", "64",
         "--prefill-requests", "1", "--overhead-batch", "2", "--budget-gb", "1",
         "--shared-requests", "3", "--shared-prefix", "128", "--shared-suffix-range", "130", "140",
         "--call", "test"]  # fmt: skip


def parse(*extra):
    args = serve.main_parser().parse_args([*SMOKE, *extra])
    args.kv = "kivi2"
    return args


def test_the_workload_is_poisson_arrivals_with_lengths_in_the_ranges():
    reqs = serve.workload(2000, 4.0, (512, 2048), (128, 512), seed=0)
    arrivals = np.array([a for a, _, _ in reqs])
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
    assert abs(len(reqs) / arrivals[-1] - 4.0) < 0.3  # the rate
    assert all(512 <= p <= 2048 and 128 <= o <= 512 for _, p, o in reqs)
    assert serve.workload(5, math.inf, (8, 8), (2, 2), seed=0) == [(0.0, 8, 2)] * 5
    assert reqs == serve.workload(2000, 4.0, (512, 2048), (128, 512), seed=0)  # seeded


def test_the_shared_load_is_one_prefix_and_distinct_suffixes():
    args = parse()
    reqs, prompts = serve.shared_workload(args, vocab=256)
    assert len(prompts) == 3 and all(p[:128] == prompts[0][:128] for p in prompts)
    assert len({tuple(p[128:]) for p in prompts}) == 3
    assert all(130 <= len(p) - 128 <= 140 for p in prompts)
    assert [(a, n) for a, n, _ in reqs] == [(0.0, len(p)) for p in prompts]  # all at once


def test_the_paged_layout_takes_the_slot_layouts_bytes_with_more_slots():
    """3 slots of 384 tokens: a KIVI-2 slot's part (its 128-token ring) and its 3 pages. The
    paged layout takes the same bytes (to a page) as 4 slots (at most the 4 requests) of the
    load's mean request (28 tokens: no complete key group, no page) beside the 3 pages of one
    max_len request."""
    from kivi_jax.serving import Engine

    args = parse("--slots", "3")
    params, _, _ = serve.load("smoke", 384)
    slot = serve.size_of(args, params, 384, "slot")
    paged = serve.size_of(args, params, 384, "paged")
    assert slot == serve.Size(3, None) and paged.slots == 4
    kv_bytes = lambda size: (lambda s: s.kv_slot_bytes + s.kv_pool_bytes)(
        Engine(params, kv="kivi2", slots=size.slots, max_len=384, kv_bytes=size.kv_bytes).stats()
    )  # fmt: skip
    page = 24576  # bytes of a page, all layers: the pool takes whole pages of the bytes
    assert kv_bytes(slot) == paged.kv_bytes and 0 <= paged.kv_bytes - kv_bytes(paged) < page
    one = kv_bytes(serve.Size(1, None))
    assert serve.size_of(parse("--kv-bytes-gb", str(3.5 * one / 1e9)), params, 384, "slot") == slot
    with pytest.raises(ValueError, match="--slots and --kv-bytes-gb both size the slot layout"):
        serve.size_of(parse("--slots", "3", "--kv-bytes-gb", "1"), params, 384, "slot")
    with pytest.raises(ValueError, match="the paged layout takes the slot layout's KV bytes"):
        serve.size_of(parse(), params, 384, "paged")
    with pytest.raises(ValueError, match="--max-len 40 is below the load's longest request"):
        serve.max_len_of(parse("--max-len", "40"))


def test_a_smoke_run_measures_every_field_and_merges(tmp_path):
    """Both layouts on the same load, the shared-prefix load, and their merge. At 2 slots the
    paged layout's bytes hold no third slot (2 slots and 6 pages, as the slot layout's): its
    programs are the slot layout's, compiled once (the shared load's engine adds one)."""
    args = parse("--slots", "2", "--rates", "seq", "inf")
    run, versions = tmp_path / "run", serve.versions()
    run.mkdir()
    for layout in ("slot", "paged"):
        result = serve.measure_kv(args, layout)
        seq, row = result["rows"]
        assert row["layout"] == layout and row["slots"] == 2 and row["pages"] == 6
        assert seq["rate"] == "seq" and seq["mean_live_slots"] <= 1 + 1e-9
        assert row["requests"] == 4 and row["rate"] == "inf"
        assert row["out_tok_per_s"] > 0 and row["predicted_out_tok_per_s"] > 0
        assert row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["tpot_p50_ms"] <= row["tpot_p99_ms"]
        assert row["prompt_tokens_computed"] == row["prompt_tokens"] > 0
        assert (result["overhead"] is not None) == (layout == "slot")
        head = dict(model="smoke", kv="kivi2", layout=layout, call="test", versions=versions)
        (run / f"serve_smoke_kivi2_{layout}.json").write_text(json.dumps(head | result))
    result = serve.measure_shared(args)
    off, on = result["shared"]
    assert not off["sharing"] and on["sharing"] and off["prompt_tokens"] == on["prompt_tokens"]
    assert off["prefix_hit_tokens"] == 0 and off["prompt_tokens_computed"] == off["prompt_tokens"]
    # the first request computes the prefix; the other two take its page
    assert on["prefix_hit_tokens"] == 2 * 128
    assert on["prompt_tokens_computed"] == on["prompt_tokens"] - 2 * 128
    head = dict(model="smoke", kv="kivi2", layout="shared", call="test", versions=versions)
    (run / "serve_smoke_kivi2_shared.json").write_text(json.dumps(head | result))

    serve.merge(serve.main_parser().parse_args(["merge", str(run), "--out", str(tmp_path)]))
    merged = json.loads((tmp_path / "serve.json").read_text())
    assert len(merged["rows"]) == 4 and all(ROW_FIELDS <= set(r) for r in merged["rows"])
    assert len(merged["shared"]) == 2 and all(SHARED_FIELDS <= set(r) for r in merged["shared"])
    assert {c["layout"] for c in merged["compile"]} == {"slot", "paged"} and merged["versions"]
    md = (tmp_path / "serve.md").read_text()
    assert "| smoke | kivi2 | paged | 2 | 6 |" in md and "| 128 + 130-140 | on |" in md
    assert (tmp_path / "serve.png").stat().st_size > 0
    # merged again: each row replaced by itself, none added
    serve.merge(serve.main_parser().parse_args(["merge", str(run), "--out", str(tmp_path)]))
    again = json.loads((tmp_path / "serve.json").read_text())
    assert len(again["rows"]) == 4 and len(again["shared"]) == 2


def test_a_budget_that_holds_no_slot_is_an_error_naming_the_numbers():
    args = serve.main_parser().parse_args(
        ["run", "--model", "smoke", "--kvs", "kivi2", "--requests", "1",
         "--prompt-range", "8", "8", "--output-range", "3", "3", "--budget-gb", "1e-4"]
    )  # fmt: skip
    args.kv = "kivi2"
    with pytest.raises(ValueError, match=r"the engine does not fit the device: .* in use .* "
                       r"against the limit 100 kB; not one slot fits"):  # fmt: skip
        serve.measure_kv(args, "slot")
