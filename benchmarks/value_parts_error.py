"""Error of the GPU kernels' value weights in one or two int8 parts, on the CPU (interpret mode).

For a few KIVI states built as the kernel tests build them (ragged prompts, decode appends,
outlier key channels), the largest absolute error of `decode_attention_pallas` against the
float32 reference over the same dequantized state, with `GpuTuning(value_parts=2)` (the
default) and `value_parts=1`, beside the error of a plain implementation that rounds its
operands to the query's dtype (the yardstick of the kernel tests).

    python benchmarks/value_parts_error.py --out DIR

writes value_parts_error.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from kivi_jax.pallas_kernels.decode_attention import GpuTuning, decode_attention_pallas

import kivi_jax

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import test_decode_attention_kernel as kt  # the tests' states and rounded reference

CASES = [  # k_bits, v_bits, dtype
    (2, 2, jnp.bfloat16),
    (4, 4, jnp.bfloat16),
    (2, 2, jnp.float16),
    (4, 4, jnp.float16),
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for k_bits, v_bits, dtype in CASES:
        q, cache = kt._case(
            rng, k_bits=k_bits, v_bits=v_bits, D=64, n_rep=2, dtype=dtype, H=2, max_len=384,
            prompts=[381, 250], steps=3, R=64,
        )  # fmt: skip
        ref = np.asarray(kivi_jax.decode_attention_reference(q.astype(jnp.float32), cache))
        row = {
            "k_bits": k_bits,
            "v_bits": v_bits,
            "dtype": jnp.dtype(dtype).name,
            "rounded_reference": float(np.abs(kt._rounded_reference(q, cache, dtype) - ref).max()),
        }
        for parts in (2, 1):
            tuning = GpuTuning(value_parts=parts, num_splits=2)
            out = decode_attention_pallas(q, cache, interpret=True, tuning=tuning)
            row[f"value_parts_{parts}"] = float(np.abs(np.asarray(out, np.float32) - ref).max())
        print(row, flush=True)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "value_parts_error.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# Value weights in one or two int8 parts: largest |kernel - float32 reference|",
        "",
        "`benchmarks/value_parts_error.py` (CPU, interpret mode): 2 sequences (lengths 384 and",
        "253), 2 KV heads x 2 query heads, head_dim 64, G = 32, R = 64. rounded reference: a",
        "plain implementation rounding query, keys, probabilities and values to the dtype.",
        "",
        "| k_bits | v_bits | dtype | rounded reference | value_parts=2 | value_parts=1 |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['k_bits']} | {r['v_bits']} | {r['dtype']} | {r['rounded_reference']:.2e} "
            f"| {r['value_parts_2']:.2e} | {r['value_parts_1']:.2e} |"
        )
    (args.out / "value_parts_error.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
