"""Fingerprints of the Triton modules the default GPU decode kernels lower to, without a GPU.

jax lowers each Pallas kernel to a Triton module while lowering for "cuda" (this works on a
CPU-only jaxlib). The script lowers the default `GpuTuning()` kernels over a grid of
configurations that reaches every default branch (MHA and GQA, 2 and 4 bits, head_dim 64 and
128, a long-context batch and a short one, the tensor-core GQA kernels and, at group size 64,
their CUDA-core fallback), hashes each module's text (without locations) and writes the hashes,
or checks them against the committed file. Run it before and after a change that must not
change the kernels (a refactor, a tuning field turned into a constant):

    python scripts/triton_fingerprint.py            # check scripts/triton_fingerprint.json
    python scripts/triton_fingerprint.py --write    # record the current modules

The modules depend on jax's Pallas lowering, so the file names the jax version it was written
with; a check under another version says so and compares anyway.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from kivi_jax.pallas_kernels import triton_stages
from kivi_jax.pallas_kernels.decode_attention import (
    GpuTuning,
    kivi_decode_attention_gpu,
)

FILE = Path(__file__).with_suffix(".json")

# (batch, KV heads, query heads per KV head, head_dim, capacity, group size, bits)
CONFIGS = [
    (b, h, n_rep, d, c, 32, bits)
    for b, c in ((8, 32768), (1, 2176))
    for h, n_rep in ((32, 1), (8, 4))
    for d in (64, 128)
    for bits in (2, 4)
] + [(8, 8, 4, 128, 32768, 64, bits) for bits in (2, 4)]


def lowered_modules(fn, args) -> list[str]:
    """The Triton modules (text, no locations) of the Pallas kernels `fn(*args)` lowers to for
    CUDA, in launch order (no GPU needed)."""
    from jax._src.pallas.triton import lowering, pallas_call_registration

    triton_stages.install()  # first, so that the modules carry their loops' stages
    captured = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = original(*a, **kw)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = original
    return captured


def triton_modules(B, H, n_rep, D, C, G, bits, *, R=128, tuning=None) -> list[str]:
    """The Triton modules (text, no locations) of one decode step's kernels, in launch order,
    with `tuning` (default GpuTuning(); benchmarks/kernel_sass.py passes KernelTunings)."""
    per = 8 // bits
    dt, u8, sd = jnp.bfloat16, jnp.uint8, jax.ShapeDtypeStruct
    args = [
        sd((B, H * n_rep, D), dt),
        sd((B, H, C // per, D), u8),
        sd((B, H, C // G, D), dt),
        sd((B, H, C // G, D), dt),
        sd((B, H, C, D // per), u8),
        sd((B, H, C, D // G), dt),
        sd((B, H, C, D // G), dt),
        sd((B, H, R, D), dt),
        sd((B, H, R, D), dt),
        sd((B,), jnp.int32),
    ]
    f = functools.partial(
        kivi_decode_attention_gpu, k_bits=bits, v_bits=bits, group_size=G, residual_length=R,
        tuning=GpuTuning() if tuning is None else tuning,
    )  # fmt: skip
    return lowered_modules(f, args)


def fingerprints() -> dict[str, list[str]]:
    """{configuration: [sha256 of each module]}."""
    out = {}
    for cfg in CONFIGS:
        name = "B{} H{} n_rep{} D{} C{} G{} bits{}".format(*cfg)
        out[name] = [hashlib.sha256(m.encode()).hexdigest()[:16] for m in triton_modules(*cfg)]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"write {FILE.name} instead of checking")
    args = p.parse_args()
    got = {"jax": jax.__version__, "modules": fingerprints()}
    if args.write:
        FILE.write_text(json.dumps(got, indent=1) + "\n")
        print(f"wrote {FILE} ({sum(map(len, got['modules'].values()))} modules)")
        return 0
    want = json.loads(FILE.read_text())
    if want["jax"] != got["jax"]:
        print(f"note: {FILE.name} was written with jax {want['jax']}, this is {got['jax']}")
    differ = [k for k in want["modules"].keys() | got["modules"].keys()
              if want["modules"].get(k) != got["modules"].get(k)]  # fmt: skip
    for k in sorted(differ):
        print(f"differs: {k}")
    n = sum(map(len, got["modules"].values()))
    print(f"{n} modules, {len(differ)} configurations differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
