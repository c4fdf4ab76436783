"""The operations of one layer's decode step, counted on the CPU: what a mixed state adds.

A decode step runs, in every layer, the append of the new token's key and value and the decode
attention over the state. On a GPU each operation XLA cannot fuse is a kernel of its own (a
scatter, a sort, a dot, a reduction, a copy of a buffer that cannot be updated in place), and
with ~2,000 small kernels a step kivi2-mix ran at half KIVI-2's speed (docs/performance.md).
Without a GPU this script counts them two ways, on a small shape (batch 2, 2 KV heads of 64
channels, 2 query heads each, 256 tokens, bf16):

* `step`: the StableHLO of one layer's step (kivi_jax.append, then kivi_jax.decode_attention)
  as a GPU runs it: traced with the dispatch seeing a GPU (the fused append where it applies,
  the Pallas kernels) and lowered for "cuda". Operations by kind, before XLA's fusion.
* `cpu`: the XLA a mixed state adds to that step, compiled for the CPU: the XLA around the
  attention kernels (the fine channels' weights, the extras' -inf in the logits and their
  softmax: `pallas_kernels/decode_attention/mixed.py`); and, for
  comparison, the XLA append of one token (the path off the GPU, where the fused append does
  not apply): the optimized HLO's fusions, copies and unfused operations. XLA fuses
  differently on the GPU; the counts compare states.

    python benchmarks/decode_ops.py [--out benchmarks/results]   # decode_ops.json and .md

tests/test_decode_ops.py holds the counts to their bounds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
from kivi_jax.pallas_kernels.decode_attention import gpu, mixed

import kivi_jax
from kivi_jax.generate import resolve_kv

SHAPE = dict(batch=2, num_kv_heads=2, head_dim=64, max_len=256)
N_REP = 2
SPLITS = 4  # the value kernel's token splits a row (cpu_around_attention)
KVS = ("kivi2", "kivi2-mix")
# The StableHLO kinds reported (every other operation is elementwise, a reshape, a broadcast,
# a slice or a constant: fused on a GPU).
STEP_KINDS = (
    "custom_call", "scatter", "sort", "top_k", "transpose", "gather", "dot_general", "reduce",
    "concatenate", "dynamic_update_slice", "pad",
)  # fmt: skip


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _state(kv: str):
    return kivi_jax.init_cache(resolve_kv(kv), **SHAPE, dtype=jnp.bfloat16)


def _layer_step(cache, q, k, v):
    cache = kivi_jax.append(cache, k, v, q=q)
    return kivi_jax.decode_attention(q, cache), cache


@contextlib.contextmanager
def _as_on_a_gpu():
    """The dispatch (kivi_jax.attention, kivi_jax.cache) sees a GPU while tracing; jax's trace
    caches are cleared on the way in and out, so that nothing traced for the CPU is reused
    here nor anything traced here on the CPU."""
    jax.clear_caches()
    try:
        with mock.patch.object(jax, "default_backend", lambda: "gpu"):
            yield
    finally:
        jax.clear_caches()


def step_stablehlo(kv: str) -> str:
    """The StableHLO text of one layer's decode step over a `kv` state, as a GPU runs it."""
    b, h, d = SHAPE["batch"], SHAPE["num_kv_heads"], SHAPE["head_dim"]
    x = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    args = (_abstract(_state(kv)), x(b, h * N_REP, d), x(b, h, d), x(b, h, d))
    with _as_on_a_gpu():
        traced = jax.jit(_layer_step, donate_argnums=0).trace(*args)
        return traced.lower(lowering_platforms=("cuda",)).as_text()


def count_stablehlo(text: str) -> collections.Counter:
    """Operations by kind (`stablehlo.scatter` -> "scatter", `chlo.top_k` -> "top_k"), and
    "total": every operation but constants and the functions' own."""
    kinds = collections.Counter(re.findall(r'= "?(?:stablehlo|chlo)\.([a-z_]+)', text))
    kinds["total"] = sum(n for k, n in kinds.items() if k != "constant")
    return kinds


