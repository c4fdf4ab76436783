"""How a decode step should hold its layers: what XLA copies when weights and caches are stacked.

The evidence behind the model's layout (one buffer per layer's weights and cache, the layers
unrolled: models/llama.py). On one GPU, each variant runs STEPS decode-like steps of L layers
inside one jit, timed from a CUPTI trace (GPU time per step) with the kernels of a step summed
by name, so that copies show up as `memcpy*` or `*dynamic_slice*` kernels:

- weights (7B widths, batch 16, the seven matmuls of a block): `lax.scan` over stacked weights
  (with XLA's default, with dynamic-slice fusion asked for through compiler options, with
  cuBLAS instead of XLA's Triton matmuls, with the memcpy rewriter disabled), the layers
  unrolled over separate weights (Triton matmuls, cuBLAS), and a scan that picks each layer's
  separate weights with `lax.switch`;
- the full cache (batch 16, 2176 tokens, 32 heads): cuDNN attention on one layer, and inside a
  scan over a stacked [L, B, T, H, D] cache (default, dynamic-slice fusion);
- the KIVI-2 cache: the fused kernels inside a scan over a stacked cache, and unrolled over
  1 and 4 layers read at static indices (XLA compiles the kernels once however many layers
  call them: the compile times).

    python benchmarks/layer_layout.py --out DIR [--only NAME ...]

writes DIR/layer_layout.json and .md.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

import kivi_jax

sys.path.insert(0, str(Path(__file__).parent))
from timing import kernel_totals, traced_by_entry

DSF = {"xla_gpu_enable_dynamic_slice_fusion": True}
CUBLAS = {"xla_gpu_enable_triton_gemm": False}
NO_MEMCPY = {"xla_disable_hlo_passes": "fusion-dynamic-memcpy-rewriter"}
L, D_MODEL, D_MLP, B, STEPS = 4, 4096, 11008, 16, 4
T, H, HEAD = 2176, 32, 128  # the full and KIVI caches: tokens, heads, head_dim
KEY = jax.random.key(0)


def measure(fn, args, steps: int) -> dict:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    per = traced_by_entry({0: (fn, args)}, rounds=3).get(0)
    if not per:
        return {"compile_s": compile_s, "error": "no GPU trace"}
    run = per[-1]
    span = (max(e[2] for e in run) - min(e[1] for e in run)) * 1e-9
    top = list(kernel_totals(run).items())[:10]
    return {
        "step_ms": span / steps * 1e3,
        "compile_s": compile_s,
        "kernels_per_step": len(run) / steps,
        "top": [(n[:70], c / steps, t / steps * 1e3) for n, (c, t) in top],
    }


# ------------------------------------------------------------------------------- weights


def _weights():
    shapes = {"wq": (D_MODEL, D_MODEL), "wk": (D_MODEL, D_MODEL), "wv": (D_MODEL, D_MODEL),
              "wo": (D_MODEL, D_MODEL), "wg": (D_MODEL, D_MLP), "wu": (D_MODEL, D_MLP),
              "wd": (D_MLP, D_MODEL)}  # fmt: skip

    def mk(shape, i):
        x = jax.random.normal(jax.random.fold_in(KEY, i), shape, jnp.float32)
        return (x / shape[0] ** 0.5).astype(jnp.bfloat16)

    layers = [{n: mk(s, 100 * i + j) for j, (n, s) in enumerate(shapes.items())} for i in range(L)]
    return layers, {n: jnp.stack([lw[n] for lw in layers]) for n in shapes}


def _norm(x):
    xf = x.astype(jnp.float32)
    return (xf * lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5)).astype(x.dtype)


def _block(x, w):
    x = _norm(x)
    x = x + (x @ w["wq"] + x @ w["wk"] + x @ w["wv"]) @ w["wo"]
    y = _norm(x)
    return x + (jax.nn.silu(y @ w["wg"]) * (y @ w["wu"])) @ w["wd"]


def _steps(model):
    return lambda x, w: lax.fori_loop(0, STEPS, lambda _, x: model(x, w), x)


def _scan(x, stacked):
    return lax.scan(lambda x, lw: (_block(x, lw), None), x, stacked)[0]


def _unrolled(x, layers):
    for lw in layers:
        x = _block(x, lw)
    return x


def _switch(x, layers):
    branches = [functools.partial(lambda x, lw: _block(x, lw), lw=lw) for lw in layers]
    return lax.scan(lambda x, i: (lax.switch(i, branches, x), None), x, jnp.arange(L))[0]


def weight_variants():
    layers, stacked = _weights()
    x = jax.random.normal(KEY, (B, D_MODEL), jnp.bfloat16)
    jit = lambda f, opts=None: jax.jit(_steps(f), compiler_options=opts)
    return {
        "w_scan": (jit(_scan), (x, stacked)),
        "w_scan_dsf": (jit(_scan, DSF), (x, stacked)),
        "w_scan_cublas": (jit(_scan, CUBLAS), (x, stacked)),
        "w_scan_cublas_dsf": (jit(_scan, {**DSF, **CUBLAS}), (x, stacked)),
        "w_scan_nomemcpy": (jit(_scan, NO_MEMCPY), (x, stacked)),
        "w_unrolled": (jit(_unrolled), (x, layers)),
        "w_unrolled_cublas": (jit(_unrolled, CUBLAS), (x, layers)),
        "w_switch": (jit(_switch), (x, layers)),
    }


# ------------------------------------------------------------------------------- caches


def _cudnn(q, k, v, lens):
    o = jax.nn.dot_product_attention(
        q[:, None], k, v, key_value_seq_lengths=lens, implementation="cudnn"
    )
    return o[:, 0]


def _full_scan(q, kc, vc, lens):
    def body(carry, i):
        q, kc, vc = carry
        new = q[None, :, None].astype(kc.dtype)
        kc = lax.dynamic_update_slice(kc, new, (i, 0, 2099, 0, 0))
        vc = lax.dynamic_update_slice(vc, new, (i, 0, 2099, 0, 0))
        return (_cudnn(q, kc[i], vc[i], lens), kc, vc), None

    loop = lambda c: lax.scan(body, c, jnp.arange(L))[0]
    return lax.fori_loop(0, STEPS, lambda _, c: loop(c), (q, kc, vc))


def cache_variants():
    q = jax.random.normal(KEY, (B, H, HEAD), jnp.bfloat16)
    lens = jnp.full((B,), 2100, jnp.int32)
    kc = jax.random.normal(KEY, (L, B, T, H, HEAD), jnp.bfloat16)
    vc = jax.random.normal(jax.random.fold_in(KEY, 1), (L, B, T, H, HEAD), jnp.bfloat16)
    k8 = jax.random.normal(KEY, (B, T, 8, HEAD), jnp.bfloat16)
    kivi = _kivi_stacked()

    def kivi_scan(q, cache):
        def body(carry, i):
            q, cache = carry
            layer = jax.tree.map(lambda x: x[i], cache)
            return (kivi_jax.decode_attention(q, layer, impl="pallas"), cache), None

        loop = lambda c: lax.scan(body, c, jnp.arange(L))[0]
        return lax.fori_loop(0, STEPS, lambda _, c: loop(c), (q, cache))

    def kivi_unrolled(n):
        def f(q, cache):
            def one(q):
                for i in range(n):
                    layer = jax.tree.map(lambda x, i=i: x[i], cache)
                    q = kivi_jax.decode_attention(q, layer, impl="pallas")
                return q

            return lax.fori_loop(0, STEPS, lambda _, q: one(q), q)

        return f

    return {
        "cudnn_one_layer": (jax.jit(_cudnn), (q, kc[0], vc[0], lens), 1),
        "cudnn_gqa_one_layer": (jax.jit(_cudnn), (q, k8, k8, lens), 1),
        "cudnn_scan": (jax.jit(_full_scan), (q, kc, vc, lens), STEPS),
        "cudnn_scan_dsf": (jax.jit(_full_scan, compiler_options=DSF), (q, kc, vc, lens), STEPS),
        "kivi_scan": (jax.jit(kivi_scan), (q, kivi), STEPS),
        "kivi_scan_dsf": (jax.jit(kivi_scan, compiler_options=DSF), (q, kivi), STEPS),
        "kivi_unrolled1": (jax.jit(kivi_unrolled(1)), (q, kivi), STEPS),
        "kivi_unrolled4": (jax.jit(kivi_unrolled(4)), (q, kivi), STEPS),
    }


def _kivi_stacked():
    """L KIVI-2 layers of 2100 random tokens each, stacked on a leading axis."""
    kk = jax.random.normal(KEY, (B, 2100, H, HEAD), jnp.bfloat16)
    one = kivi_jax.init_cache(
        kivi_jax.KIVI2, batch=B, max_len=T, num_kv_heads=H, head_dim=HEAD, dtype=jnp.bfloat16
    )
    one = kivi_jax.prefill(one, kk, kk)
    return jax.tree.map(lambda x: jnp.stack([x] * L), one)


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# Layer layout of a decode step (`benchmarks/layer_layout.py`)",
        "",
        f"{result['device']}, jax {result['jax']}; {L} layers, {STEPS} steps per jit, GPU time "
        "per step; the largest kernels of a step (ms, launches per step).",
        "",
        "| variant | step ms | compile s | kernels per step | largest kernels | call |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["variants"].items():
        if "step_ms" not in r:
            lines.append(f"| {name} | {r.get('error', '')} | | | | {r['call']} |")
            continue
        top = "; ".join(f"{n[:40]} {t:.3f} (x{c:.0f})" for n, c, t in r["top"][:4])
        lines.append(
            f"| {name} | {r['step_ms']:.3f} | {r['compile_s']:.1f} | {r['kernels_per_step']:.0f} "
            f"| {top} | {r['call']} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", nargs="*", help="variant names (default: all)")
    p.add_argument("--call", default="run", help="name of this device call")
    args = p.parse_args(argv)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "variants": {}}
    for variants, steps in ((weight_variants, STEPS), (cache_variants, None)):
        for name, entry in variants().items():
            if args.only and name not in args.only:
                continue
            fn, fargs, *n = entry
            rec = measure(fn, fargs, n[0] if n else steps)
            result["variants"][name] = {**rec, "call": args.call}
            print(name, rec.get("step_ms"), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "layer_layout.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, args.out / "layer_layout.md")


if __name__ == "__main__":
    main()
