"""Every GPU kernel of a timed decode step, with its in-place duration (CUPTI trace via
jax.profiler), so that the benchmark's times split into kernels, gaps and hidden copies.

For each entry (cuDNN, the KIVI step, each KIVI kernel alone, as ``attention.py`` times them:
``--calls`` calls inside one jit) the script traces a few runs and reports, per jit run, the GPU
time from the first kernel's start to the last kernel's end (span), the sum of kernel durations
(busy), and per kernel name its launches and mean duration.

    python benchmarks/kernel_trace.py --out DIR

writes DIR/kernel_trace_kivi{bits}.json and .md.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import jax
from kivi_jax.pallas_kernels.decode_attention import GpuTuning

sys.path.insert(0, str(Path(__file__).parent))
import attention as bench  # the shapes and random states
import timing


def trace(fn, args, *, repeats: int) -> dict:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))  # compiles
    first_call_s = time.perf_counter() - t0
    jax.block_until_ready(fn(*args))
    runs = timing.traced_runs({0: (fn, args)}, rounds=repeats)
    if len(runs) != repeats:
        raise RuntimeError(f"the GPU trace holds {len(runs)} runs, not {repeats}")
    per_name = collections.defaultdict(list)
    for run in runs:
        for name, t0, t1 in run:
            per_name[name].append(t1 - t0)
    return {
        "first_call_s": first_call_s,
        "runs": len(runs),
        "span_us": statistics.median((r[-1][2] - r[0][1]) / 1e3 for r in runs),
        "busy_us": statistics.median(sum(t1 - t0 for _, t0, t1 in r) / 1e3 for r in runs),
        "kernels": {
            n: {"launches_per_run": len(d) / len(runs), "mean_us": statistics.mean(d) / 1e3}
            for n, d in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
        },
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="Llama-2-7B 8x32k")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    s = {s.name: s for s in bench.SHAPES}[args.shape]
    tuning = GpuTuning()
    key = jax.random.key(4)
    qs = bench._queries(key, s, args.calls)
    entries = {}
    states = bench.bf16_states(key, s)
    entries["cudnn"] = (bench._many_calls(bench.cudnn_step, qs, states), (qs, states))
    result = {"shape": s.name, "bits": args.bits, "calls": args.calls, "entries": {}}
    for name, (fn, fargs) in entries.items():
        result["entries"][name] = trace(fn, fargs, repeats=args.repeats)
    del states, entries
    states = bench.kivi_states(key, s, args.bits)
    logits = bench.random_logits(
        key, s, len(states), bits=args.bits, tuning=tuning, state=states[0]
    )
    entries = {"kivi": (bench._many_calls(bench.kivi_step(args.bits, tuning), qs, states),
                        (qs, states))}  # fmt: skip
    entries |= bench.kernel_runs(s, args.bits, tuning, qs, states, logits)
    for name, (fn, fargs) in entries.items():
        result["entries"][name] = trace(fn, fargs, repeats=args.repeats)
        print(name, json.dumps(result["entries"][name], indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"kernel_trace_kivi{args.bits}.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, args.out / f"kernel_trace_kivi{args.bits}.md")


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        f"# GPU kernels of each timed entry, {result['shape']}, KIVI-{result['bits']}",
        "",
        f"CUPTI trace (jax.profiler) of {result['calls']} calls inside one jit, median over"
        " the traced runs. span: first kernel start to last kernel end per run; busy: the sum"
        " of kernel durations; both per call.",
        "",
        "| entry | span µs/call | busy µs/call | kernel | launches/call | mean µs |",
        "|---|---:|---:|---|---:|---:|",
    ]
    calls = result["calls"]
    for name, e in result["entries"].items():
        first = True
        for k, d in e["kernels"].items():
            head = (
                f"| {name} | {e['span_us'] / calls:.1f} | {e['busy_us'] / calls:.1f} "
                if first
                else "| | | "
            )
            lines.append(f"{head}| `{k[:60]}` | {d['launches_per_run'] / calls:.2f} | "
                         f"{d['mean_us']:.1f} |")  # fmt: skip
            first = False
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
