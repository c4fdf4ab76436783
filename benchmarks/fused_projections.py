"""Separate against fused projections: the matmuls of Llama blocks as 7 per layer (q, k, v, o,
gate, up, down) and as 4 (q/k/v as one matrix, o, gate/up as one, down), the model's layout
(models/llama.py `LayerWeights`).

Llama-2-7B and Llama-3-8B widths, L layers unrolled over separate random bf16 weights, STEPS
steps inside one jit, batch 16 and 96; GPU time from a CUPTI trace (the median of 5 runs, both
variants timed round-robin in one process), the weights' bytes over it.

    python benchmarks/fused_projections.py --out DIR

writes DIR/fused_projections.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from timing import kernel_totals, span_seconds, traced_by_entry

L, STEPS = 8, 4
MODELS = {"7B": (4096, 11008, 32), "8B": (4096, 14336, 8)}  # d, F, KV heads (of width 128)


def weights(d: int, f: int, kv: int, key) -> tuple[list[dict], list[dict]]:
    """L layers' separate matrices, and the same as the fused layout."""
    keys = iter(jax.random.split(key, 7 * L))
    w = lambda *shape: jax.random.normal(next(keys), shape, jnp.bfloat16) * 0.02
    separate = [
        dict(wq=w(d, d), wk=w(d, kv), wv=w(d, kv), wo=w(d, d), wg=w(d, f), wu=w(d, f),
             wd=w(f, d))
        for _ in range(L)
    ]  # fmt: skip
    fused = [
        dict(wqkv=jnp.concatenate([p["wq"], p["wk"], p["wv"]], 1), wo=p["wo"],
             wgu=jnp.concatenate([p["wg"], p["wu"]], 1), wd=p["wd"])
        for p in separate
    ]  # fmt: skip
    return separate, fused


def step_separate(h, ws, d, kv):
    """h [B, d] through the layers' matmuls, 7 a layer (kv: the k / v width)."""
    for p in ws:
        q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
        h = h + (q + jnp.tile(k + v, (1, d // kv))) @ p["wo"]  # attention's stand-in
        h = h + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]
    return h


def step_fused(h, ws, d, kv):
    """The same with q/k/v and gate/up fused, 4 a layer."""
    for p in ws:
        qkv = h @ p["wqkv"]  # [B, d + 2 kv]
        q, k, v = qkv[:, :d], qkv[:, d : d + kv], qkv[:, d + kv :]
        h = h + (q + jnp.tile(k + v, (1, d // kv))) @ p["wo"]
        gu = h @ p["wgu"]  # [B, 2F]
        f = gu.shape[1] // 2
        h = h + (jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ p["wd"]
    return h


def measure() -> dict:
    out = {}
    for model, (d, f, nkv) in MODELS.items():
        kv = nkv * 128
        separate, fused = weights(d, f, kv, jax.random.key(0))
        for batch in (16, 96):
            h0 = jax.random.normal(jax.random.key(1), (batch, d), jnp.bfloat16)
            runs = {}
            for name, step, ws in (
                ("separate", step_separate, separate),
                ("fused", step_fused, fused),
            ):

                def many(h, ws, step=step, d=d, kv=kv):
                    for _ in range(STEPS):
                        h = step(h, ws, d, kv) * 0.5  # no two steps alike: nothing merged
                    return h

                runs[name] = (jax.jit(many), (h0, ws))
            for fn, args in runs.values():
                jax.block_until_ready(fn(*args))
            for name, traced in traced_by_entry(runs, rounds=5).items():
                wbytes = sum(x.size * 2 for p in runs[name][1][1] for x in p.values())
                t = statistics.median(span_seconds(r) for r in traced) / STEPS
                top = list(kernel_totals(traced[-1]).items())[:6]
                out[f"{model} b{batch} {name}"] = dict(
                    ms_per_L_layers=t * 1e3, GBps=wbytes / t / 1e9,
                    kernels=len(traced[-1]) / STEPS, top=top,
                )  # fmt: skip
    return out


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# Separate against fused projections (`benchmarks/fused_projections.py`)",
        "",
        f"{result['device']}, jax {result['jax']}; GPU time of {L} layers' matmuls (unrolled, "
        "random bf16 weights), median of 5 traced runs; separate: q, k, v, o, gate, up, down; "
        "fused: q/k/v, o, gate/up, down.",
        "",
        "| widths | batch | separate ms | fused ms | separate GB/s | fused GB/s | kernels |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for model in MODELS:
        for batch in (16, 96):
            rows = result["rows"]
            s, f = rows[f"{model} b{batch} separate"], rows[f"{model} b{batch} fused"]
            lines.append(
                f"| {model} | {batch} | {s['ms_per_L_layers']:.3f} | {f['ms_per_L_layers']:.3f} "
                f"| {s['GBps']:.0f} | {f['GBps']:.0f} | {s['kernels']:.0f} -> {f['kernels']:.0f} |"
            )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = jax.devices()[0]
    result = dict(device=device.device_kind, jax=jax.__version__, rows=measure())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fused_projections.json").write_text(json.dumps(result, indent=1, default=str))
    write_markdown(result, args.out / "fused_projections.md")


if __name__ == "__main__":
    main()
