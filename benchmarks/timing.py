"""The GPU timing harness that the benchmark scripts share.

Device work is timed as GPU time from a CUPTI trace (through jax.profiler): a run's span is its
first kernel's start to its last kernel's end, so the host's dispatch is left out. Entries are
timed round-robin, one run of each per round, so that drift in the machine's speed hits every
entry alike; medians over the rounds are reported. Without a GPU trace (CPU runs) host time is
used instead. `measure_read_bandwidth` gives the HBM read bandwidth that byte floors are held to,
measured in the same process as what it is compared with.
"""

from __future__ import annotations

import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp


def _timed(fn, args, *, repeats: int) -> float:
    """Median seconds of fn(*args) over repeats, after two warm-up runs."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_kernels(trace_dir: str) -> list[tuple[str, int, int]]:
    """(name, start ns, end ns) of every kernel on the first GPU in a jax.profiler trace,
    sorted by start; [] where the trace has no GPU (CPU runs)."""
    paths = list(Path(trace_dir).rglob("*.xplane.pb"))
    if len(paths) != 1:
        return []
    plane = jax.profiler.ProfileData.from_file(str(paths[0])).find_plane_with_name("/device:GPU:0")
    if plane is None:
        return []
    lines = [ln for ln in plane.lines if "stream" in ln.name.lower()] or list(plane.lines)
    events = {(e.name, int(e.start_ns), int(e.end_ns)) for ln in lines for e in ln.events}
    return sorted(events, key=lambda e: e[1])


def split_runs(events, gap_ms: float = 2.0) -> list[list[tuple[str, int, int]]]:
    """Kernel events split into jit runs: the tracers below sleep 5 ms on the host after each
    run, so a gap over 2 ms (`gap_ms`) between kernels separates runs."""
    runs = [events[:1]] if events else []
    for e in events[1:]:
        if e[1] - runs[-1][-1][2] > gap_ms * 1e6:
            runs.append([])
        runs[-1].append(e)
    return runs


def span_seconds(run: list[tuple[str, int, int]]) -> float:
    """First kernel start to last kernel end of one traced run."""
    return (max(t1 for *_, t1 in run) - min(t0 for _, t0, _ in run)) * 1e-9


def timed_on_gpu(fn, args, *, repeats: int) -> tuple[float, float, str]:
    """(seconds, host seconds, timing) of one run of fn(*args): seconds is the median GPU time
    (first kernel start to last kernel end, so the host's dispatch before the first kernel and
    its wait after the last are left out; timing "gpu"), or the host time where there is no
    GPU trace (timing "host")."""
    host = _timed(fn, args, repeats=repeats)
    device = device_interleaved({0: (fn, args)}, rounds=repeats).get(0)
    return (host, host, "host") if device is None else (device, host, "gpu")


def timed_interleaved(runs: dict, *, rounds: int) -> dict:
    """Median seconds of each entry's fn(*args) (runs: name -> (fn, args)), timed round-robin,
    one call of each entry per round, so that drift in the machine's speed over the run hits
    every entry alike. An entry that fails to build or run is returned as its error string."""
    out, live = {}, {}
    for name, (fn, args) in runs.items():
        try:
            for _ in range(2):
                jax.block_until_ready(fn(*args))
            live[name] = (fn, args)
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e)[:300]}"
    times = {name: [] for name in live}
    for _ in range(rounds):
        for name, (fn, args) in live.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return out | {name: statistics.median(t) for name, t in times.items()}


def interleaved(runs: dict, *, rounds: int) -> tuple[dict, str]:
    """(times, timing): `timed_interleaved` on the host, then the entries that ran timed again
    on the GPU (`device_interleaved`), whose times replace the host's; timing is "gpu", or
    "host" where there is no usable GPU trace."""
    timed = timed_interleaved(runs, rounds=rounds)
    live = {k: run for k, run in runs.items() if isinstance(timed.get(k), float)}
    device = device_interleaved(live, rounds=rounds)
    return timed | device, "gpu" if device else "host"


def traced_runs(runs: dict, *, rounds: int) -> list[list[tuple[str, int, int]]]:
    """The GPU kernels of every run in one CUPTI trace of `rounds` round-robin rounds over
    runs (name -> (fn, args), already warm), in the order they ran; [] without a GPU trace."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(rounds):
            for fn, args in runs.values():
                jax.block_until_ready(fn(*args))
                time.sleep(0.005)  # split_runs separates runs at gaps over 2 ms
        jax.profiler.stop_trace()
        return split_runs(gpu_kernels(d))


def traced_by_entry(runs: dict, *, rounds: int) -> dict:
    """{entry: the kernel events of each of its `rounds` runs} from `traced_runs` over runs
    (name -> (fn, args), already warm); {} without a usable GPU trace."""
    order = list(runs)
    traced = traced_runs(runs, rounds=rounds)
    if len(traced) != rounds * len(order):
        if traced:  # a GPU trace whose runs could not be told apart: say so, use host time
            print(f"GPU trace: {len(traced)} runs for {rounds * len(order)}", file=sys.stderr)
        return {}
    return {name: traced[i :: len(order)] for i, name in enumerate(order)}


def device_interleaved(runs: dict, *, rounds: int) -> dict:
    """Median GPU seconds per run (first kernel start to last kernel end) of each entry of
    runs (name -> (fn, args), already warm); {} without a usable trace."""
    return {
        name: statistics.median(span_seconds(r) for r in per_run)
        for name, per_run in traced_by_entry(runs, rounds=rounds).items()
    }


def measure_read_bandwidth(gib: float = 8.0, repeats: int = 10) -> dict[str, float]:
    """Bytes/s of reductions that read a `gib` GiB array once per call (float32 and uint32 sums,
    and a float32 sum over rows, which XLA tiles differently), in GPU time where there is a
    trace (host time otherwise). The best is the peak."""

    seconds = lambda fn, x: timed_on_gpu(fn, (x,), repeats=repeats)[0]
    n = int(gib * 2**30) // 4
    rows = 2**14
    out = {}
    x = jax.random.bits(jax.random.key(0), (n,), jnp.uint32)
    out["sum_u32"] = n * 4 / seconds(jax.jit(lambda x: jnp.sum(x, dtype=jnp.uint32)), x)
    x = jax.lax.bitcast_convert_type(x >> 9 | 0x3F800000, jnp.float32)  # floats in [1, 2)
    out["sum_f32"] = n * 4 / seconds(jax.jit(jnp.sum), x)
    x = x.reshape(rows, n // rows)
    out["rowsum_f32"] = n * 4 / seconds(jax.jit(lambda x: jnp.sum(x, axis=1)), x)
    del x
    return out


def kernel_totals(run: list[tuple[str, int, int]]) -> dict[str, tuple[int, float]]:
    """{kernel name: (launches, summed seconds)} of one traced run, the largest total first."""
    totals = collections.defaultdict(lambda: [0, 0.0])
    for name, t0, t1 in run:
        totals[name][0] += 1
        totals[name][1] += (t1 - t0) * 1e-9
    return {n: (c, t) for n, (c, t) in sorted(totals.items(), key=lambda kv: -kv[1][1])}
