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
    "device", "mode", "model", "kv", "slots", "budget_gb", "rate", "requests", "req_per_s",
    "out_tok_per_s", "predicted_out_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
    "tpot_p99_ms", "peak_gb", "call", "mean_live_slots",
}  # fmt: skip


def test_the_workload_is_poisson_arrivals_with_lengths_in_the_ranges():
    reqs = serve.workload(2000, 4.0, (512, 2048), (128, 512), seed=0)
    arrivals = np.array([a for a, _, _ in reqs])
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
    assert abs(len(reqs) / arrivals[-1] - 4.0) < 0.3  # the rate
    assert all(512 <= p <= 2048 and 128 <= o <= 512 for _, p, o in reqs)
    assert serve.workload(5, math.inf, (8, 8), (2, 2), seed=0) == [(0.0, 8, 2)] * 5
    assert reqs == serve.workload(2000, 4.0, (512, 2048), (128, 512), seed=0)  # seeded


def test_a_smoke_run_measures_every_field_and_merges(tmp_path):
    args = serve.main_parser().parse_args(
        ["run", "--model", "smoke", "--kvs", "kivi2", "--slots", "2", "--requests", "3",
         "--rates", "seq", "inf", "--prompt-range", "8", "40", "--output-range", "3", "6",
         "--prefill-chunk", "32", "--prefill-requests", "1", "--overhead-batch", "2",
         "--budget-gb", "1", "--out", str(tmp_path / "run")]
    )  # fmt: skip
    args.kv = "kivi2"
    result = serve.measure_kv(args)
    seq, row = result["rows"]
    assert seq["rate"] == "seq" and seq["mean_live_slots"] <= 1 + 1e-9
    assert row["requests"] == 3 and row["slots"] == 2 and row["rate"] == "inf"
    assert row["out_tok_per_s"] > 0 and row["predicted_out_tok_per_s"] > 0
    assert row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["tpot_p50_ms"] <= row["tpot_p99_ms"]
    assert 0 < result["overhead"]["engine_vs_generate"]
    result["versions"] = serve.versions()
    run = tmp_path / "run"
    run.mkdir()
    (run / "serve_smoke_kivi2.json").write_text(json.dumps(result))
    serve.merge(serve.main_parser().parse_args(["merge", str(run), "--out", str(tmp_path)]))
    merged = json.loads((tmp_path / "serve.json").read_text())
    assert ROW_FIELDS <= set(merged["rows"][0]) and merged["versions"]
    md = (tmp_path / "serve.md").read_text()
    assert "| smoke |" in md and "| compile s |" in md and merged["compile"][0]["programs"]
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_a_budget_that_holds_no_slot_is_an_error_naming_the_numbers():
    args = serve.main_parser().parse_args(
        ["run", "--model", "smoke", "--kvs", "kivi2", "--requests", "1",
         "--prompt-range", "8", "8", "--output-range", "3", "3", "--budget-gb", "1e-4"]
    )  # fmt: skip
    args.kv = "kivi2"
    with pytest.raises(ValueError, match=r"the engine does not fit the device: .* in use .* "
                       r"against the limit 100 kB; not one slot fits"):  # fmt: skip
        serve.measure_kv(args)
