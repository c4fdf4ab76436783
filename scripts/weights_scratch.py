"""Scratch memory of a CPU decode step on quantized weights, under XLA's two CPU schedulers.

XLA's CPU backend dequantizes each matrix into scratch before its dot (it does not fuse converts
into dots). This compiles `llama.decode_step` of a 3-layer model (widths 256 / 512, float32,
int8 and int4 weights, full cache) in a fresh process per scheduler (the flag is read when the
backend starts) and records the compiled step's temp bytes against its largest dequantized
matrix and against all of them (docs/weights.md).

    python scripts/weights_scratch.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"

_MEASURE = """
import json, jax, jax.numpy as jnp, kivi_jax
from kivi_jax.models import llama
from kivi_jax.models.config import LlamaConfig
from kivi_jax.weights import quantize_weights
c = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=64, rope_theta=1e4, rms_eps=1e-5, tie_embeddings=True,
                max_context=64)
caches = kivi_jax.init_cache(None, batch=1, max_len=64, num_kv_heads=2, head_dim=64,
                             dtype=jnp.float32, num_layers=3)
zeros = jnp.zeros((1,), jnp.int32)
out = {}
for weights in ("float", "int8", "int4"):
    params = llama.init_params(c, jax.random.key(0))
    if weights != "float":
        params = quantize_weights(params, bits=int(weights[3:]))
    compiled = jax.jit(llama.decode_step).lower(params, zeros, zeros, caches).compile()
    m = compiled.memory_analysis()
    out[weights] = dict(temp_bytes=m.temp_size_in_bytes, argument_bytes=m.argument_size_in_bytes)
print(json.dumps(out))
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    results = {}
    for name, extra in (("default scheduler", ""), ("memory-first scheduler", FLAG)):
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {extra}".strip()
        done = subprocess.run(
            [sys.executable, "-c", _MEASURE], env=env, capture_output=True, text=True, check=True
        )
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    largest = 256 * 1024 * 4  # w_gate_up [256, 2 * 512] in float32
    everything = 3 * (256 * 512 + 256 * 256 + 256 * 1024 + 512 * 256) * 4
    result = {"largest_matrix_bytes": largest, "all_matrices_bytes": everything, **results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weights_scratch.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# Scratch of a CPU decode step on quantized weights (`scripts/weights_scratch.py`)",
        "",
        "3 layers, d 256, MLP 512, float32, full cache of 64, batch 1; XLA CPU (jax "
        f"{__import__('jax').__version__}). Largest dequantized matrix {largest:,} bytes; all "
        f"of them {everything:,}.",
        "",
        "| scheduler | weights | temp bytes | argument bytes |",
        "|---|---|---|---|",
    ]
    for name, by_weights in results.items():
        for weights, m in by_weights.items():
            lines.append(f"| {name} | {weights} | {m['temp_bytes']:,} | {m['argument_bytes']:,} |")
    (args.out / "weights_scratch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
