"""What bounds each decode kernel: its time with all its work, with its loads only, and with its
arithmetic only (H200 or any CUDA GPU).

The score and value kernels of ``pallas_kernels/decode_attention/gpu.py`` run their main
loop through ``loops.pipelined_loop(n_tiles, depth, load, compute, carry, live, ring)``. This
script times each kernel alone at one shape four ways, by swapping that function while the
kernel is traced (the value kernel's short loop over its share of the residual tail is swapped too):

* ``full``: the kernel as shipped;
* ``loads``: the shipped loop and loads, with the arithmetic replaced by folding each loaded
  array into the carry (one add per element, after summing it over trailing axes where no carry
  array has its shape: the score kernel's words and query parts, across lanes). The loaded bytes
  stay; the score kernel's logit stores, part of its arithmetic, go;
* ``words``: as ``loads``, with the loads of the int32 code words only (the scales, zero points,
  logits and residual tail go): how fast the codes stream without the smaller arrays beside
  them;
* ``arith``: the shipped loop and arithmetic on tile 0, loaded once before the loop: every
  iteration computes on it with each array perturbed by the tile index (int32 words XOR k,
  floats + k * 1e-30) so that nothing can be hoisted out of the loop. The loads go; the score
  kernel still stores its logits.

Times are GPU time (a CUPTI trace of interleaved rounds, as in ``attention.py``); host time
where there is no trace.

If ``full`` is close to ``max(loads, arith)`` the two overlap and the larger one is the limit; if
it is close to their sum, they do not overlap. A background sampler records the SM clock
(nvidia-smi) during each timing, which turns times into cycles.

    python benchmarks/kernel_limits.py --out benchmarks/results
    python benchmarks/kernel_limits.py --out DIR --bits 4 --tuning '{"prefetch": 2}'

writes kernel_limits.json and kernel_limits.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from kivi_jax.pallas_kernels.decode_attention import GpuTuning, loops

sys.path.insert(0, str(Path(__file__).parent))
import attention as bench  # the shapes and random states
from timing import interleaved


def _loads_only_loop(n_tiles, depth, load, compute, carry, live, ring=None):
    """The kernel's loop and loads as shipped (issued ahead in registers, or, in a plain loop of
    Triton's pipeliner, by cp.async), with `compute` replaced by folding each loaded array into
    a carry array with one add per element (an array of the carry's shape, or the loaded one
    summed over trailing axes until one matches)."""
    del compute

    def fold(k, tile, carry):
        leaves, tree = jax.tree.flatten(carry)
        for x in jax.tree.leaves(tile):
            if x.dtype == jnp.int32:
                x = lax.bitcast_convert_type(x & 0x3FFFFFFF, jnp.float32)  # finite floats
            x = x.astype(jnp.float32)
            while True:
                i = next((i for i, c in enumerate(leaves) if c.shape[: x.ndim] == x.shape), None)
                if i is not None:
                    c = leaves[i]
                    leaves[i] = c + x.reshape(*x.shape, *(1,) * (c.ndim - x.ndim))
                    break
                x = jnp.sum(x, axis=-1)
        return jax.tree.unflatten(tree, leaves)

    return _SHIPPED_LOOP(n_tiles, depth, load, fold, carry, live, ring)


def _words_only_loop(n_tiles, depth, load, compute, carry, live, ring=None):
    """As `_loads_only_loop`, keeping only the loads of int32 arrays (the code words): the
    others go unused, and the compiler drops them. The caller's early loads (`ring`) stay
    where the caller issued them."""
    words = lambda tile: [x for x in jax.tree.leaves(tile) if x.dtype == jnp.int32]
    ring = None if ring is None else tuple(words(tile) for tile in ring)
    return _loads_only_loop(n_tiles, depth, lambda k: words(load(k)), compute, carry, live, ring)


def _arith_only_loop(n_tiles, depth, load, compute, carry, live, ring=None):
    """The shipped loop computing every tile from tile 0, loaded once before the loop (or
    taken from the caller's early loads, `ring`)."""
    tile0 = load(0) if ring is None else ring[0]

    def perturbed(k):
        tiny = jnp.float32(1e-30) * k  # a float no compiler can prove constant
        perturb = lambda x: x ^ k if x.dtype == jnp.int32 else x + tiny.astype(x.dtype)
        return jax.tree.map(perturb, tile0)

    ring = None if ring is None else tuple(perturbed(k) for k in range(depth))
    return _SHIPPED_LOOP(n_tiles, depth, perturbed, compute, carry, live, ring)


_SHIPPED_LOOP = loops.pipelined_loop
VARIANTS = {
    "full": None,
    "loads": _loads_only_loop,
    "words": _words_only_loop,
    "arith": _arith_only_loop,
}


@contextlib.contextmanager
def _loop(variant: str):
    if VARIANTS[variant] is not None:
        loops.pipelined_loop = VARIANTS[variant]
    try:
        yield
    finally:
        loops.pipelined_loop = _SHIPPED_LOOP


class ClockSampler:
    """SM clock (MHz) from nvidia-smi every ~0.1 s in a thread; `median(t0, t1)` over a window."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = None
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self):
        cmd = ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            out = subprocess.run(cmd, capture_output=True, text=True).stdout.split()
            if out:
                self.samples.append((time.perf_counter(), float(out[0])))
            time.sleep(0.1)

    def median(self, t0: float, t1: float) -> float | None:
        window = [mhz for t, mhz in self.samples if t0 <= t <= t1]
        return statistics.median(window) if window else None

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def measure(s: bench.Shape, bits: int, tuning: GpuTuning, *, calls, repeats, clock) -> list:
    key = jax.random.key(3)
    qs = bench._queries(key, s, calls)
    states = bench.kivi_states(key, s, bits)
    logits = bench.random_logits(key, s, len(states), bits=bits, tuning=tuning, state=states[0])
    runs, errors = {}, {}
    for variant in VARIANTS:
        kernels = bench.kernel_runs(s, bits, tuning, qs, states, logits)
        for name, (fn, args) in kernels.items():
            kernel = name.removesuffix("_kernel_us")  # "score" or "value"
            try:
                with _loop(variant):  # the variant is fixed when the kernel is traced
                    runs[kernel, variant] = (fn.lower(*args).compile(), args)
            except Exception as e:  # a variant that does not build is reported, not fatal
                errors[kernel, variant] = f"{type(e).__name__}: {str(e)[:300]}"
    t0 = time.perf_counter()
    timed, timing = interleaved(runs, rounds=repeats)
    timed |= errors
    mhz = clock.median(t0, time.perf_counter())
    out = []
    for (kernel, variant), v in timed.items():
        rec = {"shape": s.name, "bits": bits, "kernel": kernel, "variant": variant,
               "bytes": kernel_bytes(s, bits, kernel),
               "code_bytes": code_bytes(s, bits),
               "sm_clock_mhz": mhz,
               "timing": timing}  # fmt: skip
        if isinstance(v, float):
            rec["us"] = v / calls * 1e6
        else:
            rec["error"] = v
        print(f"  {rec}", flush=True)
        out.append(rec)
    return out


def code_bytes(s: bench.Shape, bits: int) -> int:
    """Bytes of the key codes, and of the value codes (the same number): what the `words`
    variant of the score or the value kernel reads."""
    return s.batch * s.kv_heads * s.context * s.head_dim * bits // 8


def kernel_bytes(s: bench.Shape, bits: int, kernel: str) -> int:
    """Bytes a kernel reads. Score kernel: the codes and the bf16 key scales and zero points;
    value kernel: codes, bf16 scales and zero points, the float32 logits of every query head,
    and the bf16 residual keys and values (the tail)."""
    bh, c, d, n_rep = s.batch * s.kv_heads, s.context, s.head_dim, s.q_heads // s.kv_heads
    params = 2 * 2 * c * d // bench.GROUP
    per_kernel = {"score": params, "value": params + 4 * c * n_rep + 2 * 2 * bench.RESIDUAL * d}
    return code_bytes(s, bits) + bh * per_kernel[kernel]


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        f"# What bounds each decode kernel ({result['device']}, jax {result['jax']})",
        "",
        "Each kernel alone, timed as its shipped loop (`full`), with its loads only (`loads`),",
        "with the loads of its code words only (`words`; GB/s on the codes' bytes), and with",
        "its arithmetic only (`arith`: tile 0 loaded once). Per call, median of "
        f"{result['repeats']} runs of {result['calls']} calls inside one jit; SM clock = median",
        f"of nvidia-smi samples during that timing. Tuning: {result['tuning']}.",
        "",
        "| shape | bits | kernel | MB read | full µs | loads µs | loads GB/s | arith µs "
        "| words µs | words GB/s | full / max(loads, arith) | SM MHz |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = {}
    for r in result["rows"]:
        by.setdefault((r["shape"], r["bits"], r["kernel"]), {})[r["variant"]] = r
    for (shape, bits, kernel), v in by.items():
        us = {k: v[k].get("us") if k in v else None for k in VARIANTS}
        fmt = lambda x: f"{x:.1f}" if x is not None else "failed"
        ratio = (
            f"{us['full'] / max(us['loads'], us['arith']):.2f}"
            if None not in (us["full"], us["loads"], us["arith"])
            else ""
        )
        mhz = v["full"].get("sm_clock_mhz")
        nbytes = v["full"]["bytes"]
        gbs = f"{nbytes / us['loads'] / 1e3:.0f}" if us["loads"] is not None else ""
        code_bytes = v["full"].get("code_bytes")  # absent in files of earlier versions
        words_gbs = f"{code_bytes / us['words'] / 1e3:.0f}" if us["words"] and code_bytes else ""
        lines.append(
            f"| {shape} | {bits} | {kernel} | {nbytes / 1e6:.0f} | {fmt(us['full'])} | "
            f"{fmt(us['loads'])} | {gbs} | {fmt(us['arith'])} | {fmt(us['words'])} | "
            f"{words_gbs} | {ratio} | "
            f"{mhz if mhz is not None else ''} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--gqa", action="store_true", help="also Llama-3-8B heads (GQA 4)")
    p.add_argument("--bits", type=int, nargs="+", choices=[2, 4], default=[2, 4])
    p.add_argument("--tuning", type=json.loads, default={}, help="GpuTuning fields as JSON")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tuning = GpuTuning(**args.tuning)
    shapes = [s for s in bench.SHAPES if (s.batch, s.context) == (8, 32768)]
    shapes = shapes if args.gqa else shapes[:1]
    clock = ClockSampler()
    result = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "calls": args.calls,
        "repeats": args.repeats,
        "tuning": dataclasses.asdict(tuning),
        "rows": [],
    }
    for s in shapes:
        for bits in args.bits:
            result["rows"] += measure(
                s, bits, tuning, calls=args.calls, repeats=args.repeats, clock=clock
            )
            (args.out / "kernel_limits.json").write_text(json.dumps(result, indent=1))
    clock.stop()
    result["clock_samples_mhz"] = [mhz for _, mhz in clock.samples]
    (args.out / "kernel_limits.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, args.out / "kernel_limits.md")
    print((args.out / "kernel_limits.md").read_text())


if __name__ == "__main__":
    main()
