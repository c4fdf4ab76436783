"""SASS of the two decode kernels, built without a GPU: instructions per code in their loops.

jax lowers each Pallas kernel to Triton IR (lowering for "cuda" works on a CPU-only jaxlib);
Triton's own compiler (`pip install triton`, which ships ptxas and cuobjdump) turns that IR into
sm_90a machine code. The script counts the instructions of each kernel's main loop (of its
loops, the one with the most integer dot products), divides by the codes one thread handles
per iteration, and reports registers and spills (ptxas -v). The counts depend on the Triton
version (`docs/performance.md` names the one behind `benchmarks/results/sass.md`).

    python benchmarks/kernel_sass.py --out benchmarks/results/sass.md

Uses a private jax hook (`lower_jaxpr_to_triton_module`) to capture the Triton module; the
Triton version here need not match the one inside jaxlib, so treat counts as close estimates of
what XLA builds on the GPU (the H200 timings in attention.md are the measurements).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kivi_jax.pallas_kernels.decode_attention.gpu import (
    _NUM_STAGES,
    _NUM_WARPS,
    KernelTuning,
    gqa_value_tiles,
    score_tiles,
    value_tiles,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from triton_fingerprint import triton_modules

CONFIGS = [  # (tuning, bits, n_rep): the default and the score kernel's register prefetch,
    # both timed on the H200, with MHA; the default with GQA (the tensor-core kernels) at
    # Llama-3-8B's 4 query heads per KV head
    (KernelTuning(), 2, 1),
    (KernelTuning(), 4, 1),
    (KernelTuning(score_stages=1), 2, 1),
    (KernelTuning(score_stages=1), 4, 1),
    (KernelTuning(), 2, 4),
    (KernelTuning(), 4, 4),
]


def triton_ir(tuning: KernelTuning, *, B=8, H=32, n_rep=1, D=128, C=32768, R=128, G=32, bits=2):
    """{"score": ..., "value": ...}: the kernels' Triton modules as text, captured during
    lowering for CUDA (scripts/triton_fingerprint.py's capture)."""
    score, value = triton_modules(B, H, n_rep, D, C, G, bits, R=R, tuning=tuning)
    return {"score": score, "value": value}


def loops(sass: str) -> list[list[tuple[int, str]]]:
    """Each loop in cuobjdump output (a backward branch and what it jumps over) as its
    (address, instruction) pairs, predicates kept."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    out = []
    for addr, text in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            out.append([(a, t) for a, t in ins if start <= a <= addr])
    return out


def strip(loop: list[tuple[int, str]]) -> list[str]:
    """A loop's instructions with their predicates stripped."""
    return [re.sub(r"^@!?U?P\w+\s+", "", t) for _, t in loop]


def hot_loop(sass: str) -> list[str]:
    """The instructions (predicates stripped) of the main loop in cuobjdump output: of the
    loops (backward branches), the one with the most integer dot products or tensor-core
    mma (IDP, HMMA; the value kernels' loops over their tail share come first and have
    none)."""
    found = [strip(loop) for loop in loops(sass)]
    if not found:
        raise ValueError("no loop found")
    return max(found, key=lambda loop: (sum(opcode(t) in ("IDP", "HMMA") for t in loop), len(loop)))


def opcode(instruction: str) -> str:
    return instruction.split()[0].split(".")[0]


def load_span(loop: list[str]) -> tuple[int, int] | None:
    """Where the loop's global loads sit: (first, last) LDG as a percent of the loop body."""
    at = [i for i, t in enumerate(loop) if opcode(t) == "LDG"]
    return (round(100 * at[0] / len(loop)), round(100 * at[-1] / len(loop))) if at else None


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
    tuning: KernelTuning, bits: int, n_rep: int, workdir: Path, *, D=128, G=32, C=32768
) -> list:
    """One record per kernel: registers, spills, loop instructions per code."""
    program_groups, groups, _ = score_tiles(
        tuning, capacity=C, group_size=G, head_dim=D, k_bits=bits
    )
    programs = 8 * 32 * n_rep * -(-C // G // program_groups)  # triton_ir's B = 8, H = 32
    quads, chain = value_tiles(tuning, capacity=C, v_bits=bits)
    # codes one thread handles per loop iteration (the loop body holds `prefetch` tiles, one
    # where the score kernel's loop is left to Triton's pipeliner); a score- or value-kernel
    # program serves one query head
    stages = tuning.key_stages(n_rep, k_bits=bits, programs=programs)
    score_tiles_per_iter = tuning.prefetch if stages == 1 else 1
    # the tensor-core kernels (GQA, G = 32): one warp serves the n_rep heads, a key group or
    # `gqa_value_blocks` blocks of 16 tokens per iteration
    tc_scores = n_rep > 1 and tuning.gqa_scores == "tensor_cores"
    tc_values = n_rep > 1 and tuning.gqa_values == "tensor_cores"
    blocks = gqa_value_tiles(tuning, capacity=C)
    per_thread = {
        "score": G * D / 32 * n_rep if tc_scores else groups * G * D * score_tiles_per_iter / 32,
        "value": 16 * blocks * D / 32 * n_rep * tuning.prefetch
        if tc_values
        else 4 * quads * chain * D * tuning.prefetch / 32,
    }
    out = []
    modules = triton_ir(tuning, n_rep=n_rep, bits=bits, D=D, C=C, G=G)
    for name in ("score", "value"):
        ttir = modules[name]
        num_stages = 1 if (tc_scores, tc_values)[name == "value"] else _NUM_STAGES
        info, sass = compile_sass(ttir, _NUM_WARPS, num_stages, workdir)
        spill = re.search(r"(\d+) bytes spill stores", info)
        loop = hot_loop(sass)
        ops = collections.Counter(opcode(t) for t in loop)
        n = len(loop)
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
            "ldg_span_pct": load_span(loop),
            "shared_round_trips": ops["STS"],
            "async_copies": ops["LDGSTS"],
            "shared_loads": ops["LDS"],
            "top": ops.most_common(10),
        })  # fmt: skip
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sass.md"))
    p.add_argument(
        "--tunings",
        type=json.loads,
        default=None,
        help="JSON list of KernelTuning fields to build at 2 and 4 bits instead of CONFIGS",
    )
    args = p.parse_args(argv)
    configs = CONFIGS
    if args.tunings is not None:
        configs = [(KernelTuning(**t), bits, 1) for t in args.tunings for bits in (2, 4)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tuning, bits, n_rep in dict.fromkeys(configs):  # configs that coincide run once
            for r in analyse(tuning, bits, n_rep, Path(tmp)):
                rows.append(r)
                print(r, flush=True)
    default = dataclasses.asdict(KernelTuning())
    lines = [
        "# Main loops of the score and value kernels in SASS (sm_90a; D=128, G=32, bf16)",
        "",
        "Built by benchmarks/kernel_sass.py (jax lowering -> Triton -> ptxas, no GPU needed).",
        "per code = loop instructions / codes one thread handles per loop iteration (score and",
        "value programs serve one query head each, so n_rep does not change their loops); for",
        "the tensor-core GQA kernels (`gqa_scores`, `gqa_values`: the default with n_rep > 1),",
        "whose warp serves the n_rep query heads of a KV head at once, per code and query head:",
        "loop instructions / (its lane's codes per iteration x n_rep).",
        "",
        "LDG span: where the loop's global loads sit (first and last, % of the loop body; the",
        "loads of the next tiles should come before the arithmetic). STS: shared-memory stores",
        "in the loop (layout conversions through shared memory, each with barriers).",
        "LDGSTS: cp.async copies into shared memory (the loads Triton's pipeliner issues stages",
        "- 1 iterations ahead; LDG span none where every global load of the loop is one), LDS:",
        "shared-memory loads.",
        "",
        "| kernel | bits | n_rep | tuning | regs | spill B | loop instr | per code | BAR | STS "
        "| LDG span % | LDGSTS | LDS | most frequent |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        changed = {k: v for k, v in r["tuning"].items() if v != default[k]} or "default"
        top = ", ".join(f"{op} {c}" for op, c in r["top"][:8])
        span = "-".join(map(str, r["ldg_span_pct"])) if r["ldg_span_pct"] else "none"
        lines.append(
            f"| {r['kernel']} | {r['bits']} | {r['n_rep']} | {changed} | {r['registers']} | "
            f"{r['spill_bytes']} | {r['loop_instructions']} | {r['per_code']:.2f} | "
            f"{r['barriers']} | {r['shared_round_trips']} | {span} | {r['async_copies']} | "
            f"{r['shared_loads']} | {top} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
