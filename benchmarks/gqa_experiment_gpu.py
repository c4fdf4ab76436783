"""GPU: the GQA kernel against the reference, then timed against cuDNN and the CUDA cores."""

import json
import os
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "tests")
import attention as A
from conftest import streamed_cache
from kivi_jax.pallas_kernels.decode_attention import (
    GpuTuning,
    gpu_gqa,
    kivi_decode_attention_gpu,
    state,
)
from timing import interleaved

import kivi_jax

out_dir = Path(os.environ.get("OUT", "/tmp/out"))
out_dir.mkdir(exist_ok=True, parents=True)
res = {"correct": [], "time": []}
rng = np.random.default_rng(0)
T0 = time.time()
if "correct" in sys.argv:
    for (kb, vb), D, n_rep, dt in [
        ((2, 2), 128, 4, jnp.bfloat16),
        ((4, 4), 128, 8, jnp.float16),
        ((2, 4), 64, 3, jnp.bfloat16),
        ((4, 2), 64, 2, jnp.float16),
        ((2, 2), 64, 8, jnp.float16),
        ((4, 4), 128, 4, jnp.bfloat16),
    ]:
        cfg = kivi_jax.KiviConfig(k_bits=kb, v_bits=vb, group_size=32, residual_length=128)
        cache = streamed_cache(
            rng,
            config=cfg,
            H=4,
            D=D,
            max_len=2100,
            prompts=[0, 1, 95, 1280, 2040, 1400],
            steps=7,
            dtype=dt,
        )
        q = jnp.asarray(rng.normal(size=(6, 4 * n_rep, D)).astype(np.float32), dt)
        arrays, conf = state.kernel_args(cache)
        try:
            o = gpu_gqa.kivi_decode_attention_gqa(q, *arrays, **conf)
            o_old = kivi_decode_attention_gpu(q, *arrays, **conf)
            ref = kivi_jax.decode_attention_reference(q.astype(jnp.float32), cache)
            e = float(np.abs(np.asarray(o, np.float32) - np.asarray(ref)).max())
            e_old = float(np.abs(np.asarray(o_old, np.float32) - np.asarray(ref)).max())
            r = dict(
                bits=[kb, vb],
                D=D,
                n_rep=n_rep,
                dtype=jnp.dtype(dt).name,
                err=e,
                err_cuda_core=e_old,
                finite=bool(np.isfinite(np.asarray(o, np.float32)).all()),
            )
        except Exception:
            r = dict(bits=[kb, vb], D=D, n_rep=n_rep, error=traceback.format_exc()[-2000:])
        print(r, flush=True)
        res["correct"].append(r)
shapes = [
    A.Shape(model="Llama-3-8B", q_heads=32, kv_heads=8, head_dim=128, batch=8, context=32768),
    A.Shape(model="Llama-3-8B", q_heads=32, kv_heads=8, head_dim=128, batch=1, context=131072),
    A.Shape(model="Llama-3-8B", q_heads=32, kv_heads=8, head_dim=128, batch=1, context=32768),
    A.Shape(model="Llama-3-70B", q_heads=64, kv_heads=8, head_dim=128, batch=8, context=32768),
    A.Shape(model="Llama-2-7B", q_heads=32, kv_heads=32, head_dim=128, batch=8, context=32768),
]
tunings = [json.loads(x) for x in os.environ.get("TUNINGS", "[{}]").split(";")]
calls = 2
for s in shapes[: int(os.environ.get("NSHAPES", 5))]:
    if time.time() - T0 > float(os.environ.get("DEADLINE", 420)):
        break
    key = jax.random.key(1)
    qs = A._queries(key, s, calls)
    runs = {}
    bf = A.bf16_states(key, s)
    runs["cudnn"] = (A._many_calls(A.cudnn_step, qs, bf), (qs, bf))
    for bits in (2, 4):
        st = A.kivi_states(key, s, bits)
        runs[f"kivi{bits}_cc"] = (A._many_calls(A.kivi_step(bits, GpuTuning()), qs, st), (qs, st))
        for i, t in enumerate(tunings):
            tun = gpu_gqa.GqaTuning(**t)

            def step(q, st_, bits=bits, tun=tun):
                return gpu_gqa.kivi_decode_attention_gqa(
                    q,
                    **st_,
                    k_bits=bits,
                    v_bits=bits,
                    group_size=32,
                    residual_length=128,
                    tuning=tun,
                )

            runs[f"kivi{bits}_gqa{i}"] = (A._many_calls(step, qs, st), (qs, st))
    times, timing = interleaved(runs, rounds=15)
    row = {
        "shape": s.name,
        "timing": timing,
        "us": {k: (v / calls * 1e6 if isinstance(v, float) else v) for k, v in times.items()},
        "bytes": {
            "bf16": A.bf16_bytes(s),
            "kivi2": A.kivi_bytes(s, 2),
            "kivi4": A.kivi_bytes(s, 4),
        },
    }
    print(json.dumps(row), flush=True)
    res["time"].append(row)
    del runs, bf, st
res["tunings"] = tunings
(out_dir / "gqa.json").write_text(json.dumps(res, indent=1))