def _optimized_counts(fn, *args, donate: bool) -> collections.Counter:
    """The CPU-optimized HLO's entry computation: instructions by opcode (fusions, copies, ...)
    but parameters, constants, tuples and bitcasts."""
    jitted = jax.jit(fn, donate_argnums=0 if donate else ())
    text = jitted.lower(*args).compile().as_text()
    entry = text[text.index("ENTRY") :]
    entry = entry[: entry.index("\n}")]
    ops = collections.Counter(re.findall(r"= \S+ ([a-z][a-z\-]*)\(", entry))
    for skip in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast"):
        ops.pop(skip, None)
    return ops


def cpu_append(kv: str) -> collections.Counter:
    """The XLA append of one token (cache donated), compiled for the CPU."""
    b, h, d = SHAPE["batch"], SHAPE["num_kv_heads"], SHAPE["head_dim"]
    x = jax.ShapeDtypeStruct((b, h, d), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((b, h * N_REP, d), jnp.bfloat16)
    step = lambda c, q, k, v: kivi_jax.append(c, k, v, q=q)
    return _optimized_counts(step, _abstract(_state(kv)), q, x, x, donate=True)


def cpu_around_attention(kv: str) -> collections.Counter | None:
    """A mixed state's XLA around the attention kernels (the fine channels' weights the score
    kernel reads, the -inf at the full-precision entries' positions, their partial softmax and
    the merge of the value kernel's SPLITS splits with it), compiled for the CPU; None for a
    plain state."""
    state = _state(kv)
    if state.side is None:
        return None
    cfg = state.config
    b, h, d = SHAPE["batch"], SHAPE["num_kv_heads"], SHAPE["head_dim"]
    c = state.v_codes.shape[2]
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    window = dict(residual_length=cfg.residual_length, sliding_keys=cfg.sliding_keys)

    # the logits donated, as the score kernel's output is
    def edits(scores, qs, state, m, o, o_tail, l_sum):
        side = state.side
        fine = mixed.fine_operands(
            qs, state.k_scale, side.fine_codes, side.fine_channels, k_bits=cfg.k_bits
        )
        extras = mixed.extra_entries(side, state.lengths, **window)
        scores = mixed.mask_extras(scores, extras)
        extra = mixed.extras_softmax(qs, extras)
        return fine.weights, scores, gpu._merge_splits(m, o, o_tail, l_sum, extra)

    splits = (f32(b, h, N_REP, SPLITS), f32(b, h, N_REP, SPLITS, d))
    args = (f32(b, h, N_REP, c), f32(b, h, N_REP, d), _abstract(state))
    return _optimized_counts(edits, *args, *splits, splits[1], splits[0], donate=True)


def census() -> dict:
    """{kv: {"step": StableHLO kinds, "cpu_around_attention": ..., "cpu_xla_append": ...}}."""
    out = {}
    for kv in KVS:
        step = count_stablehlo(step_stablehlo(kv))
        parts = dict(
            cpu_around_attention=cpu_around_attention(kv),
            cpu_xla_append=cpu_append(kv),
        )
        out[kv] = dict(step={k: step[k] for k in (*STEP_KINDS, "total")})
        out[kv] |= {k: None if c is None else dict(c.most_common()) for k, c in parts.items()}
    return out


def markdown(result: dict) -> str:
    lines = [
        f"One layer's decode step, batch {SHAPE['batch']}, {SHAPE['num_kv_heads']} KV heads "
        f"x {N_REP} query heads, head_dim {SHAPE['head_dim']}, {SHAPE['max_len']} tokens, "
        f"jax {jax.__version__} (`python benchmarks/decode_ops.py`).",
        "",
        "StableHLO of the step as a GPU runs it (lowered for cuda; operations by kind):",
        "",
        "| kv | " + " | ".join(k for k in (*STEP_KINDS, "total")) + " |",
        "|---|" + "---|" * (len(STEP_KINDS) + 1),
    ]
    for kv, r in result.items():
        lines.append(f"| {kv} | " + " | ".join(str(r["step"][k]) for k in r["step"]) + " |")
    lines += ["", "Compiled for the CPU (optimized HLO, entry instructions):", ""]
    for kv, r in result.items():
        for part in ("cpu_around_attention", "cpu_xla_append"):
            if r[part] is not None:
                ops = ", ".join(f"{n} {k}" for k, n in r[part].items())
                lines.append(f"- {kv}, {part[4:].replace('_', ' ')}: {ops}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    result = census()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_ops.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "decode_ops.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
