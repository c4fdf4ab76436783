"""SASS of the two decode kernels, built without a GPU: instructions per code in their loops.

jax lowers each Pallas kernel to Triton IR (lowering for "cuda" works on a CPU-only jaxlib);
Triton's own compiler (`pip install triton`, which ships ptxas and cuobjdump) turns that IR into
sm_90a machine code. The script counts the instructions of each kernel's main loop (the first
loop with a backward branch), divides by the codes one thread handles per iteration, and
reports registers and spills (ptxas -v).

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
from kivi_jax.pallas_kernels.decode_attention.gpu import tile_sizes

PREVIOUS = GpuTuning(score_groups=4, score_warps=4, value_rows=128, value_subtiles=1, prefetch=1)
CONFIGS = [  # (tuning, bits, n_rep): the default and the previous default (timed on the H200)
    (GpuTuning(), 2, 1),
    (GpuTuning(), 4, 1),
    (GpuTuning(), 2, 4),
    (PREVIOUS, 2, 1),
    (PREVIOUS, 4, 1),
    (PREVIOUS, 2, 4),
]


def triton_ir(tuning: GpuTuning, *, B=8, H=32, n_rep=1, D=128, C=32768, R=128, G=32, bits=2):
    """The two kernels' Triton modules as text (score kernel, value kernel), captured during
    lowering for CUDA."""
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
    return [str(c.module) for c in captured[-2:]]


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


def compile_sass(ttir: str, num_warps: int, num_stages: int, workdir: Path) -> tuple[str, str]:
    """Triton IR -> (ptxas -v report, cuobjdump SASS) for sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    src = workdir / "kernel.ttir"
    src.write_text(ttir)
    k = triton.compile(
        str(src),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptx = workdir / "kernel.ptx"
    ptx.write_text(k.asm["ptx"])
    cubin = workdir / "kernel.cubin"
    info = subprocess.run(
        [bindir / "ptxas", "-arch=sm_90a", "-v", ptx, "-o", cubin],
        capture_output=True, text=True, check=True,
    ).stderr  # fmt: skip
    sass = subprocess.run(
        [bindir / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True
    ).stdout
    return info, sass


def analyse(
    tuning: GpuTuning, bits: int, n_rep: int, workdir: Path, *, D=128, G=32, C=32768
) -> list:
    """One record per kernel: registers, spills, loop instructions per code."""
    t = tile_sizes(tuning, capacity=C, group_size=G, n_rep=n_rep)
    # codes one thread handles per loop iteration (the loop body holds `prefetch` tiles)
    per_thread = {
        "score": t.score_groups * G * D * tuning.prefetch / (tuning.score_warps * 32),
        "value": t.value_rows * t.value_subtiles * D * tuning.prefetch / (tuning.value_warps * 32),
    }
    warps = {"score": tuning.score_warps, "value": tuning.value_warps}
    out = []
    modules = triton_ir(tuning, n_rep=n_rep, bits=bits, D=D, C=C, G=G)
    for name, ttir in zip(("score", "value"), modules, strict=True):
        info, sass = compile_sass(ttir, warps[name], tuning.num_stages, workdir)
        spill = re.search(r"(\d+) bytes spill stores", info)
        ops = hot_loop(sass)
        n = sum(ops.values())
        out.append({
            "kernel": name,
            "tuning": dataclasses.asdict(tuning),
            "bits": bits,
            "n_rep": n_rep,
            "registers": int(re.search(r"Used (\d+) registers", info).group(1)),
            "spill_bytes": int(spill.group(1)) if spill else 0,
            "loop_instructions": n,
            "per_code": n / per_thread[name],
            "barriers": ops["BAR"],
            "top": ops.most_common(10),
        })  # fmt: skip
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sass.md"))
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tuning, bits, n_rep in CONFIGS:
            for r in analyse(tuning, bits, n_rep, Path(tmp)):
                rows.append(r)
                print(r, flush=True)
    default = dataclasses.asdict(GpuTuning())
    lines = [
        "# Main loops of the two decode kernels in SASS (sm_90a; D=128, G=32, bf16)",
        "",
        "Built by benchmarks/kernel_sass.py (jax lowering -> Triton -> ptxas, no GPU needed).",
        "per code = loop instructions / (codes one thread handles per loop iteration; with GQA",
        "each code is used by n_rep query heads).",
        "",
        "| kernel | bits | n_rep | tuning | regs | spill B | loop instr | per code | BAR "
        "| most frequent |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        changed = {k: v for k, v in r["tuning"].items() if v != default[k]} or "default"
        top = ", ".join(f"{op} {c}" for op, c in r["top"][:8])
        lines.append(
            f"| {r['kernel']} | {r['bits']} | {r['n_rep']} | {changed} | {r['registers']} | "
            f"{r['spill_bytes']} | {r['loop_instructions']} | {r['per_code']:.2f} | "
            f"{r['barriers']} | {top} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
