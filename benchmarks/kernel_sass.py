"""SASS of the fused decode kernel, built without a GPU: instructions per value in its hot loop.

jax lowers the Pallas kernel to Triton IR (lowering for "cuda" works on a CPU-only jaxlib);
Triton's own compiler (`pip install triton`, which ships ptxas and cuobjdump) turns that IR into
sm_90a machine code. The script counts the instructions of the fast-path loop (the first loop
with a backward branch), divides by the key and value elements each thread handles per
iteration, and reports registers and spills (ptxas -v).

    python benchmarks/kernel_sass.py --out benchmarks/results/sass.md

Uses a private jax hook (`lower_jaxpr_to_triton_module`) to capture the Triton module; the
Triton version here need not match the one inside jaxlib, so treat counts as close estimates of
what XLA builds on the GPU (the H200 timings in attention.md are the measurements).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import re
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from kivi_jax.pallas_kernels.decode_attention import GpuTuning, kivi_decode_attention_gpu

CONFIGS = [  # the variants timed on the H200 (benchmarks/results/attention*.md)
    GpuTuning(tile="group", n_groups=2),
    GpuTuning(tile="group", n_groups=2, k_mode="dequant", v_mode="dequant"),
    GpuTuning(tile="block", n_groups=1, num_warps=4),
    GpuTuning(tile="block", n_groups=2, num_warps=8),
    GpuTuning(tile="block", n_groups=4, num_warps=8),
]


def triton_ir(tuning: GpuTuning, *, B=8, H=32, n_rep=1, D=128, C=32768, R=128, G=32, bits=2):
    """The kernel's Triton module as text, captured during lowering for CUDA."""
    from jax._src.pallas.triton import lowering, pallas_call_registration

    captured = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result)
        return result

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
        tuning=tuning,
    )  # fmt: skip
    lowering.lower_jaxpr_to_triton_module = capture
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = original
    return str(captured[-1].module)


def hot_loop(sass: str) -> collections.Counter:
    """Opcode counts of the first loop (a backward branch) in cuobjdump output."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    for addr, text in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            start, end = int(m.group(1), 16), addr
            break
    else:
        raise ValueError("no loop found")
    ops = collections.Counter()
    for addr, text in ins:
        if start <= addr <= end:
            ops[re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]] += 1
    return ops


def analyse(tuning: GpuTuning, workdir: Path) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    src = workdir / "kernel.ttir"
    src.write_text(triton_ir(tuning))
    k = triton.compile(
        str(src), target=GPUTarget("cuda", 90, 32),
        options={"num_warps": tuning.num_warps, "num_stages": tuning.num_stages},
    )  # fmt: skip
    ptx = workdir / "kernel.ptx"
    ptx.write_text(k.asm["ptx"])
    cubin = workdir / "kernel.cubin"
    info = subprocess.run(
        [bindir / "ptxas", "-arch=sm_90a", "-v", ptx, "-o", cubin],
        capture_output=True, text=True, check=True,
    ).stderr  # fmt: skip
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = re.search(r"(\d+) bytes spill stores", info)
    sass = subprocess.run(
        [bindir / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True
    ).stdout
    ops = hot_loop(sass)
    n = sum(ops.values())
    # Elements (keys + values) one thread handles per iteration (Llama-2-7B heads, D = 128).
    per_thread = (tuning.n_groups * 32) * 128 * 2 / (tuning.num_warps * 32)
    return {
        "tuning": dataclasses.asdict(tuning),
        "registers": regs,
        "spill_bytes": int(spill.group(1)) if spill else 0,
        "loop_instructions": n,
        "per_value": n / per_thread,
        "barriers": ops["BAR"],
        "shared_ld_st": ops["LDS"] + ops["STS"],
        "top": ops.most_common(12),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sass.md"))
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for t in CONFIGS:
            r = analyse(t, Path(tmp))
            rows.append(r)
            print(r, flush=True)
    lines = [
        "# Fast-path loop of the KIVI decode kernel in SASS (sm_90a; KIVI-2, D=128, bf16)",
        "",
        "Built by benchmarks/kernel_sass.py (jax lowering -> Triton -> ptxas, no GPU needed).",
        "per value = loop instructions / (key + value elements one thread handles per iteration).",
        "",
        "| tile | k / v mode | n_groups | warps | regs | spill B | loop instr | per value "
        "| BAR | LDS+STS | most frequent |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        t = r["tuning"]
        modes = f"{t['k_mode']} / {t['v_mode']}" if t["tile"] == "group" else "-"
        top = ", ".join(f"{op} {c}" for op, c in r["top"][:8])
        lines.append(
            f"| {t['tile']} | {modes} | {t['n_groups']} | {t['num_warps']} | {r['registers']} | "
            f"{r['spill_bytes']} | {r['loop_instructions']} | {r['per_value']:.1f} | "
            f"{r['barriers']} | {r['shared_ld_st']} | {top} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
