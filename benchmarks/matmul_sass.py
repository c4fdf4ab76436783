"""SASS of the quantized-weight matmul kernels, built without a GPU: instructions per code.

The small-M kernel (pallas_kernels/matmul/gemv.py) at 1-4 rows and the tensor-core kernel
(pallas_kernels/matmul/gpu.py) at 16, on Llama-3-8B's w_gate_up [4096, 28672] with their
default tilings, lowered by jax for CUDA, compiled by Triton for sm_90a (benchmarks/
kernel_sass.py's compile_sass; needs `triton` installed beside jax). Per code = the innermost
loop's instructions over the codes one thread handles in one iteration; for the small-M
kernel also with its per-group fold (scales, zero points) spread over the group's codes.

    python benchmarks/matmul_sass.py --out benchmarks/results/matmul_sass.md
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import sys
import tempfile
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from kernel_sass import compile_sass, loops, opcode, strip
from kivi_jax.pallas_kernels.matmul import gemv, gpu
from triton_fingerprint import lowered_modules  # on the path kernel_sass adds

K, N = 4096, 28672  # Llama-3-8B's w_gate_up [in, out]
FORMATS = {  # name: (codes, group, zero point)
    "int4 g128": (jnp.int4, 128, True),
    "int4 g32 (Q4_1)": (jnp.int4, 32, True),
    "int4 g32, no zero (Q4_0)": (jnp.int4, 32, False),
    "int8 per channel": (jnp.int8, K, False),
    "int8 g32 (Q8_0)": (jnp.int8, 32, False),
}
# (kernel, rows, formats): the small-M kernel at 1-2 rows on every format, at 3-4 rows (which
# it refuses: MAX_ROWS) on int4 g128 with 16 bytes a thread; the tensor-core kernel at 16.
CONFIGS = [("gemv", m, name) for m in (1, 2) for name in FORMATS] + [
    ("gemv", 3, "int4 g128"),
    ("gemv", 4, "int4 g128"),
    ("tensor cores", 16, "int4 g128"),
    ("tensor cores", 16, "int8 per channel"),
]


def branch_body(loop: list) -> int:
    """Instructions of the loop's largest forward-skipped region (the small-M kernel's fold,
    run once every few loop steps); 0 where it has none."""
    end = loop[-1][0]
    spans = [
        sum(1 for a, _ in loop if addr < a < int(m.group(1), 16))
        for addr, text in loop
        if (m := re.search(r"BRA\s+0x([0-9a-f]+)", text)) and addr < int(m.group(1), 16) <= end
    ]
    return max(spans, default=0)


def analyse(kernel: str, m: int, fmt: str, workdir: Path) -> dict:
    qdtype, group, zero = FORMATS[fmt]
    bits = 4 if qdtype == jnp.int4 else 8
    sd = jax.ShapeDtypeStruct
    args = [sd((m, K), jnp.bfloat16), sd((K, N), qdtype), sd((K // group, N), jnp.bfloat16)]
    args += [sd((K // group, N), jnp.bfloat16)] if zero else []
    if kernel == "gemv":
        t = gemv.default_tiling(K, N * bits // 8, group)
        fn = lambda x, q, s, *z: gemv.quantized_gemv(x, q, s, *z, tiling=t)
        warps, stages = t.num_warps, t.stages
        codes_row = t.bytes_per_thread * 8 // bits  # a thread's codes of a weight row
        kw = K // (t.splits * t.num_warps)  # a warp's run
        rows_iter = t.rows_per_step
        fold = math.gcd(kw, 256) if group == K else min(group, kw)  # rows between folds
    else:
        t = gpu.default_tiling(K, N, group)
        fn = lambda x, q, s, *z: gpu.quantized_matmul(x, q, s, *z, tiling=t)
        warps, stages = t.num_warps, t.num_stages
        step = gpu.row_step(K, group, t.block_k)
        codes_row, rows_iter, fold = t.block_n / (32 * warps), step, 0  # mma: per thread
    with mock.patch.object(gemv, "MAX_ROWS", 4):  # 3 and 4 rows: built to be counted
        [module] = lowered_modules(fn, args)
    info, sass = compile_sass(module, warps, stages, workdir)
    found = loops(sass)
    inner = min(found, key=len)
    per_iter = rows_iter * codes_row
    fold_len = branch_body(inner) if kernel == "gemv" else 0
    per_fold = (fold or rows_iter) // rows_iter  # loop steps between folds
    steady = len(inner) - fold_len  # the instructions of a step without the fold
    row = {
        "kernel": kernel,
        "rows": m,
        "format": fmt,
        "tiling": str(t),
        "registers": int(re.search(r"Used (\d+) registers", info).group(1)),
        "spill_bytes": int(s.group(1)) if (s := re.search(r"(\d+) bytes spill", info)) else 0,
        "loop_instructions": steady,
        "per_code": steady / per_iter,
        "fold_instructions": fold_len,
        "steps_a_fold": per_fold,
        "per_code_with_fold": (steady + fold_len / per_fold) / per_iter,
        "top": collections.Counter(opcode(x) for x in strip(inner)).most_common(8),
    }
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/matmul_sass.md"))
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kernel, m, fmt in CONFIGS:
            rows.append(analyse(kernel, m, fmt, Path(tmp)))
            print(rows[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# Quantized-weight matmul loops in SASS (sm_90a; Llama-3-8B w_gate_up [4096, 28672])",
        "",
        "Built by benchmarks/matmul_sass.py (jax lowering -> Triton -> ptxas, no GPU needed).",
        "per code = the innermost loop's instructions / the codes a thread handles an iteration;",
        "the small-M kernel's loop also holds its fold (scales and zero points applied, in a",
        "branch taken once every `steps` iterations): per code counts the loop without it, with",
        "fold adds its instructions / steps.",
        "",
        "| kernel | rows | format | tiling | registers | spill | per code | fold (steps) "
        "| with fold | top |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['rows']} | {r['format']} | {r['tiling']} | {r['registers']} "
            f"| {r['spill_bytes']} | {r['per_code']:.2f} "
            f"| {r['fold_instructions']} ({r['steps_a_fold']}) | {r['per_code_with_fold']:.2f} "
            f"| {', '.join(f'{o} {c}' for o, c in r['top'])} |"
        )
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
