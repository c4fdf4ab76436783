"""Decode matmuls with quantized weights on one GPU: the fused kernels (the tensor-core
pallas_kernels/matmul/gpu.py; at 1-2 rows also the small-M gemv.py) against XLA's
dequantize-then-dot (kivi_jax.weights' reference) and the bf16 weight's dot, on the linear
layers of the Llama-3-8B shape at decode batch sizes.

Per row: GPU time (a CUPTI trace, entries timed round-robin, medians; rows of one call only),
the byte floor (the weight's stored bytes, scales and zero points included, over the read
bandwidth measured in the same call) and the percent of it, and the kernels of one run. With
`--sweep` each kernel row also tries the tilings of TILINGS (the small-M kernel's rows: those of
gemv_tilings) and reports the best beside the default's.

    python benchmarks/matmul.py --out DIR [--batches 1 16 64] [--sweep 16] [--formats int8 ...]
    python benchmarks/matmul.py --smoke --out DIR    # CPU: small shapes, interpreted kernel
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from kivi_jax.pallas_kernels.matmul import gemv
from kivi_jax.pallas_kernels.matmul.gpu import Tiling, default_tiling, quantized_matmul, row_step
from timing import interleaved, kernel_totals, measure_read_bandwidth, traced_by_entry

from kivi_jax.weights import QuantizedWeight, dequantize, quantize_matrix, storage_bits

# Llama-3-8B's linear layers [in, out] (w_qkv, wo, w_gate_up, w_down).
SHAPES = {"gate_up": (4096, 28672), "down": (14336, 4096), "qkv": (4096, 6144), "o": (4096, 4096)}
SMOKE_SHAPES = {"gate_up": (256, 512)}
# (format, bits, group): int8 per channel, int4 in groups of 32 (a GGUF's Q4_1) and 128.
FORMATS = (("int8", 8, None), ("int4 g32", 4, 32), ("int4 g128", 4, 128))
TILINGS = tuple(
    Tiling(block_n=bn, splits=s, num_warps=w, num_stages=st)
    for bn in (64, 128, 256)
    for s in (1, 2, 4, 8)
    for w, st in ((4, 3), (8, 5))
)


def gemv_tilings(k: int, n_bytes: int, group: int) -> list:
    """The small-M kernel's sweep: at 16, 8 and 4 bytes a thread, the fewest K splits that
    give 2, 4 and 8 warps an SM (132 SMs)."""
    out = []
    for per_thread in (16, 8, 4):
        if n_bytes % (per_thread * 32):
            continue
        blocks = n_bytes // (per_thread * 32)
        fits = [gemv.Tiling(per_thread, num_warps=4, splits=d) for d in range(1, k // 32 + 1)]
        fits = [t for t in fits if gemv.tiling_unsupported_reason(t, k, n_bytes, group) is None]
        for per_sm in (2, 4, 8):
            t = next((t for t in fits if blocks * t.splits * 4 >= per_sm * 132), None)
            if t is not None and t not in out:
                out.append(t)
    return out


def stored_bytes(w) -> int:
    leaves = jax.tree.leaves(w)
    return sum(x.size * storage_bits(x) // 8 for x in leaves)


def _exact(w) -> jax.Array:
    """The weight in float32, its scales and zero points widened first (no rounding of the
    dequantized weight to the scale's dtype): what a matmul of it should give."""
    if not isinstance(w, QuantizedWeight):
        return w.astype(jnp.float32)
    wide = lambda x: None if x is None else x.astype(jnp.float32)
    return dequantize(QuantizedWeight(w.qvalue, wide(w.scale), wide(w.zero_point)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        metavar="BATCH",
        help="at these batches also try every tiling of TILINGS",
    )
    p.add_argument(
        "--formats",
        nargs="+",
        choices=[f for f, _, _ in FORMATS],
        default=[f for f, _, _ in FORMATS],
    )
    p.add_argument("--smoke", action="store_true", help="small shapes, interpreted (no GPU)")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    bw = max(measure_read_bandwidth(gib=4.0 if gpu else 0.0625).values())
    print(f"read {bw / 1e9:.0f} GB/s", flush=True)

    def kernel(t=None):
        return jax.jit(
            lambda x, w: quantized_matmul(
                x, w.qvalue, w.scale, w.zero_point, tiling=t, interpret=not gpu
            )
        )

    def small(t=None):
        return jax.jit(
            lambda x, w: gemv.quantized_gemv(
                x, w.qvalue, w.scale, w.zero_point, tiling=t, interpret=not gpu
            )
        )

    xla = jax.jit(lambda x, w: x @ dequantize(w).astype(x.dtype))
    rows = []
    for name, (k, n) in shapes.items():
        w16 = (jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02).astype(
            jnp.bfloat16
        )
        for b in args.batches:
            x = jax.random.normal(jax.random.key(1), (b, k), jnp.float32).astype(jnp.bfloat16)
            runs = {("bf16", "dot", None): (jax.jit(jnp.matmul), (x, w16))}
            weights = {}
            for fmt, bits, group in (f for f in FORMATS if f[0] in args.formats):
                w = quantize_matrix(w16, bits=bits, group_size=group or k)
                weights[fmt] = w
                runs[(fmt, "xla", None)] = (xla, (x, w))
                runs[(fmt, "kernel", None)] = (kernel(), (x, w))
                if gemv.unsupported_reason(b, k, n, w.group, w.qvalue.dtype, x.dtype,
                                           w.scale.dtype) is None:  # fmt: skip
                    runs[(fmt, "gemv", None)] = (small(), (x, w))
                    if gpu and b in (args.sweep or ()):
                        for t in gemv_tilings(k, n * bits // 8, w.group):
                            runs[(fmt, "gemv", t)] = (small(t), (x, w))
                if gpu and b in (args.sweep or ()):
                    for t in TILINGS:
                        if k % (t.splits * row_step(k, w.group, t.block_k)) == 0:
                            runs[(fmt, "kernel", t)] = (kernel(t), (x, w))
            times = interleaved(runs, rounds=args.rounds)[0] if gpu else {}
            live = {
                r: v for r, v in runs.items() if r[2] is None and not isinstance(times.get(r), str)
            }
            traced = traced_by_entry(live, rounds=1)
            for (fmt, impl, t), (fn, (xx, w)) in runs.items():
                if t is not None:
                    continue
                ref = xx.astype(jnp.float32) @ _exact(w)
                sec = times.get((fmt, impl, None))
                if isinstance(sec, str):  # failed to build or run
                    print(f"{name} b{b} {fmt} {impl}: {sec}", flush=True)
                    rows.append(dict(shape=name, k=k, n=n, batch=b, format=fmt, impl=impl,
                                     error=sec))  # fmt: skip
                    continue
                err = jnp.linalg.norm(fn(xx, w).astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
                floor = stored_bytes(w) / bw
                row = dict(shape=name, k=k, n=n, batch=b, format=fmt, impl=impl,
                           us=sec and sec * 1e6, floor_us=floor * 1e6,
                           pct_floor=sec and 100 * floor / sec, rel_err=float(err))  # fmt: skip
                if (fmt, impl, None) in traced:
                    kt = kernel_totals(traced[(fmt, impl, None)][0])
                    row["kernels"] = {nm[:60]: [c, s * 1e6] for nm, (c, s) in kt.items()}
                if impl == "gemv":
                    bits = storage_bits(w.qvalue)
                    row["tiling"] = str(gemv.default_tiling(k, n * bits // 8, w.group, bits=bits))
                if impl == "kernel":
                    row["tiling"] = str(default_tiling(k, n, w.group))
                swept = {t: times[(fmt, impl, t)] for (f, i, t) in runs
                         if (f, i) == (fmt, impl) and t is not None
                         and isinstance(times.get((f, i, t)), float)}  # fmt: skip
                if swept:
                    best = min(swept, key=swept.get)
                    row |= dict(best_us=swept[best] * 1e6, best_tiling=str(best))
                rows.append(row)
                print(f"{name:8s} b{b:<3d} {fmt:10s} {impl:6s} "
                      f"{row['us'] or 0:8.1f} us floor {row['floor_us']:6.1f} "
                      f"{row['pct_floor'] or 0:5.1f}% err {row['rel_err']:.1e}"
                      + (f" best {row['best_us']:.1f} {row['best_tiling']}" if "best_us" in row
                         else ""), flush=True)  # fmt: skip
        save(args.out, bw, rows)  # after each layer: a run cut short keeps what it measured


def save(out: Path, bw: float, rows: list) -> None:
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  read_gbps=bw / 1e9, rows=rows)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "matmul.json").write_text(json.dumps(result, indent=1))
    (out / "matmul.md").write_text(markdown(result))


def markdown(result: dict) -> str:
    lines = [
        "# Decode matmuls with quantized weights (benchmarks/matmul.py)",
        "",
        f"{result['device']}, jax {result['jax']}, read bandwidth {result['read_gbps']:.0f} GB/s "
        "(measured in the same call). GPU time per matmul, x [batch, in] bf16; floor = the "
        "weight's stored bytes (scales and zero points included) over the read bandwidth.",
        "",
        "| layer [in, out] | batch | format | XLA dequant + dot µs | kernel µs | kernel % of floor "
        "| small-M kernel µs (% of floor) | bf16 dot µs | best kernel vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    get = lambda r, fmt, impl: next(
        (x for x in result["rows"] if (x["shape"], x["batch"], x["format"], x["impl"])
         == (r["shape"], r["batch"], fmt, impl)), {})  # fmt: skip
    fmt_us = lambda v: f"{v:.1f}" if v else "-"
    for r in result["rows"]:
        if r["impl"] != "kernel" or "error" in r:
            continue
        xla, bf16 = get(r, r["format"], "xla"), get(r, "bf16", "dot")
        small = get(r, r["format"], "gemv")
        best = min((v for v in (r["us"], small.get("us")) if v), default=None)
        ratio = bf16.get("us") / best if best and bf16.get("us") else None
        small_cell = f"{small['us']:.1f} ({small['pct_floor']:.0f}%)" if small.get("us") else "-"
        lines.append(
            f"| {r['shape']} [{r['k']}, {r['n']}] | {r['batch']} | {r['format']} "
            f"| {fmt_us(xla.get('us'))} | {fmt_us(r['us'])} "
            f"| {r['pct_floor']:.0f}% | {small_cell} | {fmt_us(bf16.get('us'))} | "
            + (f"{ratio:.2f}x |" if ratio else "- |")
            if r["us"]
            else f"| {r['shape']} | {r['batch']} | {r['format']} | - | - | - | - | - | - |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
