"""XLA's memory analysis of `generate`'s two programs at a Llama-2-7B shape: the scratch
(temp) bytes of the prompt program (`_start`: prefill in chunks of rows, then the first token)
and of the decode loop, compiled on this device from abstract weights (nothing runs).

Batch 16, 2048 + 128 tokens, rows chosen as `generate` chooses them on this device.

    python benchmarks/prefill_memory.py --out DIR [--kvs full kivi2]

writes DIR/prefill_memory.json and .md.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import init_params

from kivi_jax.generate import Sampling, _decode_jit, _prepare, _program_args, _start, _start_jit

B, PROMPT, NEW = 16, 2048, 128
LLAMA_2_7B = LlamaConfig(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
    num_kv_heads=32, head_dim=128, max_context=PROMPT + NEW + 128,
)  # fmt: skip


def scratch_gb(kv: str) -> dict:
    params = jax.eval_shape(lambda: init_params(LLAMA_2_7B, jax.random.key(0), jnp.bfloat16))
    s = Sampling()
    tokens, lengths, cache, rows = _prepare(
        params, np.zeros((B, PROMPT), np.int32), None, kv=kv, max_new_tokens=NEW, sampling=s
    )
    cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), cache)
    per_row, kw, decode_kw = _program_args(s, B, NEW)
    start = _start_jit.lower(params, tokens, lengths, cache, per_row, prefill_rows=rows, **kw)
    start = start.compile()
    state = jax.eval_shape(functools.partial(_start, prefill_rows=rows, **kw), params, tokens,
                           lengths, cache, per_row)  # fmt: skip
    decode = _decode_jit.lower(params, state, jnp.int32(NEW), **decode_kw).compile()
    return dict(
        kv=kv, rows=rows,
        start_temp_gb=start.memory_analysis().temp_size_in_bytes / 1e9,
        decode_temp_gb=decode.memory_analysis().temp_size_in_bytes / 1e9,
    )  # fmt: skip


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# Scratch memory of generate's programs (`benchmarks/prefill_memory.py`)",
        "",
        f"{result['device']}, jax {result['jax']}; Llama-2-7B shape, batch {B}, {PROMPT} + "
        f"{NEW}; XLA's memory analysis (temp bytes, GB).",
        "",
        "| kv | prefill rows at a time | prompt program | decode program |",
        "|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['kv']} | {r['rows']} | {r['start_temp_gb']:.3f} | "
                     f"{r['decode_temp_gb']:.3f} |")  # fmt: skip
    for b in result.get("before", []):
        lines.append(f"| {b['kv']}, {b['code']} | {b['rows']} | {b['start_temp_gb']:.3f} | |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kvs", nargs="+", default=["full", "kivi2"])
    args = parser.parse_args()
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  rows=[scratch_gb(kv) for kv in args.kvs])  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_memory.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, args.out / "prefill_memory.md")


if __name__ == "__main__":
    main()
