"""Twelfth round: the kernels' loops pipelined by Triton (cp.async into shared memory) against
main's register prefetch, in one process (Llama-2-7B heads, 8 x 32k, 2 calls per jit,
15 interleaved rounds, GPU time; each kernel's share from a second trace).

    source benchmarks/stage_package.sh   # the shell is then in /tmp/pk
    python3 DIR/stages_ab.py OUT '{"4": [[2, 2], [3, 3]], "2": [[3, 3]]}'

Each [score, value] pair: GpuTuning(prefetch=0) (plain loops: each iteration loads and
computes its own tile) with the score and value kernels' loops marked `tt.num_stages` through
`loop_stages.py` (private jax API). Every entry's output is compared with main's.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
sys.path.insert(0, str(Path(__file__).parent))
import attention as bench
import jax
import loop_stages
import numpy as np
from kivi_jax.pallas_kernels.decode_attention import GpuTuning

sys.path.insert(0, str(Path(__file__).parent.parent / "eleventh_round"))
from ab import setup, time_and_report

out = Path(sys.argv[1])
plan = json.loads(sys.argv[2])
calls, rounds = 2, 15
s, key, qs, runs = setup(calls)
diffs, failed = {}, {}
for bits, pairs in plan.items():
    bits = int(bits)
    st = bench.kivi_states(key, s, bits)
    loop_stages.STAGES.clear()  # main unmarked (run 2 built main2 with the 4/4 marks left set)
    fn = bench._many_calls(bench.kivi_step(bits, GpuTuning()), qs, st)
    ref = np.asarray(jax.block_until_ready(fn(qs, st)), np.float32)
    runs[f"main{bits}"] = (fn, (qs, st))
    for i, (sc, va) in enumerate(pairs):
        name = f"stages{bits} {sc}/{va}"
        loop_stages.STAGES.clear()
        loop_stages.STAGES.update({"kivi_scores": sc, "kivi_values": va})
        # prefetch 0: the prototype's plain loops; an unused field forces a new build
        tuning = GpuTuning(prefetch=0, query_program_groups=2 ** (i + 1))
        try:
            fn = bench._many_calls(bench.kivi_step(bits, tuning), qs, st)
            o = np.asarray(jax.block_until_ready(fn(qs, st)), np.float32)
        except Exception as e:
            failed[name] = repr(e)[:500]
            print(name, "failed:", failed[name], flush=True)
            continue
        diffs[name] = float(np.max(np.abs(o - ref)))
        runs[name] = (fn, (qs, st))
loop_stages.STAGES.clear()
print("marked:", loop_stages.LOG, "max |out - main|:", diffs, flush=True)
meta = {"plan": plan, "marked": loop_stages.LOG, "max_abs_diff_vs_main": diffs, "failed": failed}
time_and_report(runs, out, "stages_ab", calls=calls, rounds=rounds, meta=meta)
