"""Eleventh round's same-process A/B (run 2): main's kernels against a branch's, and cuDNN.

Llama-2-7B heads, 8 x 32k, 2 calls per jit, 15 interleaved rounds (attention.py's timing:
GPU time from a CUPTI trace, each kernel's share from a second trace). The branch's
`gpu.py` is the package's; main's is staged beside it as `gpu_main.py`. From the branch's
checkout (stage_package.sh leaves the shell in /tmp/pk, where `benchmarks/` must be):

    git show main:benchmarks/results/eleventh_round/ab.py > /tmp/ab.py
    git show 9951959:pallas_kernels/decode_attention/gpu.py > /tmp/gpu_main.py
    source benchmarks/stage_package.sh
    cp /tmp/gpu_main.py kivi_jax/pallas_kernels/decode_attention/gpu_main.py
    python3 /tmp/ab.py OUT_DIR '{"f32": {"half_logits": false}}'

writes OUT_DIR/ab.json and ab.md. Extra entries: the branch's kernels under other GpuTuning
fields (JSON: name -> fields). `time_and_report` (the timing and the files) also serves
`regcap.py`; it was moved into a function of its own after both runs (not re-run).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
import attention as bench
import jax


def step_of(mod, bits, fields):
    def step(q, state):
        return mod.kivi_decode_attention_gpu(
            q, **state, k_bits=bits, v_bits=bits, group_size=32, residual_length=128,
            tuning=mod.GpuTuning(**fields),
        )  # fmt: skip

    return step


def setup(calls: int):
    """Llama-2-7B heads at 8 x 32k: (shape, key, stacked queries for `calls` calls, and the
    runs dict holding the cuDNN entry, already compiled)."""
    s = next(x for x in bench.SHAPES if x.name == "Llama-2-7B 8x32k")
    key = jax.random.key(1)
    qs = bench._queries(key, s, calls)
    bf = bench.bf16_states(key, s)
    runs = {"cudnn": (bench._many_calls(bench.cudnn_step, qs, bf), (qs, bf))}
    jax.block_until_ready(runs["cudnn"][0](qs, bf))
    return s, key, qs, runs


def time_and_report(runs: dict, out: Path, stem: str, *, calls: int, rounds: int, meta: dict):
    """Times `runs` (name -> (fn, args); one entry "cudnn") interleaved, with each kernel's
    share of a step, and writes OUT/STEM.json (`meta` beside the entries) and STEM.md."""
    timed, timing = bench.interleaved(runs, rounds=rounds)
    split = bench.kernel_split(runs, rounds=rounds)
    res = {"device": str(jax.devices()[0]), "jax": jax.__version__, "timing": timing,
           "calls": calls, "rounds": rounds, **meta, "entries": {}}  # fmt: skip
    for k in runs:
        v = timed[k]
        e = {"us": v / calls * 1e6 if isinstance(v, float) else str(v)}
        e.update({c: x / calls * 1e6 for c, x in split.get(k, {}).items()})
        res["entries"][k] = e
    cud = res["entries"]["cudnn"]["us"]
    lines = [
        f"cuDNN {cud:.1f} us ({timing} time)",
        "",
        "| entry | us | x cuDNN | score | value | other |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for k, e in res["entries"].items():
        cols = [e.get(f"{c}_us", 0) for c in ("score_kernel", "value_kernel", "other_kernels")]
        lines.append(f"| {k} | {e['us']:.1f} | {cud / e['us']:.3f} | "
                     + " | ".join(f"{x:.1f}" for x in cols) + " |")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(out: Path, variants: dict) -> None:
    from kivi_jax.pallas_kernels.decode_attention import gpu as new
    from kivi_jax.pallas_kernels.decode_attention import gpu_main as old

    calls, rounds = 2, 15
    s, key, qs, runs = setup(calls)
    for bits in (4, 2):
        st = bench.kivi_states(key, s, bits)
        entries = {"main": (old, {}), "new": (new, {})}
        entries |= {name: (new, fields) for name, fields in variants.items()}
        for name, (mod, fields) in entries.items():
            fn = bench._many_calls(step_of(mod, bits, fields), qs, st)
            runs[f"{name}{bits}"] = (fn, (qs, st))
    time_and_report(runs, out, "ab", calls=calls, rounds=rounds, meta={"variants": variants})


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
