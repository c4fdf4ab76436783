"""Decode-attention benchmark on one GPU: the fused KIVI kernel against the best bf16 baselines.

One process, one GPU. For each shape (heads of Llama-2-7B, Llama-3-8B and Llama-3-70B; batch x
context) it
times KIVI-2, KIVI-4 and kivi2-mix (the Pallas-Triton kernels, split merge included; kivi2-mix
with the -inf at its extras' positions scattered between them) and two bf16 baselines
over the same context: cuDNN through ``jax.nn.dot_product_attention(implementation="cudnn")``
and a plain XLA einsum. Every timing runs ``calls`` decode steps on different queries (and,
where one cache would fit in L2, different caches) inside one jit; the median over ``repeats``
such runs is reported per call, as GPU time (a CUPTI trace through jax.profiler: first kernel
start to last kernel end of a run, so the host's dispatch is left out) and as host wall time.
The default of 2 calls keeps compiles short: XLA compiles every call's Pallas kernels anew,
and the value kernel takes ~13 s on the H200's host. In the same run sums over >= 8 GiB
measure the HBM read bandwidth that the bytes each method must read are held to.

    python benchmarks/attention.py --out benchmarks/results

writes attention.json, attention.md and attention.png (speed-up against context length). On a
GPU each row also times KIVI-2 and KIVI-4 through a page table (kivi2-paged, kivi4-paged: the
same states cut into pages of --page-size tokens in a random order over one pool, read by the
paged kernels) against the contiguous kernels; the paged rows alone at 8 x 32k:

    python benchmarks/attention.py --only 8x32k --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from kivi_jax.pallas_kernels.decode_attention import (
    GpuTuning,
    TpuTuning,
    kivi_decode_attention_gpu,
    kivi_decode_attention_tpu,
)
from kivi_jax.pallas_kernels.decode_attention.gpu import (
    KernelTuning,
    dispatch_key_scores,
    weighted_values,
)

sys.path.insert(0, str(Path(__file__).parent))
from timing import (
    interleaved,
    measure_read_bandwidth,
    span_seconds,
    timed_on_gpu,
    traced_by_entry,
)

GROUP, RESIDUAL = 32, 128  # the paper's KIVI settings
L2_BYTES = 60 * 2**20  # H200; every timed loop touches several times this


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    model: str
    q_heads: int
    kv_heads: int
    head_dim: int
    batch: int
    context: int

    @property
    def name(self) -> str:
        t = f"{self.context // 1024}k" if self.context % 1024 == 0 else str(self.context)
        return f"{self.model} {self.batch}x{t}"


MODELS = {
    "Llama-2-7B": (32, 32, 128),
    "Llama-3-8B": (32, 8, 128),
    "Llama-3-70B": (64, 8, 128),
}
BATCH_CONTEXT = [(1, 32768), (8, 32768), (32, 8192), (64, 4096), (1, 131072)]
SHAPES = [
    Shape(model=m, q_heads=hq, kv_heads=hk, head_dim=d, batch=b, context=t)
    for m, (hq, hk, d) in MODELS.items()
    for b, t in BATCH_CONTEXT
] + [Shape(model="Llama-3-8B", q_heads=32, kv_heads=8, head_dim=128, batch=4, context=65536)]


def bf16_bytes(s: Shape) -> int:
    """K and V of the context once, the query read and the output written."""
    return (
        2 * s.batch * s.context * s.kv_heads * s.head_dim * 2
        + 2 * s.batch * s.q_heads * s.head_dim * 2
    )


def kivi_bytes(s: Shape, bits: int) -> int:
    """What a KIVI step must read with every sequence at full context: codes, 16-bit scales
    and zero points of the quantized tokens, and the full-precision residual."""
    length = s.context
    qk, pv = length - length % RESIDUAL, max(length - RESIDUAL, 0)
    d = s.head_dim
    per_head = (
        qk * d * bits // 8  # key codes
        + (qk // GROUP) * d * 2 * 2  # key scale + zero
        + pv * d * bits // 8  # value codes
        + pv * (d // GROUP) * 2 * 2  # value scale + zero
        + (length - qk) * d * 2  # key residual
        + (length - pv) * d * 2  # value residual
    )
    return s.batch * s.kv_heads * per_head + 2 * s.batch * s.q_heads * d * 2


# kivi2-mix (kivi_jax.KIVI2_MIX): KIVI-2 with sinks, sliding keys, fine key channels and heavy
# tokens, read by the same kernels (pallas_kernels/decode_attention/mixed.py).
MIX = dict(sinks=4, fine_key_channels=16, heavy_tokens=32)


def mix_bytes(s: Shape) -> int:
    """What a kivi2-mix step must read: KIVI-2's codes, scales and zero points of the keys of
    [0, Pv) (sliding keys) and values of [0, Pv), both rings, the fine channels' low codes and
    indices, and the sinks' and heavy tokens' keys and values."""
    length, d = s.context, s.head_dim
    pv = max(length - RESIDUAL, 0)
    groups = -(-pv // GROUP)
    f, n_side = MIX["fine_key_channels"], MIX["sinks"] + MIX["heavy_tokens"]
    per_head = (
        pv * d * 2 // 8 + groups * d * 2 * 2  # keys
        + pv * d * 2 // 8 + pv * (d // GROUP) * 2 * 2  # values
        + 2 * min(length, RESIDUAL) * d * 2  # rings
        + pv * f * 2 // 8 + groups * f  # fine codes and channels
        + n_side * 2 * d * 2  # sinks, heavy tokens
    )  # fmt: skip
    return s.batch * s.kv_heads * per_head + 2 * s.batch * s.q_heads * d * 2


def mix_states(key, s: Shape):
    """Random kivi2-mix states: random KIVI-2 states (`kivi_states`) with random side storage
    (fine channels distinct per group, heavy tokens at distinct positions below Pv)."""
    from kivi_jax.cache import MixedState

    b, h, c, d = s.batch, s.kv_heads, s.context, s.head_dim
    f, n, sinks = MIX["fine_key_channels"], MIX["heavy_tokens"], MIX["sinks"]
    out = []
    for i, state in enumerate(kivi_states(key, s, 2)):
        ks = jax.random.split(jax.random.fold_in(key, 1000 + i), 7)
        nrm = lambda k, shape: jax.random.normal(k, shape, jnp.bfloat16)

        def distinct(k, m: int, width: int, lead):
            """m sorted distinct ints of [0, width) per index of `lead`."""
            return jnp.sort(jax.random.uniform(k, (*lead, width)).argsort(-1)[..., :m], -1)

        pos = sinks + distinct(ks[5], n, max(c - RESIDUAL - sinks, n), (b, h))
        side = MixedState(
            extra_k=nrm(ks[0], (b, h, sinks + n, d)),  # the sinks, then the heavy slots
            extra_v=nrm(ks[1], (b, h, sinks + n, d)),
            fine_codes=jax.random.bits(ks[2], (b, h, c // 4, f), jnp.uint8),
            fine_channels=distinct(ks[3], f, d, (b, h, c // GROUP)).astype(jnp.uint8),
            heavy_pos=pos.astype(jnp.int32),
            heavy_score=jnp.zeros((b, h, n), jnp.float32),
            ring_score=None,
        )
        out.append(dict(state, side=side))
    return out


def _copies(nbytes: int) -> int:
    return max(1, min(16, math.ceil(4 * L2_BYTES / nbytes)))


def _many_calls(step, qs, states):
    """One jit running step(q_i, state_{i % copies}) for every query batch q_i."""

    def run(qs, states):
        outs = []
        for i in range(qs.shape[0]):
            # The barrier hides that calls share a cache, so XLA cannot merge their matmuls
            # into one pass over K and V (its dot merger did, before: >100% of peak).
            q, state = jax.lax.optimization_barrier((qs[i], states[i % len(states)]))
            outs.append(step(q, state))
        return jnp.stack(outs)

    return jax.jit(run)


def _queries(key, s: Shape, calls: int):
    return jax.random.normal(key, (calls, s.batch, s.q_heads, s.head_dim), jnp.bfloat16)


def bf16_states(key, s: Shape):
    shape = (s.batch, s.context, s.kv_heads, s.head_dim)  # cuDNN's BTNH layout
    out = []
    for i in range(_copies(bf16_bytes(s))):
        kk, kv = jax.random.split(jax.random.fold_in(key, i))
        out.append(
            (jax.random.normal(kk, shape, jnp.bfloat16), jax.random.normal(kv, shape, jnp.bfloat16))
        )
    return out


def cudnn_step(q, kv):
    k, v = kv
    o = jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn")
    return o[:, 0]


def xla_step(q, kv):
    k, v = kv
    b, hq, d = q.shape
    h = k.shape[2]
    qg = q.reshape(b, h, hq // h, d)
    s = jnp.einsum("bhrd,bthd->bhrt", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhrt,bthd->bhrd", p.astype(k.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, d).astype(q.dtype)


# On a TPU (no cuDNN): jax's Pallas TPU paged attention over bf16 pages of PAGE tokens,
# PAGES_PER_BLOCK to a kernel block (not tuned), XLA's dot_product_attention and the einsum.
PAGE, PAGES_PER_BLOCK = 64, 8
BF16_METHODS = ("cudnn", "xla", "paged", "xla_sdpa")


def paged_states(key, s: Shape):
    """Random bf16 K and V pages [kv_heads, batch * context / PAGE, PAGE, head_dim] (sequence b
    in pages b * P .. b * P + P - 1), page indices and lengths, every sequence at full context."""
    pages = s.context // PAGE
    shape = (s.kv_heads, s.batch * pages, PAGE, s.head_dim)
    indices = jnp.arange(s.batch * pages, dtype=jnp.int32).reshape(s.batch, pages)
    lengths = jnp.full((s.batch,), s.context, jnp.int32)
    out = []
    for i in range(_copies(bf16_bytes(s))):
        kk, kv = jax.random.split(jax.random.fold_in(key, i))
        k, v = (jax.random.normal(x, shape, jnp.bfloat16) for x in (kk, kv))
        out.append((k, v, lengths, indices))
    return out


def paged_step(q, state):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    k, v, lengths, indices = state
    q = q * jnp.asarray(1 / math.sqrt(q.shape[-1]), q.dtype)  # the kernel does not scale q
    return paged_attention(q, k, v, lengths, indices, pages_per_compute_block=PAGES_PER_BLOCK)


def xla_sdpa_step(q, kv):
    k, v = kv
    return jax.nn.dot_product_attention(q[:, None], k, v, implementation="xla")[:, 0]


def kivi_states(key, s: Shape, bits: int):
    """Random KIVI states in the cache layout, every sequence at full context."""
    b, h, c, d, r = s.batch, s.kv_heads, s.context, s.head_dim, RESIDUAL
    per = 8 // bits
    out = []
    for i in range(_copies(kivi_bytes(s, bits))):
        ks = jax.random.split(jax.random.fold_in(key, i), 8)
        u = lambda k, shape: jax.random.uniform(k, shape, jnp.float32, 0.0, 0.3).astype(
            jnp.bfloat16
        )
        n = lambda k, shape: jax.random.normal(k, shape, jnp.bfloat16)
        out.append(
            dict(
                k_codes=jax.random.bits(ks[0], (b, h, c // per, d), jnp.uint8),
                k_scale=u(ks[1], (b, h, c // GROUP, d)),
                k_zero=n(ks[2], (b, h, c // GROUP, d)),
                v_codes=jax.random.bits(ks[3], (b, h, c, d // per), jnp.uint8),
                v_scale=u(ks[4], (b, h, c, d // GROUP)),
                v_zero=n(ks[5], (b, h, c, d // GROUP)),
                k_residual=n(ks[6], (b, h, r, d)),
                v_residual=n(ks[7], (b, h, r, d)),
                lengths=jnp.full((b,), c, jnp.int32),
            )
        )
    return out


def paged_kivi_states(key, s: Shape, bits: int, page_size: int):
    """`kivi_states` cut into pages of `page_size` tokens in a random order over one pool (the
    serving engine's layout, kivi_jax.paged): the token arrays [B * M, H, page_size / ., .],
    the table int32 [B, M] (M = context / page_size), the rings and lengths as they were."""
    m = s.context // page_size
    out = []
    for i, state in enumerate(kivi_states(key, s, bits)):
        order = jax.random.permutation(jax.random.fold_in(key, 2000 + i), s.batch * m)
        # page j of the pool holds page order[j] (b * M + m) of the contiguous rows
        table = jnp.argsort(order).astype(jnp.int32).reshape(s.batch, m)

        def pool(x, order=order):  # [B, H, C / e, .] -> [B * M, H, page_size / e, .]
            b, h, n, w = x.shape
            x = x.reshape(b, h, m, n // m, w).transpose(0, 2, 1, 3, 4)
            return x.reshape(b * m, h, n // m, w)[order]

        paged = {k: pool(v) if k.endswith(("codes", "scale", "zero")) else v
                 for k, v in state.items()}  # fmt: skip
        out.append(dict(paged, table=table))
    return out


def kivi_step(bits: int, tuning: GpuTuning | TpuTuning, interpret: bool = False, mix: bool = False):
    """A step over `kivi_states` (or, with `mix`, `mix_states`: GPU only)."""
    kernel = (
        kivi_decode_attention_tpu if isinstance(tuning, TpuTuning) else kivi_decode_attention_gpu
    )
    window = dict(sliding_keys=True) if mix else {}

    def step(q, state):
        return kernel(
            q, **state, k_bits=bits, v_bits=bits, group_size=GROUP, residual_length=RESIDUAL,
            tuning=tuning, interpret=interpret, **window,
        )  # fmt: skip

    return step


def bench_shape(
    s: Shape,
    *,
    calls: int,
    repeats: int,
    peak: float,
    tuning: GpuTuning,
    interpret: bool = False,
    baselines: dict | None = None,
    page_size: int = 128,
) -> dict:
    """One table row. With `baselines` (a row of an earlier run of this script on the same
    machine), the bf16 baselines are taken from it instead of being timed again. On a GPU the
    KIVI states are timed contiguous and through a page table of `page_size` tokens a page."""
    key = jax.random.key(hash(s.name) % 2**31)
    qs = _queries(key, s, calls)
    row = {"shape": s.name, **dataclasses.asdict(s), "methods": {}}

    def record(name, nbytes, fn, args):
        try:
            sec, host, timing = timed_on_gpu(_many_calls(fn, *args), args, repeats=repeats)
        except Exception as e:  # a baseline that does not run on this shape is reported, not fatal
            row["methods"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            return
        sec, host = sec / calls, host / calls
        gbs = nbytes / sec / 1e9
        row["methods"][name] = {
            "us": sec * 1e6,
            "timing": timing,
            "host_us": host * 1e6,
            "bytes": nbytes,
            "GB_per_s": gbs,
            "pct_peak": 100 * nbytes / sec / peak,
            "floor_us": nbytes / peak * 1e6,
        }
        print(
            f"  {name:8s} {sec * 1e6:9.1f} us (host {host * 1e6:.1f})  {gbs:7.0f} GB/s  "
            f"{100 * gbs * 1e9 / peak:5.1f}%",
            flush=True,
        )

    if baselines is None and isinstance(tuning, TpuTuning):  # a TPU (main's choice of tuning)
        states = paged_states(key, s)
        record("paged", bf16_bytes(s), paged_step, (qs, states))
        states = bf16_states(key, s)
        record("xla_sdpa", bf16_bytes(s), xla_sdpa_step, (qs, states))
        record("xla", bf16_bytes(s), xla_step, (qs, states))
        del states
    elif baselines is None:
        states = bf16_states(key, s)
        record("cudnn", bf16_bytes(s), cudnn_step, (qs, states))
        record("xla", bf16_bytes(s), xla_step, (qs, states))
        del states
    else:
        for name in [n for n in BF16_METHODS if n in baselines["methods"]]:
            m = dict(baselines["methods"][name], earlier_run=True)
            if "us" in m:  # percent of this run's peak
                m["pct_peak"] = 100 * m["bytes"] / (m["us"] * 1e-6) / peak
                m["floor_us"] = m["bytes"] / peak * 1e6
            row["methods"][name] = m
    for bits in (2, 4):
        states = kivi_states(key, s, bits)
        record(f"kivi{bits}", kivi_bytes(s, bits), kivi_step(bits, tuning, interpret), (qs, states))
        del states
    if not isinstance(tuning, TpuTuning):  # the TPU kernel does not read a mixed state
        states = mix_states(key, s)
        step = kivi_step(2, tuning, interpret, mix=True)
        record("kivi2-mix", mix_bytes(s), step, (qs, states))
        del states
        mix, plain = row["methods"]["kivi2-mix"], row["methods"].get("kivi2", {})
        if "us" in mix and "us" in plain:
            mix["vs_kivi2"] = mix["us"] / plain["us"]
        for bits in (2, 4):  # the same states through a random page table (`paged_kivi_states`)
            states = paged_kivi_states(key, s, bits, page_size)
            name = f"kivi{bits}-paged"
            record(name, kivi_bytes(s, bits), kivi_step(bits, tuning, interpret), (qs, states))
            del states
            paged, plain = row["methods"][name], row["methods"].get(f"kivi{bits}", {})
            if "us" in paged and "us" in plain:
                paged["vs_contiguous"] = paged["us"] / plain["us"]
    for key_, speedup in (("us", "speedup"), ("host_us", "host_speedup")):
        base = [m[key_] for k, m in row["methods"].items() if k in BF16_METHODS and key_ in m]
        if base:
            row[f"best_bf16_{key_}"] = min(base)
            for name in ("kivi2", "kivi4", "kivi2-mix", "kivi2-paged", "kivi4-paged"):
                m = row["methods"].get(name, {})
                if key_ in m:
                    m[speedup] = min(base) / m[key_]
    return row


KERNEL_COLUMNS = ("score_kernel_us", "value_kernel_us")
# The kernels of `kernel_steps` that read logits: their steps take (state, random_logits(...)[i]).
LOGIT_KERNELS = ("value_kernel_us",)


_Q_SCALE = 1.0 / math.sqrt(128)  # any: the kernels' cost does not depend on it


def _split_heads(q, kv_heads: int):
    """q [B, Hq, D] -> [B, H, n_rep, D], as the kernels take it."""
    return q.reshape(q.shape[0], kv_heads, -1, q.shape[-1])


def _key_scores(q, state, *, bits: int, tuning: GpuTuning, kv_heads: int):
    """The tuning's score kernel alone on q [B, Hq, D]: (logits, maxima)."""
    return dispatch_key_scores(
        _split_heads(q, kv_heads), state["k_codes"], state["k_scale"], state["k_zero"],
        state["lengths"], q_scale=_Q_SCALE, bits=bits, group_size=GROUP,
        residual_length=RESIDUAL, tuning=tuning, interpret=False,
    )  # fmt: skip


def kernel_steps(bits: int, tuning: GpuTuning, kv_heads: int) -> dict:
    """{column of KERNEL_COLUMNS: step} for each kernel the tuning's step runs, alone, in the
    order the step runs them: the score kernel as step(q, state), and the value
    kernel (with the residual tail) on random logits of the same shape (its cost does not
    depend on the values) as step(q, (state, (logits, block_max)))."""

    def scores(q, state):
        return _key_scores(q, state, bits=bits, tuning=tuning, kv_heads=kv_heads)[1]

    def values(q, state):
        st, (logits, block_max) = state
        return weighted_values(_split_heads(q, kv_heads), logits, block_max, st["v_codes"],
                               st["v_scale"], st["v_zero"], st["k_residual"], st["v_residual"],
                               st["lengths"], q_scale=_Q_SCALE, bits=bits, group_size=GROUP,
                               residual_length=RESIDUAL, tuning=tuning,
                               interpret=False)[1]  # fmt: skip

    return {"score_kernel_us": scores, "value_kernel_us": values}


def random_logits(key, s: Shape, n: int, *, bits: int, tuning: GpuTuning, state) -> list:
    """n random outputs of the tuning's score kernel, for the value kernel timed alone: float32
    logits and maxima shaped as the score kernel of `kernel_steps` returns them for `state`
    (the CUDA-core kernel's [B, H, n_rep, C] and one maximum per program, or the tensor-core
    kernel's head slots and 8 maxima per program), every maxima column holding its row's max
    (the value kernel reduces a row's columns). Computed here, outside the timed steps."""
    q = jax.ShapeDtypeStruct((s.batch, s.q_heads, s.head_dim), jnp.bfloat16)
    scores = functools.partial(_key_scores, bits=bits, tuning=tuning, kv_heads=s.kv_heads)
    logits_shape, maxima_shape = (x.shape for x in jax.eval_shape(scores, q, state))
    out = []
    for i in range(n):
        logits = jax.random.normal(jax.random.fold_in(key, i), logits_shape, jnp.float32)
        top = jnp.max(logits, axis=-1, keepdims=True)
        out.append((logits, jnp.broadcast_to(top, maxima_shape)))
    return out


def kernel_runs(s: Shape, bits: int, tuning: GpuTuning, qs, states, logits) -> dict:
    """{name: (fn, args)} for the kernels of `kernel_steps`: each kernel alone as one jit of
    len(qs) calls, with its arguments."""
    with_logits = list(zip(states, logits, strict=True))
    runs = {}
    for name, step in kernel_steps(bits, tuning, s.kv_heads).items():
        args = (qs, with_logits if name in LOGIT_KERNELS else states)
        runs[name] = (_many_calls(step, *args), args)
    return runs


def time_kernels(s: Shape, bits: int, *, calls, repeats, tuning) -> dict:
    """GPU microseconds per call of each kernel alone (host time without a GPU trace)."""
    key = jax.random.key(2)
    qs = _queries(key, s, calls)
    states = kivi_states(key, s, bits)
    logits = random_logits(key, s, len(states), bits=bits, tuning=tuning, state=states[0])
    out = {"shape": s.name, "bits": bits}
    for name, (fn, args) in kernel_runs(s, bits, tuning, qs, states, logits).items():
        sec, _, out["timing"] = timed_on_gpu(fn, args, repeats=repeats)
        out[name] = sec / calls * 1e6
    print(f"  kernels alone: {out}", flush=True)
    return out


# Tunings timed by --sweep (--sweep-shape, --sweep-model, --sweep-bits); the first is the default.
# The default (with MHA Triton's pipeliner, 3 stages; with GQA the register prefetch) against
# the score kernel's register prefetch, 2 and 4 stages, and the score kernel's tiles: 32 key
# rows per iteration, 8 and 32 key groups per program, a key row in two slices.
SWEEP = [
    KernelTuning(),
    KernelTuning(score_stages=1),
    KernelTuning(score_stages=2),
    KernelTuning(score_stages=4),
    KernelTuning(score_rows=32),
    KernelTuning(score_program_groups=8),
    KernelTuning(score_program_groups=32),
    KernelTuning(score_slices=2),
]
# Kernel names in the GPU trace -> the sweep's per-kernel columns.
KERNEL_NAMES = {
    "kivi_scores": "score_kernel_us",
    "kivi_values": "value_kernel_us",
}


# The sweep's split of a step: each KIVI kernel, every other kernel (XLA's fusions around
# them), and the step's span minus the kernels' summed times (the GPU's idle time between
# kernels; negative where kernels overlap).
SPLIT_COLUMNS = (*KERNEL_COLUMNS, "other_kernels_us", "idle_us")


def _step_split(run: list[tuple[str, int, int]]) -> dict:
    """{column of SPLIT_COLUMNS or other kernel's name: seconds} of one traced run (a KIVI
    kernel's column only where it ran)."""
    busy = lambda events: sum(t1 - t0 for _, t0, t1 in events) * 1e-9
    kivi = {c: [e for e in run if k in e[0]] for k, c in KERNEL_NAMES.items()}
    other = [e for e in run if not any(k in e[0] for k in KERNEL_NAMES)]
    return {
        **{c: busy(events) for c, events in kivi.items() if events},
        "other_kernels_us": busy(other),
        "idle_us": span_seconds(run) - busy(run),
        **{name: busy([e for e in other if e[0] == name]) for name in {e[0] for e in other}},
    }


def kernel_split(runs: dict, *, rounds: int) -> dict:
    """{entry: {column: median seconds per run}} of each entry's step split (`_step_split`:
    SPLIT_COLUMNS and each other kernel by name) inside its jit (runs: entry -> (fn, args),
    already warm), from one trace of `rounds` interleaved rounds; {} without a GPU trace."""
    out = {}
    for entry, per_run in traced_by_entry(runs, rounds=rounds).items():
        splits = [_step_split(r) for r in per_run]
        columns = set().union(*splits)  # an XLA kernel may not run in every round
        out[entry] = {c: statistics.median(x.get(c, 0.0) for x in splits) for c in columns}
    return out


def sweep(s: Shape, bits: int, tunings, *, calls, rounds, peak, smoke=False) -> list[dict]:
    """Times KIVI-`bits` on one shape under each of `tunings`, all entries interleaved round by
    round (GPU time from a trace of further interleaved rounds; host time without a GPU),
    and (on a GPU) each kernel's share of the step, from a third trace."""
    key = jax.random.key(1)
    qs = _queries(key, s, calls)
    states = kivi_states(key, s, bits)
    runs = {
        i: (_many_calls(kivi_step(bits, t, interpret=smoke), qs, states), (qs, states))
        for i, t in enumerate(tunings)
    }
    timed, timing = interleaved(runs, rounds=rounds)
    split = kernel_split({i: r for i, r in runs.items() if isinstance(timed.get(i), float)},
                         rounds=rounds)  # fmt: skip
    out = []
    for i, t in enumerate(tunings):
        rec = {"shape": s.name, "bits": bits, "tuning": dataclasses.asdict(t), "timing": timing}
        v = timed.get(i)
        if isinstance(v, float):
            rec["us"] = v / calls * 1e6
            rec["pct_peak"] = 100 * kivi_bytes(s, bits) / (rec["us"] * 1e-6) / peak
        elif v is not None:
            rec["error"] = v
        for column, seconds in split.get(i, {}).items():
            if column in SPLIT_COLUMNS:
                rec[column] = seconds / calls * 1e6
            else:
                rec.setdefault("other_kernels", {})[column] = seconds / calls * 1e6
        out.append(rec)
        print(f"  sweep {t}: {rec}", flush=True)
    return out


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        f"# Decode attention, {result['device']} (jax {result['jax']})",
        "",
        f"HBM read bandwidth measured in this run (sum over {result['peak_gib']} GiB): "
        f"{result['peak_GBps']:.0f} GB/s. Times are per decode step, median of "
        f"{result['repeats']} runs of {result['calls']} steps inside one jit: µs is GPU time "
        "(CUPTI trace: first kernel start to last kernel end of a run, so the host's dispatch "
        "is left out), host µs the wall time of a run on the host. KIVI: "
        f"G={GROUP}, R={RESIDUAL}, every sequence at full context; bytes = what each method "
        "must read; GB/s, % of peak, and speed-up use µs (* where no GPU trace was taken: "
        "host time).",
        "",
        *(
            [
                f"bf16 baselines (cudnn, xla) are from an earlier run on this machine kind "
                f"({result['baselines_from']}); their % of peak uses this run's peak.",
                "",
            ]
            if result.get("baselines_from")
            else []
        ),
        f"KIVI kernel tuning: {result.get('tuning')} (`score_slices` None: 2 for 2-bit keys, "
        "1 for 4-bit ones; `value_quads` None: 16 for 2-bit values, 8 for 4-bit ones; "
        "`score_stages` None: 3 for MHA (1 for 2-bit keys in one wave of programs), 1 for "
        "GQA; `KernelTuning.key_slices`, `KernelTuning.quads`, "
        "`KernelTuning.key_stages`; with GQA `gqa_scores`, `gqa_values` 'tensor_cores': the "
        "tensor-core kernels, `gqa_scores.py`, `gqa_values.py`)",
        "",
        "| shape | method | µs | host µs | MB read | GB/s | % of peak | floor µs "
        "| speed-up vs best bf16 | (host) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        for name, m in row["methods"].items():
            if "us" not in m:
                lines.append(f"| {row['shape']} | {name} | failed | | | | | | | |")
                continue
            sp = f"{m['speedup']:.2f}x" if "speedup" in m else ""
            hsp = f"{m['host_speedup']:.2f}x" if "host_speedup" in m else ""
            host = f"{m['host_us']:.1f}" if "host_us" in m else ""
            us = f"{m['us']:.1f}" + ("*" if m.get("timing") == "host" else "")
            lines.append(
                f"| {row['shape']} | {name} | {us} | {host} | {m['bytes'] / 1e6:.1f} | "
                f"{m['GB_per_s']:.0f} | {m['pct_peak']:.1f} | {m['floor_us']:.1f} | {sp} | "
                f"{hsp} |"
            )
    mixes = [
        (row["shape"], row["methods"]["kivi2"]["us"], row["methods"]["kivi2-mix"])
        for row in result["rows"]
        if "vs_kivi2" in row["methods"].get("kivi2-mix", {})
    ]
    if mixes:
        lines += [
            "",
            "## kivi2-mix against KIVI-2",
            "",
            "kivi2-mix (`KIVI2_MIX`: 4 sinks, sliding keys, 16 fine key channels, 32 heavy "
            "tokens) through the same kernels (the fine channels in the score kernels, the "
            "sliding keys' logits in the value kernels), the -inf at the sinks' and heavy tokens' "
            "positions scattered between them (`pallas_kernels/decode_attention/mixed.py`); "
            "target: at most 1.25x KIVI-2's time.",
            "",
            "| shape | KIVI-2 µs | kivi2-mix µs | kivi2-mix / KIVI-2 |",
            "|---|---:|---:|---:|",
            *(f"| {n} | {k2:.1f} | {m['us']:.1f} | {m['vs_kivi2']:.2f}x |" for n, k2, m in mixes),
        ]
    paged = [
        (
            row["shape"],
            bits,
            row["methods"][f"kivi{bits}"]["us"],
            row["methods"][f"kivi{bits}-paged"],
        )
        for row in result["rows"]
        for bits in (2, 4)
        if "vs_contiguous" in row["methods"].get(f"kivi{bits}-paged", {})
    ]
    if paged:
        lines += [
            "",
            "## Paged against contiguous",
            "",
            f"The same KIVI states cut into pages of {result.get('page_size')} tokens in a random "
            "order over one pool (the serving engine's layout, `kivi_jax.paged`), read by the "
            "paged kernels through the page table (`decode_attention_pallas_paged`); target: "
            "at most 1.1x the contiguous kernels' time at 8 x 32k.",
            "",
            "| shape | bits | contiguous µs | paged µs | paged / contiguous |",
            "|---|---:|---:|---:|---:|",
            *(
                f"| {n} | {b} | {c:.1f} | {m['us']:.1f} | {m['vs_contiguous']:.2f}x |"
                for n, b, c, m in paged
            ),
        ]
    if result.get("kernels"):
        lines += [
            "",
            "## The kernels alone (default tuning)",
            "",
            "GPU time (host time where the record's `timing` says so).",
            "",
            "| shape | bits | score kernel µs | value kernel µs |",
            "|---|---:|---:|---:|",
        ]
        for r in result["kernels"]:
            alone = " | ".join(f"{r[k]:.1f}" if k in r else "" for k in KERNEL_COLUMNS)
            lines.append(f"| {r['shape']} | {r['bits']} | {alone} |")
    if result.get("sweep"):
        lines += [
            "",
            "## Tunings",
            "",
            "All entries timed interleaved (one run of each per "
            "round, median over the rounds). GPU time from a trace of further interleaved "
            "rounds (host time where the records' `timing` says so); each kernel's time is "
            "its share of the step, from a third trace (GPU only); other kernels: XLA's "
            "around them; idle: the GPU between kernels.",
            "",
        ]
        lines.append(
            "| shape | bits | tuning | µs | % of peak | score kernel µs "
            "| value kernel µs | other kernels µs | idle µs |"
        )
        lines.append("|---|---:|---|---:|---:|---:|---:|---:|---:|")
        for r in result["sweep"]:
            default = dataclasses.asdict(KernelTuning())  # (fields since removed: not shown)
            changed = {k: v for k, v in r["tuning"].items() if v != default.get(k, v)}
            us = f"{r['us']:.1f} | {r['pct_peak']:.1f}" if "us" in r else "failed |"
            alone = " | ".join(f"{r[k]:.1f}" if k in r else "" for k in SPLIT_COLUMNS)
            bits = r.get("bits", 2)  # records without bits: KIVI-2
            lines.append(f"| {r['shape']} | {bits} | {changed or 'default'} | {us} | {alone} |")
        for r in result["sweep"]:
            default = dataclasses.asdict(KernelTuning()).items()
            if r.get("other_kernels") and all(r["tuning"].get(k) == v for k, v in default):
                named = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["other_kernels"].items()))
                lines.append(f"\nOther kernels, KIVI-{r['bits']} default (µs per step): {named}")
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    for model, color in zip(MODELS, ("tab:blue", "tab:orange", "tab:green"), strict=True):
        for bits, marker in ((2, "o"), (4, "s")):
            pts = [
                (r["context"], r["methods"][f"kivi{bits}"]["speedup"], r["batch"])
                for r in result["rows"]
                if r["model"] == model and "speedup" in r["methods"].get(f"kivi{bits}", {})
            ]
            if not pts:
                continue
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker,
                       label=f"{model} KIVI-{bits}")  # fmt: skip
            for x, y, b in pts:
                ax.annotate(f"b{b}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("speed-up over the best bf16 kernel")
    ax.set_title(f"KIVI fused decode attention, {result['device']}")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # off the points
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _batch_context(text: str) -> tuple[int, int]:
    """'16x2176' -> (16, 2176)."""
    try:
        batch, context = (int(x) for x in text.split("x"))
    except ValueError:
        msg = f"{text!r}: expected BATCHxCONTEXT, e.g. 16x2176"
        raise argparse.ArgumentTypeError(msg) from None
    if batch < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch and context must be positive")
    return batch, context


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--peak-gib", type=float, default=8.0)
    p.add_argument("--only", default=None, help="substring of shape names to run")
    p.add_argument("--sweep", action="store_true", help="also sweep tunings (at --sweep-shape)")
    p.add_argument("--sweep-bits", type=int, nargs="+", default=[2], help="KIVI bits to sweep")
    p.add_argument(
        "--sweep-tunings",
        type=json.loads,
        default=None,
        help="JSON list of KernelTuning fields to sweep instead of SWEEP, after KernelTuning() "
        "(--tuning applies to the table only)",
    )
    p.add_argument(
        "--sweep-model", default="Llama-2-7B", choices=list(MODELS), help="heads of the sweep"
    )
    p.add_argument(
        "--sweep-shape",
        type=_batch_context,
        default="8x32768",
        help="BATCHxCONTEXT of the sweep, e.g. 16x2176 (a Llama-2-7B decode step of "
        "benchmarks/generate_gpu.py at 2048 + 128: its capacity)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shape, kernel interpreted (CPU)")
    p.add_argument("--kernels", action="store_true", help="time each kernel alone at 8x32k")
    p.add_argument("--baselines", type=Path, help="reuse bf16 rows of an earlier attention.json")
    p.add_argument("--deadline-s", type=float, default=None, help="stop adding rows after this")
    p.add_argument("--tuning", type=json.loads, default={}, help="KernelTuning fields (JSON)")
    p.add_argument(
        "--page-size",
        type=int,
        default=128,
        help="tokens a page of the paged rows (kivi2-paged, kivi4-paged: the KIVI states "
        "through a random page table, against kivi2, kivi4; not on a TPU; a multiple of 32 "
        "dividing the contexts; --only 8x32k: the 8 x 32k rows alone)",
    )
    args = p.parse_args(argv)
    shapes = SHAPES
    if args.smoke:
        shapes = [Shape(model="smoke", q_heads=4, kv_heads=2, head_dim=64, batch=2, context=512)]
        args.calls, args.repeats, args.peak_gib = 2, 2, 1 / 16
    if args.page_size % GROUP or any(s.context % args.page_size for s in shapes):
        p.error(f"--page-size {args.page_size}: a multiple of G={GROUP} dividing every context")
    args.out.mkdir(parents=True, exist_ok=True)

    dev = jax.devices()[0]
    bandwidths = measure_read_bandwidth(args.peak_gib)
    peak = max(bandwidths.values())
    print(f"{dev.device_kind}: read bandwidth {bandwidths}", flush=True)
    result = {
        "device": dev.device_kind,
        "jax": jax.__version__,
        "peak_GBps": peak / 1e9,
        "read_bandwidths_GBps": {k: v / 1e9 for k, v in bandwidths.items()},
        "peak_gib": args.peak_gib,
        "calls": args.calls,
        "repeats": args.repeats,
        "group_size": GROUP,
        "residual_length": RESIDUAL,
        "page_size": args.page_size,
        "rows": [],
    }
    tuning = (TpuTuning if dev.platform == "tpu" else KernelTuning)(**args.tuning)
    if args.sweep:
        batch, context = args.sweep_shape
        hq, hk, d = MODELS[args.sweep_model]
        s0 = shapes[0] if args.smoke else Shape(
            model=args.sweep_model, q_heads=hq, kv_heads=hk, head_dim=d, batch=batch,
            context=context,
        )  # fmt: skip
        tunings = SWEEP
        if args.sweep_tunings is not None:
            tunings = [KernelTuning(), *(KernelTuning(**t) for t in args.sweep_tunings)]
        print(f"sweep on {s0.name}", flush=True)
        result["sweep"] = [
            rec
            for bits in args.sweep_bits
            for rec in sweep(
                s0,
                bits,
                tunings,
                calls=args.calls,
                rounds=args.repeats,
                peak=peak,
                smoke=args.smoke,
            )
        ]
    if args.kernels and not args.smoke:
        result["kernels"] = [
            time_kernels(s, bits, calls=args.calls, repeats=args.repeats, tuning=tuning)
            for s in shapes
            if (s.batch, s.context) == (8, 32768) and (args.only or "") in s.name
            for bits in (2, 4)
        ]
    result["tuning"] = dataclasses.asdict(tuning)
    print(f"table with {tuning}", flush=True)
    earlier = {}
    if args.baselines:
        earlier = {r["shape"]: r for r in json.loads(args.baselines.read_text())["rows"]}
        result["baselines_from"] = str(args.baselines)
    t_start = time.perf_counter()
    order = sorted(shapes, key=lambda s: (s.batch, s.context) != (8, 32768))  # 8x32k first
    for s in order:
        if args.only and args.only not in s.name:
            continue
        if args.deadline_s and time.perf_counter() - t_start > args.deadline_s:
            print(f"deadline: {s.name} not run", flush=True)
            continue
        print(s.name, flush=True)
        result["rows"].append(
            bench_shape(
                s,
                calls=args.calls,
                repeats=args.repeats,
                peak=peak,
                tuning=tuning,
                interpret=args.smoke,
                baselines=earlier.get(s.name) if args.baselines else None,
                page_size=args.page_size,
            )
        )
        (args.out / "attention.json").write_text(json.dumps(result, indent=1))
    (args.out / "attention.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, args.out / "attention.md")
    try:
        plot(result, args.out / "attention.png")
    except Exception as e:  # the numbers matter more than the picture
        print(f"plot failed: {e}", file=sys.stderr)
    print((args.out / "attention.md").read_text())


if __name__ == "__main__":
    main()
