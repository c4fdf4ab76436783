"""Eleventh round, run 3: the score kernel built with a register cap, in one process.

    source benchmarks/stage_package.sh   # from main's checkout; the shell is then in /tmp/pk
    python3 benchmarks/results/eleventh_round/regcap.py OUT \
        '{"4": [null, 64, 72], "2": [null, 96, 80, 64]}'   # OUT relative to /tmp/pk

(the script that ran, with this docstring and ruff's formatting). It uses private jax API
(`jax._src.pallas.triton`, as in jax 0.10.2 and 0.11.2): it wraps Pallas-Triton's lowering so
that the score kernel's Triton module carries the `ttg.maxnreg` attribute (Triton turns it
into nvvm.maxnreg, i.e. PTX .maxnreg). Entries differ by an unused tuning field
(query_program_groups) so that each is lowered and compiled again. Its timing and files
now come from `ab.py`'s `time_and_report` (the same code, moved there after the run).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
import attention as bench
import jax
import numpy as np
from ab import setup, time_and_report  # beside this script
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering
from jax._src.pallas.triton import pallas_call_registration as reg
from kivi_jax.pallas_kernels.decode_attention import GpuTuning

out = Path(sys.argv[1])
plan = json.loads(sys.argv[2])  # {"4": [null, 64, 72], "2": [null, 96, 80, 64]}
CAP = {}  # "score" -> max registers per thread for the score kernel lowered next
LOG = []
orig = lowering.lower_jaxpr_to_triton_module


def capped(jaxpr, grid_mapping, *args, **kwargs):
    res = orig(jaxpr, grid_mapping, *args, **kwargs)
    # The score kernel is the one with two outputs (logits, program maxima; the value has 4).
    if "score" in CAP and sum(1 for _ in grid_mapping.block_mappings_output) == 2:
        with res.module.context:
            i32 = ir.IntegerType.get_signless(32)
            res.module.operation.attributes["ttg.maxnreg"] = ir.IntegerAttr.get(i32, CAP["score"])
        LOG.append(CAP["score"])
    return res


lowering.lower_jaxpr_to_triton_module = capped
reg.lowering.lower_jaxpr_to_triton_module = capped
calls, rounds = 2, 15
s, key, qs, runs = setup(calls)
same = {}
for bits, caps in plan.items():
    bits = int(bits)
    st = bench.kivi_states(key, s, bits)
    for i, cap in enumerate(caps):
        CAP.clear()
        if cap:
            CAP["score"] = cap
        tuning = GpuTuning(query_program_groups=2**i)  # unused by the default path
        fn = bench._many_calls(bench.kivi_step(bits, tuning), qs, st)
        o = np.asarray(jax.block_until_ready(fn(qs, st)), np.float32)  # compiled now
        if i == 0:
            ref = o
        same[f"kivi{bits} cap {cap}"] = bool(np.array_equal(o, ref))
        runs[f"kivi{bits} cap {cap}"] = (fn, (qs, st))
CAP.clear()
print("caps applied:", LOG, "same output:", same, flush=True)
meta = {"caps_applied": LOG, "same_output_as_uncapped": same}
time_and_report(runs, out, "regcap", calls=calls, rounds=rounds, meta=meta)
