"""The decode step's weight matmuls alone: XLA's GEMM (what `models/llama.py` ran) against the
Pallas kernel (`pallas_kernels/matmul/gpu.py`) over a grid of tilings, at the Llama-2-7B and
Llama-3-8B widths. Each entry runs 8 distinct weight matrices in one jit (so the L2 cache holds
none of them between calls) and adds a float32 residual to each product, the consumer the
split-K partial sums fuse into in the model; GPU time from a CUPTI trace, medians, one process.

    python benchmarks/skinny_matmul.py --out DIR [--rows 16 64] [--shapes 7B-qkv ...]

Writes DIR/skinny_matmul.{json,md}: per shape and rows, µs per matmul and GB/s of its weights
for XLA and for every tiling, and the best tiling.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import timing
from kivi_jax.pallas_kernels.matmul.gpu import MatmulTiling, matmul_partials

SHAPES = {  # [K, N] of the weights, x @ w layout
    "7B-qkv": (4096, 12288),
    "7B-o": (4096, 4096),
    "7B-gate_up": (4096, 22016),
    "7B-down": (11008, 4096),
    "8B-qkv": (4096, 6144),
    "8B-o": (4096, 4096),
    "8B-gate_up": (4096, 28672),
    "8B-down": (14336, 4096),
}
LAYERS = 8


def tilings(K: int, N: int) -> list[MatmulTiling]:
    out = []
    for bn in (32, 64, 128, 256):
        for bk in (64, 128, 256):
            if not 16 * 1024 <= bn * bk * 2 <= 32 * 1024 or N % bn:
                continue
            for s in (1, 2, 4, 8):
                if K % bk or N // bn * s < 132 or N // bn * s > 8 * 132:
                    continue
                for stages in (3, 5):
                    out.append(MatmulTiling(bn, bk, s, num_warps=4, num_stages=stages))
    return out


def name(t: MatmulTiling) -> str:
    return f"bn{t.block_n} bk{t.block_k} s{t.splits} w{t.num_warps} st{t.num_stages}"


def entries(M: int, K: int, N: int, limit: int | None):
    keys = jax.random.split(jax.random.key(M * 7 + K + N), 3)
    x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
    # separate arrays: a slice of one stacked array would be copied out before a custom call
    ws = [jax.random.normal(k, (K, N), jnp.bfloat16) for k in jax.random.split(keys[1], LAYERS)]
    r = jax.random.normal(keys[2], (M, N), jnp.float32)

    @jax.jit
    def xla(x, ws, r):
        return [jnp.einsum("mi,io->mo", x, ws[i]).astype(jnp.float32) + r for i in range(LAYERS)]

    runs = {"xla": (xla, (x, ws, r))}
    want = xla(x, ws, r)
    for t in tilings(K, N)[:limit]:

        @jax.jit
        def pallas(x, ws, r, t=t):
            return [jnp.sum(matmul_partials(x, ws[i], t), 0) + r for i in range(LAYERS)]

        runs[name(t)] = (pallas, (x, ws, r))
    return runs, want


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--limit", type=int, default=None, help="at most this many tilings a shape")
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "device": str(jax.devices()[0].device_kind),
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "layers_per_entry": LAYERS,
        "rows": [],
    }
    lines = [
        "# Decode-step weight matmuls alone (`benchmarks/skinny_matmul.py`)",
        "",
        f"{result['device']}, jax {jax.__version__}; 8 weight matrices per jit, µs per matmul"
        " (GPU time); GB/s of the weights' bytes.",
        "",
        "| shape | rows | XLA µs | XLA GB/s | best Pallas µs | GB/s | tiling | tilings tried |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for shape in a.shapes:
        K, N = SHAPES[shape]
        for M in a.rows:
            runs, want = entries(M, K, N, a.limit)
            errors = {}
            for k, (fn, args) in list(runs.items()):
                try:
                    got = fn(*args)
                    err = max(
                        float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
                        for g, w in zip(got, want, strict=True)
                    )
                    if err > 1e-2:  # XLA's products are rounded to bf16 before the add
                        errors[k] = f"max abs error {err}"
                        del runs[k]
                except Exception as e:  # a tiling Triton cannot build: recorded
                    errors[k] = f"{type(e).__name__}: {str(e)[:200]}"
                    del runs[k]
            times = timing.device_interleaved(runs, rounds=a.rounds)
            us = {k: v * 1e6 / LAYERS for k, v in times.items()}
            gbps = {k: K * N * 2 / (v * 1e-6) / 1e9 for k, v in us.items()}
            best = min((k for k in us if k != "xla"), key=us.get, default=None)
            row = {"shape": shape, "M": M, "K": K, "N": N, "us": us, "GBps": gbps}
            row |= {"best": best, "errors": errors}
            result["rows"].append(row)
            print(
                shape,
                M,
                f"xla {us.get('xla', 0):.1f}",
                best,
                f"{us.get(best, 0):.1f}",
                f"({len(us) - 1} tilings, {len(errors)} failed)",
                flush=True,
            )
            if best:
                lines.append(
                    f"| {shape} | {M} | {us['xla']:.1f} | {gbps['xla']:.0f} | {us[best]:.1f} | "
                    f"{gbps[best]:.0f} | {best} | {len(us) - 1} |"
                )
            (out / "skinny_matmul.json").write_text(json.dumps(result, indent=1))
            (out / "skinny_matmul.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
