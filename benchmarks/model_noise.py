"""How far apart two valid runs of the model's decode steps land: the yardstick for
tests/test_generate_gpu.py's tolerance (GPU).

The GPU test feeds the tiny random-weight Llama of the tests 140 teacher-forced decode steps and
compares the logits of the kernel path with those of the reference path by
max |a - b| / max |b|. In bfloat16 a random-weight model amplifies any rounding difference, so
this script measures the same number for pairs that differ only in rounding: the reference on
the CPU against the reference on the GPU, and the kernels against the reference on the GPU.

    python benchmarks/model_noise.py --out benchmarks/results

writes model_noise.json and model_noise.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from kivi_jax.models import llama
from kivi_jax.pallas_kernels.decode_attention import GpuTuning, decode_attention_pallas

import kivi_jax

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import tiny_model  # the tests' random-weight model and their teacher-forced decode loop

STEPS, MAX_LEN = 140, 512  # as in tests/test_generate_gpu.py
TUNINGS = {"default tuning": GpuTuning()}


def teacher_forced_logits(params, kv: str, attend) -> jax.Array:
    """The GPU test's logits [STEPS, B, V], attention by `attend(q, cache)`."""
    llama.decode_attention = attend  # read by decode_step when it is traced
    return tiny_model.teacher_forced_logits(params, kv, steps=STEPS, max_len=MAX_LEN)


def compare(a, b) -> dict:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return {
        "rel_max_err": float(np.max(np.abs(a - b)) / np.max(np.abs(b))),
        "argmax_agree": float(np.mean(np.argmax(a, -1) == np.argmax(b, -1))),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
    reference = functools.partial(kivi_jax.decode_attention, impl="reference")
    rows = []
    for kv in ("kivi2", "kivi4"):
        params = tiny_model.tiny_params(dtype=jnp.bfloat16, head_dim=64, max_context=MAX_LEN)
        ref = teacher_forced_logits(params, kv, reference)
        with jax.default_device(cpu):
            ref_cpu = teacher_forced_logits(jax.device_put(params, cpu), kv, reference)
        rows.append({"kv": kv, "pair": "reference CPU vs reference GPU", **compare(ref_cpu, ref)})
        for name, tuning in TUNINGS.items():
            kernel = functools.partial(decode_attention_pallas, tuning=tuning)
            out = teacher_forced_logits(params, kv, kernel)
            rows.append({"kv": kv, "pair": f"kernels ({name}) vs reference GPU",
                         "tuning": dataclasses.asdict(tuning), **compare(out, ref)})  # fmt: skip
        for r in rows[-3:]:
            print(r, flush=True)
    result = {"device": gpu.device_kind, "jax": jax.__version__, "rows": rows}
    (args.out / "model_noise.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Logit differences of 140 teacher-forced decode steps ({gpu.device_kind}, "
        f"jax {jax.__version__})",
        "",
        "Tiny random-weight Llama of the tests (bf16, head_dim 64, 2 sequences); "
        "max |a - b| / max |b| over all logits, and how often the argmax agrees.",
        "",
        "| cache | pair | rel. max error | argmax agreement |",
        "|---|---|---:|---:|",
        *(
            f"| {r['kv']} | {r['pair']} | {r['rel_max_err']:.4f} | {r['argmax_agree']:.4f} |"
            for r in rows
        ),
    ]
    (args.out / "model_noise.md").write_text("\n".join(lines) + "\n")
    print((args.out / "model_noise.md").read_text())


if __name__ == "__main__":
    main()
