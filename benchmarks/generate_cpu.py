"""End-to-end generation speed of the default model on this machine's CPU, full vs KIVI caches.

For each parameter dtype, weight format (--weights: float, or kivi_jax.weights' int8 / int4
re-quantization of the dequantized GGUF) and KV cache: a 2048-token prompt (real text, no chat
template), then 64 greedy tokens without EOS stopping, through the same jitted prefill and
decode step that `generate` fuses (kivi_jax.TokenStream, compile time kept apart). Reports load
time (GGUF and the orbax re-load), prefill and decode tokens/s, the KV-cache bytes allocated and
held, and the bytes a decode step reads (weights + allocated KV state) against the memory
bandwidth measured here.

    python benchmarks/generate_cpu.py [--out benchmarks/results] [--prompt-tokens 2048]
        [--dtypes float32,bfloat16] [--weights float,int8,int4] [--kvs full,kivi2]

Rows are added to the results file: a row measured again (dtype, weights, kv) replaces the
earlier one, each row with the bandwidth measured in its own run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from kivi_jax.models.llama import param_bytes

import kivi_jax
from kivi_jax.generate import TokenStream, resolve_kv

HERE = pathlib.Path(__file__).resolve().parent
# Published on this machine in the issue (2 threads, 2k prompt), for context.
BASELINES = {
    "llama.cpp (Q4_1 weights, 2 threads)": {"prefill_tok_s": 145.0, "decode_tok_s": 42.5},
    "HF transformers (float32)": {"prefill_tok_s": 258.0, "decode_tok_s": 7.6},
}


def measured_bandwidth_gb_s(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best-of read bandwidth of an XLA reduction over an n_bytes float32 array."""
    x = jnp.ones(n_bytes // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return n_bytes / best / 1e9


def prompt_ids(tokenizer, n: int) -> np.ndarray:
    sys.path.insert(0, str(HERE.parent / "tests" / "fixtures"))
    from make_hf_reference import TEXT

    ids = tokenizer.encode(TEXT)
    return np.resize(np.asarray(ids, np.int32), n)  # the text repeated up to n tokens


def time_load(dtype, weights: str) -> tuple[kivi_jax.Model, dict]:
    t = time.perf_counter()
    model = kivi_jax.load_model(dtype=dtype, weights=weights)
    jax.block_until_ready(model.params)
    gguf_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        kivi_jax.save_model(model, os.path.join(tmp, "saved"))
        t = time.perf_counter()
        again = kivi_jax.load_model(os.path.join(tmp, "saved"), dtype=dtype)
        jax.block_until_ready(again.params)
        orbax_s = time.perf_counter() - t
    return model, {"gguf_load_s": round(gguf_s, 2), "orbax_reload_s": round(orbax_s, 2)}


def run(model, ids, kv: str, new_tokens: int, bandwidth: float, weights: str) -> dict:
    stream = TokenStream(model.params, ids[None], kv=kv, max_new_tokens=new_tokens)
    for _ in stream:
        pass
    s = stream.stats
    c = model.config
    held = kivi_jax.held_bits(
        resolve_kv(kv), length=len(ids), head_dim=c.head_dim, dtype=model.params.dtype
    )
    # bits of one KV head of one sequence -> all layers and KV heads, in bytes
    held_bytes = held.total_bits * c.num_layers * c.num_kv_heads // 8
    step_s = s.decode_s / (s.generated_tokens - 1)
    step_bytes = param_bytes(model.params) + s.kv_bytes
    return {
        "kv": kv,
        "dtype": jnp.dtype(model.params.dtype).name,
        "weights": weights,
        "bandwidth_gb_s": round(bandwidth, 2),
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "compile_s": round(s.compile_s, 2),
        "prefill_s": round(s.prefill_s, 3),
        "prefill_tok_s": round(s.prefill_tokens_per_s, 1),
        "decode_ms_per_token": round(1000 * step_s, 1),
        "decode_tok_s": round(s.decode_tokens_per_s, 2),
        "kv_bytes_allocated": s.kv_bytes,
        "kv_bytes_full_precision_same_capacity": s.kv_full_bytes,
        "kv_bytes_held_at_prompt": held_bytes,
        "kv_bits_per_value_held": round(held.bits_per_value, 2),
        "decode_bytes_read_per_step": step_bytes,
        "decode_gb_s": round(step_bytes / step_s / 1e9, 2),
        "decode_pct_of_measured_bandwidth": round(100 * step_bytes / step_s / 1e9 / bandwidth, 1),
    }


def markdown(result: dict) -> str:
    h = result["hardware"]
    lines = [
        f"# Generation on CPU: {result['model']}",
        "",
        f"{h['cpu']}, {h['cores']} cores, jax {h['jax']} ({h['backend']}); measured read "
        f"bandwidth {h['bandwidth_gb_s']} GB/s in the latest run (XLA sum over 1 GiB; a row of "
        "an earlier run keeps its own, in the JSON, and its % below is of that). Batch 1, "
        f"{result['prompt_tokens']}-token prompt, {result['new_tokens']} greedy tokens.",
        "",
        "| dtype, weights | load GGUF (s) | re-load saved (orbax, s) |",
        "|---|---|---|",
    ]
    for dtype, load in result["load"].items():
        lines.append(f"| {dtype} | {load['gguf_load_s']} | {load['orbax_reload_s']} |")
    lines += [
        "",
        "| dtype | weights | kv | prefill tok/s | decode tok/s | ms/token | KV MiB allocated "
        "(full: same capacity) | KV MiB held at 2k | bits/value held | decode GB/s (% of "
        "measured) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = lambda b: f"{b / 2**20:.2f}"
    for r in result["runs"]:
        lines.append(
            f"| {r['dtype']} | {r.get('weights', 'float')} | {r['kv']} | {r['prefill_tok_s']} "
            f"| {r['decode_tok_s']} | "
            f"{r['decode_ms_per_token']} | {mib(r['kv_bytes_allocated'])} "
            f"({mib(r['kv_bytes_full_precision_same_capacity'])}) | "
            f"{mib(r['kv_bytes_held_at_prompt'])} | {r['kv_bits_per_value_held']} | "
            f"{r['decode_gb_s']} ({r['decode_pct_of_measured_bandwidth']}%) |"
        )
    lines += ["", "Context on this machine (from the issue, 2k prompt):", ""]
    for name, b in BASELINES.items():
        speeds = f"prefill {b['prefill_tok_s']} tok/s, decode {b['decode_tok_s']} tok/s"
        lines.append(f"- {name}: {speeds}")
    lines += [
        "",
        "Decode GB/s counts the weights (int4 as half a byte) plus the whole allocated KV "
        "state once per token. With int8 / int4 weights XLA's CPU backend dequantizes each "
        "matrix into float32 scratch every step (it does not fuse converts into dots; "
        "docs/weights.md), so on CPU they save memory, not time. "
        "KIVI decode attention here is the plain-jnp reference (it dequantizes the state to "
        "float32 every step), so on CPU KIVI saves memory, not time; the fused Pallas kernels "
        "target GPUs. XLA's CPU bfloat16 matmuls are slower than float32 ones, hence the "
        "CLI's float32 default on CPU.",
        "",
    ]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kvs", default="full,kivi2")
    parser.add_argument("--weights", default="float", help="comma-separated: float,int8,int4")
    args = parser.parse_args()

    bandwidth = measured_bandwidth_gb_s()
    result = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "hardware": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "backend": jax.default_backend(),
            "jax": jax.__version__,
            "bandwidth_gb_s": round(bandwidth, 2),
        },
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "load": {},
        "runs": [],
        "baselines": BASELINES,
    }
    for dtype in args.dtypes.split(","):
        for weights in args.weights.split(","):
            model, load = time_load(getattr(jnp, dtype), weights)
            result["load"][dtype if weights == "float" else f"{dtype}, {weights}"] = load
            print(dtype, weights, load, flush=True)
            ids = prompt_ids(model.tokenizer, args.prompt_tokens)
            for kv in args.kvs.split(","):
                r = run(model, ids, kv, args.new_tokens, bandwidth, weights)
                result["runs"].append(r)
                print(json.dumps(r), flush=True)
            del model
    earlier = args.out / "generate_cpu.json"
    if earlier.exists():  # rows not measured again stay
        before = json.loads(earlier.read_text())
        key = lambda r: (r["dtype"], r.get("weights", "float"), r["kv"])
        measured = {key(r) for r in result["runs"]}
        kept = [r for r in before["runs"] if key(r) not in measured]
        result["runs"] = sorted(kept + result["runs"], key=key)
        result["load"] = before["load"] | result["load"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generate_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "generate_cpu.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
