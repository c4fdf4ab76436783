"""Run each decode kernel once per shape and bit width, for Nsight Compute to profile.

Nsight Compute (``ncu``) reads the hardware counters of every kernel it is told to profile;
this script only provides the launches: for each shape and bit width it runs the score kernel
and the value kernel (on random logits) twice (the first launch compiles and warms up;
``kernel_profile_summary.py`` lists every launch, so the later of each pair is the warm one).

    bash benchmarks/kernel_profile.sh OUT_DIR

writes OUT_DIR/profile.ncu-rep, the details page as text and the raw metrics as CSV;
``kernel_profile_summary.py`` turns the CSV into a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
from kivi_jax.pallas_kernels.decode_attention import GpuTuning

sys.path.insert(0, str(Path(__file__).parent))
import attention as bench  # the random states and the kernels alone


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["Llama-2-7B 8x32k"])
    ap.add_argument("--bits", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--tuning", type=json.loads, default={}, help="GpuTuning fields as JSON")
    args = ap.parse_args(argv)
    shapes = {s.name: s for s in bench.SHAPES}
    tuning = GpuTuning(**args.tuning)
    key = jax.random.key(3)
    for name in args.shapes:
        s = shapes[name]
        for bits in args.bits:
            qs = bench._queries(key, s, 1)
            [state] = bench.kivi_states(key, s, bits)[:1]
            [logits] = bench.random_logits(key, s, 1, bits=bits, tuning=tuning, state=state)
            steps = bench.kernel_steps(bits, tuning, s.kv_heads)
            for column, step in steps.items():
                fn = jax.jit(step)
                fargs = (qs[0], (state, logits) if column in bench.LOGIT_KERNELS else state)
                for _ in range(2):
                    jax.block_until_ready(fn(*fargs))
            print(f"{name} KIVI-{bits}: ran {len(steps)} kernels twice each", flush=True)


if __name__ == "__main__":
    main()
