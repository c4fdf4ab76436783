"""SASS of the GQA kernel (no GPU): instructions per code in its main loops."""

import collections
import functools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, "benchmarks")
import json

import jax
import jax.numpy as jnp
from kernel_sass import opcode
from kivi_jax.pallas_kernels.decode_attention import gpu_gqa, triton_stages


def ir(tuning, B=8, H=8, n_rep=4, D=128, C=32768, R=128, G=32, bits=2):
    from jax._src.pallas.triton import lowering, pallas_call_registration

    triton_stages.install()
    captured = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        r = original(*a, **k)
        captured.append(r)
        return r

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
        gpu_gqa.kivi_decode_attention_gqa,
        k_bits=bits,
        v_bits=bits,
        group_size=G,
        residual_length=R,
        tuning=tuning,
    )
    lowering.lower_jaxpr_to_triton_module = capture
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = original
    return str(captured[0].module)


def loops(sass):
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
            out.append([re.sub(r"^@!?U?P\w+\s+", "", t) for a, t in ins if start <= a <= addr])
    return out


t = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
bits = int(sys.argv[2]) if len(sys.argv) > 2 else 2
tuning = gpu_gqa.GqaTuning(**t)
text = ir(tuning, bits=bits)
d = Path(tempfile.mkdtemp())
(d / "k.ttir").write_text(text)
k = triton.compile(
    str(d / "k.ttir"),
    target=GPUTarget("cuda", 90, 32),
    options={"num_warps": tuning.warps, "num_stages": tuning.stages},
)
(d / "k.cubin").write_bytes(k.asm["cubin"])
bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
sass = subprocess.run(
    [bindir / "cuobjdump", "-sass", d / "k.cubin"], capture_output=True, text=True, check=True
).stdout
print(
    "regs",
    getattr(k.metadata, "num_regs", None),
    k.metadata.shared if hasattr(k.metadata, "shared") else None,
)
T = 32 * tuning.tile_groups
for lp in loops(sass):
    c = collections.Counter(opcode(x) for x in lp)
    if c["HMMA"] == 0:
        continue
    elems = T * 128 * 2  # K and V codes per tile
    thr = 32 * tuning.warps
    print(
        f"loop {len(lp)} instr/thread; per element (K+V) {len(lp) * thr / elems:.2f}; top",
        c.most_common(14),
    )
Path("/tmp/gqa.sass").write_text(sass)
Path("/tmp/gqa.ttir").write_text(text)
