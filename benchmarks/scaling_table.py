"""Memory per device of Llama-3-8B, Llama-3-70B and Llama-3.1-405B split over 1, 2, 4 and 8
H200s of one host and 16 and 32 of 2 and 4 hosts of 8 (tensor parallelism over all of them,
kivi_jax.sharding and kivi_jax.distributed), for the bf16 cache, KIVI-2 and KIVI-4: weights,
the cache of 1k tokens of one row, and the largest batch at 4k and 32k tokens of context.
Computed, not
measured (nothing runs on a device): the weights' shapes with their split (sharding.param_specs),
the cache's bytes by the project's own accounting (kivi_jax.held_bits for the tokens held,
kivi_jax.memory_report for what a row's state allocates at a capacity).

    python benchmarks/scaling_table.py [--out benchmarks/results]

The budget is generate_gpu.py's: the H200's allocator limit (142.6 GB, the "card" budget of
benchmarks/results/generate_gpu.json), of which weights and cache may take 92%
(predicted_max_batch: the rest for the prompt's and the decode step's working memory).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import init_params

import kivi_jax
from kivi_jax import sharding
from kivi_jax.generate import resolve_kv

CARD_GB = 142.6  # H200 allocator limit, benchmarks/results/generate_gpu.json budget "card"
SHARE = 0.92  # of it for weights and cache (generate_gpu.predicted_max_batch)
MODELS = {
    "Llama-3-8B": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, tie_embeddings=False,
        max_context=32768,
    ),
    "Llama-3-70B": LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0, tie_embeddings=False,
        max_context=32768,
    ),
    "Llama-3.1-405B": LlamaConfig(
        vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_layers=126,
        num_heads=128, num_kv_heads=8, head_dim=128, rope_theta=500000.0, tie_embeddings=False,
        max_context=32768,
    ),
}  # fmt: skip
DEVICES = (1, 2, 4, 8, 16, 32)
GPUS_PER_HOST = 8
KVS = ("full", "kivi2", "kivi4")
CONTEXTS = (4096, 32768)


@functools.cache
def weight_bytes_per_device(config: LlamaConfig, devices: int) -> int:
    """Bytes of bf16 weights on each device: the split ones (rows or columns over "model")
    divided by the devices, the embedding, norms and output projection whole."""
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0), jnp.bfloat16))
    total = 0
    for x, spec in zip(
        jax.tree.leaves(params), jax.tree.leaves(sharding.param_specs(params)), strict=True
    ):
        split = devices if sharding.MODEL_AXIS in tuple(spec) else 1
        total += math.prod(x.shape) * x.dtype.itemsize // split
    return total


def kv_heads_per_device(config: LlamaConfig, devices: int) -> int:
    """KV heads each device holds (one, replicated, where devices outnumber them)."""
    return max(config.num_kv_heads, devices) // devices


def cache_bytes_per_1k_tokens(config: LlamaConfig, kv: str, devices: int) -> float:
    """Bytes on each device of 1024 tokens held by one row (all layers; held_bits)."""
    held = kivi_jax.held_bits(resolve_kv(kv), length=1024, head_dim=config.head_dim)
    return held.total_bits / 8 * config.num_layers * kv_heads_per_device(config, devices)


@functools.cache
def row_bytes(config: LlamaConfig, kv: str, devices: int, context: int) -> int:
    """Bytes on each device of one row's state allocated for `context` tokens (memory_report
    of the state's shapes: codes, scales, zeros, rings and counters)."""
    state = jax.eval_shape(
        lambda: kivi_jax.init_cache(
            resolve_kv(kv), batch=1, max_len=context, head_dim=config.head_dim,
            num_kv_heads=kv_heads_per_device(config, devices), dtype=jnp.bfloat16,
            num_layers=config.num_layers,
        )
    )  # fmt: skip
    return kivi_jax.memory_report(state).total_bytes


def table() -> list[dict]:
    rows = []
    budget = SHARE * CARD_GB * 1e9
    for name, config in MODELS.items():
        for devices in DEVICES:
            weights = weight_bytes_per_device(config, devices)
            for kv in KVS:
                left = budget - weights
                batch = {
                    f"max_batch_{context // 1024}k": max(
                        0, int(left // row_bytes(config, kv, devices, context))
                    )
                    for context in CONTEXTS
                }
                rows.append(
                    {
                        "model": name,
                        "devices": devices,
                        "hosts": -(-devices // GPUS_PER_HOST),
                        "kv": kv,
                        "weights_gb": weights / 1e9,
                        "cache_mb_per_1k_tokens_row": cache_bytes_per_1k_tokens(config, kv, devices)
                        / 1e6,
                        **batch,
                    }
                )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        f"Per device: bf16 weights, and the largest batch whose weights and KV state fit "
        f"{SHARE:.0%} of {CARD_GB} GB (an H200). Computed by benchmarks/scaling_table.py.",
        "",
        "| model | H200s | hosts | weights GB | cache | MB per 1k tokens per row | rows at 4k "
        "| rows at 32k |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fits = r["weights_gb"] < SHARE * CARD_GB
        cells = [
            r["model"],
            str(r["devices"]),
            str(r["hosts"]),
            f"{r['weights_gb']:.1f}",
            r["kv"],
            f"{r['cache_mb_per_1k_tokens_row']:.1f}",
            str(r["max_batch_4k"]) if fits else "weights do not fit",
            str(r["max_batch_32k"]) if fits else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write scaling_table.json and .md")
    args = p.parse_args(argv)
    rows = table()
    text = markdown(rows)
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scaling_table.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / "scaling_table.md").write_text(text)


if __name__ == "__main__":
    main()
