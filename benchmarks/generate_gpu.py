"""End-to-end decode on one GPU: the project's own `generate` on random weights of the
Llama-2-7B, Llama-3-8B and Llama-3-70B shapes, with the full-precision, KIVI-2 and KIVI-4 caches,
and bf16 weights or int8 / int4 ones (kivi_jax.weights; `--weights`, or a row's fifth field).

Each row runs in a process of its own (so that its peak memory is its own). Per row: the decode
step in GPU time (a CUPTI trace of generate's decode program, prefill apart, divided by its
steps), decode tokens/s, the byte floor of a step (the weights it reads and every cache byte its
attention must read at the mean context of the decode, over the read bandwidth measured in the
same device call), the percent of the floor, peak device memory, compile time, the number of
programs compiled (and recompiled by a second call of the same shapes), and the kernels of
one step summed by name (where the time goes).

    python benchmarks/generate_gpu.py group --out DIR --call NAME [--rows ROW ...]
    python benchmarks/generate_gpu.py max-batch --out DIR --call NAME [--kvs ...] [--budgets ...]
    python benchmarks/generate_gpu.py merge DIR [DIR ...] --out benchmarks/results

`max-batch` searches the largest batch whose generate call runs within a memory budget (80 GB,
or the card; the allocator capped by XLA_PYTHON_CLIENT_MEM_FRACTION) for each model, setting
and cache (or, with `--batches`, tries the batches given for a cache), and `merge` adds the
searches to generate_gpu.json (`max_batch`), the markdown table and generate_gpu_max_batch.png
(tokens/s against batch; memory split into weights, cache and working memory). `group`
measures the read bandwidth, then runs each row
(`model:kv:batch:prompt+new[:weights]`, e.g. `Llama-2-7B:kivi2:16:2048+128` or
`Llama-3-8B:kivi2:16:2048+128:int4`; default: DEFAULT_ROWS) as
`generate_gpu.py row ...` in a subprocess and writes DIR/row_*.json; `merge` writes
generate_gpu.json, generate_gpu.md and generate_gpu.png (ratios only between rows of the same
call and weights; a row measured again, in a later DIR, replaces the earlier one). Every row and
search carries `weights` ("bf16", "int8" or "int4"): rows and searches are told apart by it, and
"vs full" compares rows of the same weights.

`group --tensor-parallel N` runs the rows on a mesh of N devices (kivi_jax.sharding: the
weights and the KV state in their shards, generate's programs under shard_map; N = 1 is a
one-device mesh, to compare with the rows without one in the same call). Its row files
record "tensor_parallel": N; give it an --out of its own (merge does not tell the rows apart).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import init_params

import kivi_jax
from kivi_jax import sharding
from kivi_jax.generate import (
    KV_PRESETS,
    PROMPT_BUCKET,
    Sampling,
    _decode_jit,
    _prepare,
    _program_args,
    _start_jit,
    generate,
    resolve_kv,
)
from kivi_jax.weights import QuantizedWeight, group_for, storage_bits

sys.path.insert(0, str(Path(__file__).parent))
from timing import gpu_kernels, kernel_totals, measure_read_bandwidth, split_runs

MODELS = {
    "Llama-2-7B": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
        num_heads=32, num_kv_heads=32, head_dim=128, tie_embeddings=False,
    ),
    "Llama-3-8B": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, tie_embeddings=False,
    ),
    "Llama-3-70B": dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0, tie_embeddings=False,
    ),
    # A CPU check of this script (--rows smoke:kivi2:2:40+8): host time, no GPU trace.
    "smoke": dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=64, tie_embeddings=False,
    ),
}  # fmt: skip
PAUSE_S = 0.3  # host pause between the traced programs (the trace splits runs at half of it)
# Both models at four settings, kivi2-mix beside KIVI-2 at 2048 + 128; then 32768 + 128 at
# batch 8 (Llama-2-7B's full cache, 128 GB, does not fit an H200) and Llama-3-8B (GQA) at
# 131072 + 128, batch 1.
_KVS = ("full", "kivi2", "kivi4")
DEFAULT_ROWS = [
    f"{model}:{kv}:{batch}:{setting}"
    for model in ("Llama-2-7B", "Llama-3-8B")
    for setting, batch, kvs in [
        ("2048+128", 16, (*_KVS, "kivi2-mix")),
        ("4096+256", 16, _KVS),
        ("160+338", 16, _KVS),
        ("160+338", 96, _KVS),
    ]
    for kv in kvs
] + [
    *(f"Llama-2-7B:{kv}:8:32768+128" for kv in ("kivi2", "kivi2-mix")),
    *(f"Llama-3-8B:{kv}:8:32768+128" for kv in (*_KVS, "kivi2-mix")),
    *(f"Llama-3-8B:{kv}:1:131072+128" for kv in _KVS),
]


WEIGHTS = ("bf16", "int8", "int4")  # bf16, or kivi_jax.weights' int8 / int4 (group 128)
ROW_KEY = ("model", "kv", "batch", "prompt", "new_tokens", "weights")


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    kv: str
    batch: int
    prompt: int
    new_tokens: int
    weights: str = "bf16"

    @classmethod
    def parse(cls, spec: str, weights: str = "bf16") -> Row:
        """`model:kv:batch:prompt+new[:weights]`; `weights` where the spec names none."""
        model, kv, batch, setting, *named = spec.split(":")
        prompt, new = setting.split("+")
        weights = named[0] if named else weights
        if model not in MODELS or kv not in KV_PRESETS or weights not in WEIGHTS or len(named) > 1:
            raise ValueError(
                f"bad row {spec!r}: model in {list(MODELS)}, kv in {KV_PRESETS}, weights in "
                f"{WEIGHTS}"
            )
        return cls(model, kv, int(batch), int(prompt), int(new), weights)

    @property
    def spec(self) -> str:
        spec = f"{self.model}:{self.kv}:{self.batch}:{self.prompt}+{self.new_tokens}"
        return spec if self.weights == "bf16" else f"{spec}:{self.weights}"

    @property
    def config(self) -> LlamaConfig:
        width = -(-self.prompt // PROMPT_BUCKET) * PROMPT_BUCKET
        return LlamaConfig(**MODELS[self.model], max_context=width + self.new_tokens)


def _bytes(tree) -> int:
    """Bytes of a tree's arrays in device memory (an int4 element is half a byte)."""
    return sum(x.size * storage_bits(x) for x in jax.tree.leaves(tree)) // 8


def weight_bytes(params) -> int:
    return _bytes(params)


def kv_split(report) -> dict:
    """The KV state's bytes (1e9) by component, from kivi_jax.memory_report."""
    return {
        "kv_bytes_gb": report.total_bytes / 1e9,
        "kv_codes_gb": report.codes_bytes / 1e9,
        "kv_scales_zeros_gb": report.scales_zeros_bytes / 1e9,
        "kv_residual_gb": report.residual_bytes / 1e9,
    }


def weight_bytes_read(params) -> int:
    """Bytes of weights a decode step reads: every layer, the final norm, the output projection
    (the embeddings only for the rows' tokens, but whole where they are the output too)."""
    out = params.embed if params.lm_head is None else params.lm_head
    return _bytes(params.layers) + _bytes(params.final_norm) + _bytes(out)


def cache_bytes_read(row: Row, length: int) -> int:
    """Bytes the attention of one step must read over all layers with every row at `length`
    tokens: K and V in bf16 for the full cache; for KIVI the codes, the 16-bit scales and zero
    points of the quantized tokens and the full-precision residual (KIVI.md's state), and for a
    mixed state (kivi2-mix) its keys read from the ring from Pv on (sliding keys), the fine
    channels' low codes and indices and the sinks' and heavy tokens' keys and values."""
    c = row.config
    per_head = 2 * length * c.head_dim * 2
    cfg = resolve_kv(row.kv)
    if cfg is not None:
        g, r, d = cfg.group_size, cfg.residual_length, c.head_dim
        pv = max(length - r, 0)
        qk = pv if cfg.sliding_keys else length - length % r
        f = cfg.fine_key_channels
        per_head = (
            (qk * cfg.k_bits + pv * cfg.v_bits) * d // 8
            + (qk + pv) * d // g * 2 * 2
            + ((length - qk) + (length - pv)) * d * 2
            + qk * f * cfg.k_bits // 8 + -(-qk // g) * f  # fine codes and channels
            + (cfg.sinks + cfg.heavy_tokens) * 2 * d * 2
        )  # fmt: skip
    return c.num_layers * row.batch * c.num_kv_heads * per_head


class CompileCounter:
    """Counts XLA backend compilations, their seconds and the compiled functions' names
    (jax.monitoring events)."""

    def __init__(self):
        self.programs, self.seconds, self.names = 0, 0.0, []
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, name, seconds, fun_name="?", **_):
        if name == "/jax/core/compile/backend_compile_duration":
            self.programs += 1
            self.seconds += seconds
            self.names.append(fun_name)


class _LogLines(logging.Handler):
    """Keeps the distinct records logged to it (the first 60, 4000 characters each)."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.lines = []

    def emit(self, record):
        line = record.getMessage()[:4000]
        if line not in self.lines and len(self.lines) < 60:
            self.lines.append(line)


_LINEAR = ("w_qkv", "wo", "w_gate_up", "w_down", "lm_head")


def random_params(config: LlamaConfig, key, weights: str = "bf16") -> object:
    """Random weights of the config's shapes (matrices ~ normal / sqrt(fan_in), norms 1), made
    on the device one array at a time: one small program per distinct shape (a jit of the whole
    init_params compiles for minutes at 7B). With int8 / int4 the linear layers are made as
    QuantizedWeights directly, in kivi_jax.weights' formats (int8: a scale per output channel;
    int4: groups of up to 128 inputs with a zero point), never as bf16 first (a 70B's bf16
    weights do not fit the card)."""
    abstract = jax.eval_shape(lambda: init_params(config, key, jnp.bfloat16))
    normal = jax.jit(
        lambda k, scale, shape: (jax.random.normal(k, shape, jnp.float32) * scale).astype(
            jnp.bfloat16
        ),
        static_argnums=2,
    )

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def quantized(k, shape, bits) -> QuantizedWeight:
        n_in, n_out = shape
        if bits == 8:  # q uniform in [-127, 127]: std 73.6
            q = jax.random.randint(k, shape, -127, 128, jnp.int8)
            scale = jnp.full((1, n_out), 1 / (73.6 * np.sqrt(n_in)), jnp.bfloat16)
            return QuantizedWeight(qvalue=q, scale=scale)
        groups = n_in // group_for(n_in, 128)  # q uniform in [-8, 7] about zero -0.5: std 4.6
        q = jax.random.randint(k, shape, -8, 8, jnp.int32).astype(jnp.int4)
        scale = jnp.full((groups, n_out), 1 / (4.6 * np.sqrt(n_in)), jnp.bfloat16)
        return QuantizedWeight(qvalue=q, scale=scale, zero_point=jnp.full_like(scale, -0.5))

    def make(i, path, x):
        k = jax.random.fold_in(key, i)
        if weights != "bf16" and getattr(path[-1], "name", None) in _LINEAR:
            return quantized(k, x.shape, int(weights[3:]))
        if x.ndim == 2:
            return normal(k, 1.0 / np.sqrt(x.shape[0]), x.shape)
        return jnp.ones(x.shape, jnp.bfloat16)

    leaves, treedef = jax.tree.flatten_with_path(abstract)
    arrays = [make(i, path, x) for i, (path, x) in enumerate(leaves)]
    return jax.block_until_ready(jax.tree.unflatten(treedef, arrays))


def abstract_params(config: LlamaConfig, weights: str):
    """random_params' shapes and dtypes (nothing allocated)."""
    if weights == "bf16":
        return jax.eval_shape(lambda: init_params(config, jax.random.key(0), jnp.bfloat16))
    # the quantized matrices from init_params' float ones, abstractly
    from kivi_jax.weights import quantize_weights

    return jax.eval_shape(
        lambda: quantize_weights(
            init_params(config, jax.random.key(0), jnp.bfloat16), bits=int(weights[3:])
        )
    )


def _log(what: str, t0: float) -> None:
    print(f"  {what}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def run_row(
    row: Row, *, read_gbps: float, call: str, repeats: int, tensor_parallel: int | None = None
) -> dict:
    c = row.config
    counter = CompileCounter()
    t_row = t0 = time.perf_counter()
    params = random_params(c, jax.random.key(0), row.weights)
    mesh = None
    if tensor_parallel is not None:
        mesh = sharding.tensor_parallel_mesh(tensor_parallel)
        params = jax.block_until_ready(sharding.shard_params(params, mesh))
    init_s = time.perf_counter() - t0
    _log("weights", t_row)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, c.vocab_size, (row.batch, row.prompt), dtype=np.int32)
    sampling = Sampling()

    programs0, compile0 = counter.programs, counter.seconds
    config0 = dict(jax.config.values)
    t0 = time.perf_counter()
    jax.block_until_ready(generate(params, tokens, kv=row.kv, max_new_tokens=row.new_tokens))
    first_call_s = time.perf_counter() - t0
    # global config values only (thread-local contexts such as default_device are not seen)
    config_changed = {
        k: [repr(config0.get(k)), repr(v)]
        for k, v in jax.config.values.items()
        if config0.get(k) != v
    }
    programs, compile_s = counter.programs - programs0, counter.seconds - compile0
    _log(f"first call ({programs} programs, {compile_s:.0f} s compiling)", t_row)
    # A second call of the same shapes (what it compiles is a recompilation), before the
    # traced runs: on the H200 (jax 0.11.2) a generate call after them failed with
    # CUDA_ERROR_LAUNCH_FAILED in the decode program (every full-cache row, some KIVI rows).
    # jax explains each cache miss of the second call (logged at WARNING); kept in the row.
    programs1, explained = counter.programs, _LogLines()
    explain0 = jax.config.jax_explain_cache_misses
    logging.getLogger("jax").addHandler(explained)
    jax.config.update("jax_explain_cache_misses", True)
    try:
        jax.block_until_ready(generate(params, tokens, kv=row.kv, max_new_tokens=row.new_tokens))
    finally:
        jax.config.update("jax_explain_cache_misses", explain0)
        logging.getLogger("jax").removeHandler(explained)
    recompiled = counter.programs - programs1
    recompiled_names = counter.names[programs1:]

    def one_run(trace_dir: str) -> float:
        """generate's two programs, traced, a pause between them (the trace tells them apart);
        the state is allocated before the trace starts (at a large batch the host's work
        before the prefill can leave a gap as long as the pause). Returns the host seconds."""
        toks, lengths, cache, rows = _prepare(
            params, tokens, None, kv=row.kv, max_new_tokens=row.new_tokens, sampling=sampling,
            mesh=mesh,
        )  # fmt: skip
        jax.block_until_ready(cache)
        per_row, start_kw, decode_kw = _program_args(sampling, row.batch, row.new_tokens)
        n = jnp.int32(row.new_tokens)
        jax.profiler.start_trace(trace_dir)
        t0 = time.perf_counter()
        state = _start_jit(params, toks, lengths, cache, per_row, **start_kw, prefill_rows=rows)
        jax.block_until_ready(state)
        time.sleep(PAUSE_S)
        jax.block_until_ready(_decode_jit(params, state, n, **decode_kw))
        host = time.perf_counter() - t0
        jax.profiler.stop_trace()
        return host

    host, runs = [], []
    for _ in range(repeats):  # one trace per run: the decode program after the last pause
        with tempfile.TemporaryDirectory() as d:
            host.append(one_run(d))
            traced = split_runs(gpu_kernels(d), gap_ms=PAUSE_S * 1e3 / 2)
        if len(traced) == 1:
            raise RuntimeError("the trace holds one run: the pause between the programs is missing")
        if traced:  # the prefill: everything before (a host gap may split it)
            runs += [[e for r in traced[:-1] for e in r], traced[-1]]
    _log("traced runs", t_row)
    steps = row.new_tokens - 1
    if runs:
        if len(runs) != 2 * repeats:
            raise RuntimeError(f"the trace holds {len(runs)} runs, not {2 * repeats}")
        span = lambda r: (r[-1][2] - r[0][1]) * 1e-9
        decode_s = statistics.median(span(r) for r in runs[1::2])
        prefill_s = statistics.median(span(r) for r in runs[0::2])
        decode_run = sorted(runs[1::2], key=span)[len(runs[1::2]) // 2]
        totals = kernel_totals(decode_run)
        idle_ms = (span(decode_run) - sum(t for _, t in totals.values())) / steps * 1e3
        timing = "gpu"
    else:  # no GPU trace (a CPU check of the script): host time of both programs
        decode_s = statistics.median(host) - PAUSE_S
        prefill_s, totals, timing = float("nan"), {}, "host"
        idle_ms = float("nan")
    per_step = {n: (k / steps, t / steps * 1e3) for n, (k, t) in totals.items()}

    step_ms = decode_s / steps * 1e3
    lengths = range(row.prompt + 1, row.prompt + row.new_tokens)  # the decode steps' contexts
    cache_read = statistics.mean(cache_bytes_read(row, n) for n in lengths)
    weights_read = weight_bytes_read(params)
    floor_ms = (weights_read + cache_read) / (read_gbps * 1e9) * 1e3
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "model": row.model,
        "kv": row.kv,
        "batch": row.batch,
        "prompt": row.prompt,
        "new_tokens": row.new_tokens,
        "weights": row.weights,
        "call": call,
        "tensor_parallel": tensor_parallel,
        "timing": timing,
        "step_ms": step_ms,
        "floor_ms": floor_ms,
        "pct_floor": 100 * floor_ms / step_ms,
        "read_GBps": read_gbps,
        "tokens_per_s": row.batch / (step_ms * 1e-3),
        "idle_ms_per_step": idle_ms,
        "prefill_ms": prefill_s * 1e3,
        "weights_read_gb": weights_read / 1e9,
        "cache_read_gb": cache_read / 1e9,
        **kv_split(kivi_jax.memory_report(cache_of(row, params))),
        "weights_gb": weight_bytes(params) / 1e9,
        "peak_gb": stats.get("peak_bytes_in_use", float("nan")) / 1e9,
        "compile_s": compile_s,
        "programs": programs,
        "recompiled": recompiled,
        "recompiled_programs": recompiled_names,
        "cache_miss_explanations": explained.lines,
        "config_changed_by_first_call": config_changed,
        "first_call_s": first_call_s,
        "init_s": init_s,
        "kernels_per_step": {n: {"launches": k, "ms": t} for n, (k, t) in per_step.items()},
    }


def cache_of(row: Row, params):
    """The shape of generate's KV state for this row (abstract: nothing is allocated)."""
    c = row.config
    width = -(-row.prompt // PROMPT_BUCKET) * PROMPT_BUCKET
    return jax.eval_shape(
        lambda: kivi_jax.init_cache(
            resolve_kv(row.kv), batch=row.batch, max_len=width + row.new_tokens,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=params.dtype,
            num_layers=c.num_layers,
        )
    )  # fmt: skip


def describe_device() -> dict:
    """The device, the versions and the read bandwidths (GB/s) of this process's GPU."""
    import flax
    import jaxlib

    on_gpu = jax.default_backend() == "gpu"
    bandwidth = measure_read_bandwidth(8.0 if on_gpu else 0.25)  # >> L2 on a GPU
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "device": jax.devices()[0].device_kind,
        "memory_bytes": stats.get("bytes_limit", 0),
        "versions": {
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "flax": flax.__version__,
        },
        "read_bandwidths_GBps": {k: v / 1e9 for k, v in bandwidth.items()},
        # what changes how jax compiles (e.g. PGLE recompiles a program after its first runs)
        "environment": {k: v for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_"))},
        "jax_enable_pgle": bool(jax.config.jax_enable_pgle),
    }


def setup(args) -> tuple[dict, dict]:
    """(environment for the rows' processes, the device description). Runs in a process that
    never touches the GPU itself (so that every row has the whole card)."""
    args.out.mkdir(parents=True, exist_ok=True)
    # Autotuning results shared between the rows' processes (the same matmuls recur).
    tuned = f"--xla_gpu_per_fusion_autotune_cache_dir={args.out / 'autotune'}"
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {tuned}".strip()
    describe = [sys.executable, __file__, "describe"]
    whole = dict(env, XLA_PYTHON_CLIENT_MEM_FRACTION="1.0")  # memory_bytes: the whole card
    probe = subprocess.run(describe, env=whole, capture_output=True, text=True)
    if probe.returncode and "Unknown flag" in probe.stderr:  # an XLA without the cache
        env["XLA_FLAGS"] = whole["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
        probe = subprocess.run(describe, env=whole, capture_output=True, text=True)
    if probe.returncode:
        sys.exit(f"device description failed:\n{probe.stderr[-2000:]}")
    described = json.loads(probe.stdout.strip().splitlines()[-1])
    call = {"call": args.call, **described}
    (args.out / f"call_{args.call}.json").write_text(json.dumps(call, indent=1))
    read_gbps = max(described["read_bandwidths_GBps"].values())
    print(f"{described['device']}: read bandwidth {read_gbps:.0f} GB/s", flush=True)
    return env, described


def run_subprocess(spec: str, path: Path, *, env: dict, described: dict, args) -> dict:
    """One row in a process of its own, its result (or its error) written to `path`."""
    read_gbps = max(described["read_bandwidths_GBps"].values())
    cmd = [sys.executable, __file__, "row", spec, "--read-gbps", str(read_gbps)]
    cmd += ["--call", args.call, "--repeats", str(args.repeats), "--json", str(path)]
    if getattr(args, "tensor_parallel", None) is not None:
        cmd += ["--tensor-parallel", str(args.tensor_parallel)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        # The error's own line (jax may print a note on traceback filtering after it).
        lines = done.stderr.strip().splitlines()
        err = [ln for ln in lines if "Error" in ln and "JAX_TRACEBACK_FILTERING" not in ln]
        err = err[-1:] or lines[-1:] or ["?"]
        failed = {**dataclasses.asdict(Row.parse(spec)), "call": args.call, "error": err[0][:500]}
        path.write_text(json.dumps(failed))
        print(f"{spec}: FAILED ({err[0][:300]})", flush=True)
        return failed
    print("".join(ln + "\n" for ln in done.stderr.splitlines() if ln.startswith("  ")), end="")
    r = json.loads(path.read_text())
    print(
        f"{spec}: step {r['step_ms']:.2f} ms (floor {r['floor_ms']:.2f}, "
        f"{r['pct_floor']:.0f}%), {r['tokens_per_s']:.0f} tok/s, peak {r['peak_gb']:.1f} GB, "
        f"compile {r['compile_s']:.0f} s / {r['programs']} programs, "
        f"recompiled {r['recompiled']} ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    top = list(r["kernels_per_step"].items())[:6]
    print("   " + "; ".join(f"{n[:40]} {v['ms']:.3f} ms x{v['launches']:.0f}" for n, v in top))
    return r


def _file(spec: str, prefix: str = "row") -> str:
    return f"{prefix}_{spec.replace(':', '_').replace('+', '_')}.json"


def group(args) -> None:
    env, described = setup(args)
    t_start = time.perf_counter()
    for spec in args.rows or DEFAULT_ROWS:
        if args.deadline_s and time.perf_counter() - t_start > args.deadline_s:
            print(f"deadline: {spec} not run", flush=True)
            continue
        spec = Row.parse(spec, args.weights).spec
        run_subprocess(spec, args.out / _file(spec), env=env, described=described, args=args)


def predicted_max_batch(row: Row, budget_gb: float) -> int:
    """The largest batch whose weights and KV state fit 92% of the budget (the rest for the
    prefill's working memory, generate.PREFILL_MEMORY_SHARE, and the decode step's)."""
    params = abstract_params(row.config, row.weights)
    one = dataclasses.replace(row, batch=1)
    per_row = kivi_jax.memory_report(cache_of(one, params)).total_bytes
    return max(1, int((0.92 * budget_gb * 1e9 - weight_bytes(params)) // per_row))


def max_batch(args) -> None:
    """For each model, setting, cache and budget: the largest batch whose generate call runs
    with the allocator capped at the budget (XLA_PYTHON_CLIENT_MEM_FRACTION), found by running
    it: from the batch the memory predicts, 15% up while it runs (15% down while it does not),
    then halving the gap to within 4%; the batch that ran and the next one tried that did not.
    With `--batches` (cache -> batches), a cache's batches are tried as given instead (e.g.
    the two an earlier search ended on, measured again beside another cache in one call)."""
    env, described = setup(args)
    card_gb = described["memory_bytes"] / 1e9
    t_start = time.perf_counter()
    for model, setting, kv, budget in (
        (m, st, kv, b) for m in args.models for st in args.settings for kv in args.kvs
        for b in args.budgets
    ):  # fmt: skip
        budget_gb = card_gb * 0.95 if budget == "card" else float(budget)
        spec = Row.parse(f"{model}:{kv}:1:{setting}", args.weights).spec
        given = list(args.batches.get(kv, []))
        batch = given.pop(0) if given else predicted_max_batch(Row.parse(spec), budget_gb)
        env_b = dict(env)
        if card_gb:  # a device that reports its memory (a GPU): the allocator capped
            env_b["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
            env_b["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(budget_gb / card_gb, 0.95):.4f}"
        ran, failed, errors = {}, None, {}
        for _ in range(len(given) + 1 if kv in args.batches else args.tries):
            if args.deadline_s and time.perf_counter() - t_start > args.deadline_s:
                print(f"deadline: {spec} at {budget} GB not finished", flush=True)
                break
            spec_b = dataclasses.replace(Row.parse(spec), batch=batch).spec
            path = args.out / _file(f"{spec_b}:{budget}", prefix="try")
            r = run_subprocess(spec_b, path, env=env_b, described=described, args=args)
            r["budget_gb"] = budget_gb
            path.write_text(json.dumps(r))
            if "error" in r:  # out of memory, as a rule: the entry keeps the message
                failed = batch if failed is None else min(failed, batch)
                errors[batch] = r["error"]
            else:
                ran[batch] = r
            if kv in args.batches:
                if not given:
                    break
                batch = given.pop(0)
            elif failed is None:  # still running: 15% more
                batch = max(batch + 1, round(1.15 * batch))
            elif not ran:  # never ran: 15% fewer
                batch = max(1, min(batch - 1, round(batch / 1.15)))
            elif failed - max(ran) > max(1, round(0.04 * max(ran))):  # bisect to within 4%
                batch = (max(ran) + failed) // 2
            else:
                break
        best = max(ran) if ran else None
        failed = min((b for b in errors if best is None or b > best), default=None)
        tried = sorted([*ran, *errors])
        entry = dict(model=model, kv=kv, budget_gb=budget_gb, prompt=Row.parse(spec).prompt,
                     new_tokens=Row.parse(spec).new_tokens, weights=args.weights,
                     batch=best, failed_batch=failed,
                     call=args.call, tried=tried, failed_error=errors.get(failed))  # fmt: skip
        if best is not None:
            r = ran[best]
            working = r["peak_gb"] - r["weights_gb"] - r["kv_bytes_gb"]
            entry |= dict(tokens_per_s=r["tokens_per_s"], peak_gb=r["peak_gb"],
                          weights_gb=r["weights_gb"], cache_gb=r["kv_bytes_gb"],
                          working_gb=working, step_ms=r["step_ms"])  # fmt: skip
        (args.out / _file(f"{spec}:{budget}", prefix="maxbatch")).write_text(json.dumps(entry))
        print(f"max batch {spec} at {budget_gb:.0f} GB: {best} (failed at {failed})", flush=True)


def merge(args) -> None:
    calls, rows, searches, tries = {}, [], [], []
    for d in args.dirs:
        if d.suffix == ".json":  # an earlier merged result: its calls are kept as they are
            earlier = json.loads(d.read_text())
            calls |= earlier["calls"]
            rows += earlier["rows"]
            searches += earlier["max_batch"]
            tries += earlier["max_batch_tries"]
            continue
        for p in sorted(d.glob("call_*.json")):
            c = json.loads(p.read_text())
            calls[c["call"]] = c
        rows += [json.loads(p.read_text()) for p in sorted(d.glob("row_*.json"))]
        searches += [json.loads(p.read_text()) for p in sorted(d.glob("maxbatch_*.json"))]
        tries += [json.loads(p.read_text()) for p in sorted(d.glob("try_*.json"))]
    if not rows and not searches:
        sys.exit("no rows")
    for r in [*rows, *searches, *tries]:  # files written before rows carried their weights
        r.setdefault("weights", "bf16")
    # A row measured again replaces its earlier measurement (the arguments in order); a failed
    # row stays only where no measurement of it ran.
    latest = {}
    for r in rows:
        key = tuple(r[k] for k in ROW_KEY)
        if "step_ms" in r or "step_ms" not in latest.get(key, {}):
            latest[key] = r
    rows = list(latest.values())
    # A search run again replaces the earlier one, and its tries replace the earlier tries (a
    # try without its budget, as older calls wrote them, goes with any search of its row).
    # Where the later search found no failing batch, a failure of the earlier one above its
    # largest batch stays its failed batch (whether a batch fits the budget does not depend on
    # the unit's speed), named with the call that tried it (`failed_call`), with that try.
    search_key = lambda m, budget: (
        m["model"], m["kv"], budget, m["prompt"], m["new_tokens"], m["weights"]
    )  # fmt: skip
    searched = {}
    for m in searches:
        before = searched.get(key := search_key(m, m["budget_gb"]))
        if (
            before and before["failed_batch"] and m["failed_batch"] is None
            and m["batch"] is not None and before["failed_batch"] > m["batch"]
        ):  # fmt: skip
            m = m | {
                "failed_batch": before["failed_batch"],
                "failed_error": before["failed_error"],
                "failed_call": before.get("failed_call", before["call"]),
            }
        searched[key] = m
    searches = list(searched.values())

    def current(t) -> bool:
        budgets = (
            [t["budget_gb"]] if t.get("budget_gb") is not None
            else [m["budget_gb"] for m in searches]
        )  # fmt: skip
        found = [searched[k] for k in (search_key(t, b) for b in budgets) if k in searched]
        return not found or any(
            t["call"] == m["call"]
            or (t["call"] == m.get("failed_call") and t["batch"] == m["failed_batch"])
            for m in found
        )

    tries = [t for t in tries if current(t)]
    used = {r["call"] for r in [*rows, *searches, *tries]}
    calls = {name: c for name, c in calls.items() if name in used}
    first = next(iter(calls.values()))
    result = {
        "device": first["device"],
        "versions": first["versions"],
        "calls": calls,
        "rows": sorted(
            rows,
            key=lambda r: (r["model"], -r["prompt"], r["batch"], r["weights"], r["kv"], r["call"]),
        ),
        "max_batch": sorted(
            searches, key=lambda r: (r["model"], -r["prompt"], r["weights"], r["budget_gb"])
        ),
        "max_batch_tries": tries,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generate_gpu.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, args.out / "generate_gpu.md")
    if rows:
        plot(result, args.out / "generate_gpu.png")
    if searches:
        plot_max_batch(result, args.out / "generate_gpu_max_batch.png")
    print((args.out / "generate_gpu.md").read_text())


def _full_of(result, r):
    """The full-cache row measured with r in the same call, with the same weights, or None."""
    for f in result["rows"]:
        same = all(
            f[k] == r[k] for k in ("model", "batch", "prompt", "new_tokens", "weights", "call")
        )
        if same and f["kv"] == "full" and "step_ms" in f:
            return f
    return None


def step_split(kernels: dict, weights: str = "bf16") -> dict[str, float]:
    """ms per step of a row's kernels by kind: matmuls (XLA's Triton gemm fusions, cuBLAS, the
    fused quantized-weight kernel), attention (the KIVI score and value kernels, cuDNN) and
    other (the append kernel among it).
    With quantized weights, a separate dequantization kernel (one XLA did not fuse into the
    GEMM: a non-GEMM kernel whose name holds "convert") counts with the matmuls, and is also
    given alone as `dequant` (an upper bound: a norm's convert fusion would count too)."""
    gemm = lambda n: any(k in n for k in ("gemm", "nvjet", "cublas", "splitK", "quantized_"))
    kind = lambda n: (
        "matmuls" if gemm(n)
        else "dequant" if weights != "bf16" and "convert" in n
        else "attention"
        if n.startswith(("kivi_scores", "kivi_values")) or "cudnn" in n or "sdpa" in n
        else "other"
    )  # fmt: skip
    out = dict(matmuls=0.0, dequant=0.0, attention=0.0, other=0.0)
    for name, v in kernels.items():
        out[kind(name)] += v["ms"]
    out["matmuls"] += out["dequant"]
    return out


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# End-to-end decode (`benchmarks/generate_gpu.py`)",
        "",
        f"{result['device']}, jax {result['versions']['jax']}; random weights (bf16, or int8 "
        "per output channel / int4 in groups of 128 with a zero point: kivi_jax.weights); greedy; "
        "decode step = GPU time of generate's decode program / its steps (prefill apart). "
        "Floor: weights read + cache bytes the attention must read at the mean decode context, "
        "over the read bandwidth measured in the same call. `vs full`: decode tokens/s "
        "against the full cache's row of the same call and weights. Weights count in the floor "
        "at their stored bits (int4: half a byte), scales and zero points included.",
        "",
        "| model | weights | kv | batch | prompt + new | step ms | floor ms | % of floor "
        "| tokens/s | vs full | peak GB | compile s | programs | recompiled | call |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        head = (
            f"| {r['model']} | {r['weights']} | {r['kv']} | {r['batch']} "
            f"| {r['prompt']} + {r['new_tokens']} "
        )
        if "error" in r:
            lines.append(head + f"| failed: {r['error'][:80]} |" + " |" * 9)
            continue
        full = _full_of(result, r)
        vs = f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}x" if full and r is not full else ""
        lines.append(
            head + f"| {r['step_ms']:.2f} | {r['floor_ms']:.2f} | {r['pct_floor']:.0f}% "
            f"| {r['tokens_per_s']:.0f} | {vs} | {r['peak_gb']:.1f} | {r['compile_s']:.0f} "
            f"| {r['programs']} | {r['recompiled']} | {r['call']} |"
        )
    lines += [
        "",
        "Where a step's time goes (GPU kernels of one decode step, ms, summed: the weights' "
        "matmuls, the attention kernels, everything else: the cache appends, norms, RoPE, "
        "sampling; `idle` = span minus busy, negative where kernels overlap; with quantized "
        "weights the matmuls include any separate dequantization kernel, also shown alone):",
        "",
        "| model | weights | kv | batch | prompt + new | matmuls | of which dequant | attention "
        "| other | idle | kernels | call |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "kernels_per_step" not in r:
            continue
        split = step_split(r["kernels_per_step"], r["weights"])
        launches = sum(v["launches"] for v in r["kernels_per_step"].values())
        lines.append(
            f"| {r['model']} | {r['weights']} | {r['kv']} | {r['batch']} "
            f"| {r['prompt']} + {r['new_tokens']} | {split['matmuls']:.2f} "
            f"| {split['dequant']:.2f} | {split['attention']:.2f} | {split['other']:.2f} "
            f"| {r['idle_ms_per_step']:.2f} | {launches:.0f} | {r['call']} |"
        )
    if result.get("max_batch"):
        lines += [
            "",
            "Largest batch at a memory budget (`generate_gpu.py max-batch`: the allocator capped "
            "at the budget; `batch` ran, `failed` did not, `-` where no larger batch tried in "
            "that call failed, with the call that tried it where an earlier one did; memory "
            "of the batch that ran, GB; below the table, why the failed batch failed):",
            "",
            "| model | weights | kv | budget GB | prompt + new | batch | failed | tokens/s | peak "
            "| weights GB | cache | working | call |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        failures = []
        for m in result["max_batch"]:

            def f(k, fmt=".1f", m=m):
                return format(m[k], fmt) if isinstance(m.get(k), float) else "-"

            failed = m["failed_batch"] or "-"
            if m.get("failed_call"):
                failed = f"{failed} ({m['failed_call']})"
            lines.append(
                f"| {m['model']} | {m['weights']} | {m['kv']} | {m['budget_gb']:.0f} "
                f"| {m['prompt']} + "
                f"{m['new_tokens']} | {m['batch'] or 'none ran'} | {failed} | "
                f"{f('tokens_per_s', '.0f')} | {f('peak_gb')} | {f('weights_gb')} | "
                f"{f('cache_gb')} | {f('working_gb')} | {m['call']} |"
            )
            if m.get("failed_error"):
                failures.append(
                    f"- {m['model']} {m['kv']} batch {m['failed_batch']}: {m['failed_error']}"
                )
        lines += ["", *failures]
    lines += ["", "The largest kernels of each row (ms per step, launches):", ""]
    for r in result["rows"]:
        if "kernels_per_step" not in r:
            continue
        top = list(r["kernels_per_step"].items())[:8]
        parts = ", ".join(f"{n[:48]} {v['ms']:.3f} (x{v['launches']:.0f})" for n, v in top)
        name = (
            f"{r['model']} {r['weights']} {r['kv']} b{r['batch']} {r['prompt']}+{r['new_tokens']}"
        )
        lines.append(f"- {name}: {parts}")
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "step_ms" in r]
    labels = [
        f"{r['model']}\n{r['kv']} b{r['batch']}\n{r['prompt']}+{r['new_tokens']}\n{r['call']}"
        for r in rows
    ]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 5))
    ax.bar(x - 0.2, [r["step_ms"] for r in rows], 0.4, label="decode step (GPU time)")
    ax.bar(x + 0.2, [r["floor_ms"] for r in rows], 0.4, label="byte floor")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"generate on {result['device']}: decode step against its byte floor")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_max_batch(result: dict, path: Path) -> None:
    """Decode tokens/s against batch per cache and budget, and the memory of each batch split
    into weights, cache and working memory: every generate call of the searches that ran
    (joined by lines), and as squares the table's rows of the same model, cache and setting
    (other calls, the allocator not capped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = lambda r: (r["model"], r["weights"], r["kv"], r["prompt"], r["new_tokens"])
    searched = {key(m) for m in result["max_batch"]}
    fields = ("tokens_per_s", "peak_gb", "weights_gb", "kv_bytes_gb")
    tries = [t for t in result["max_batch_tries"] if all(f in t for f in fields)]
    rows = [r for r in result["rows"] if key(r) in searched and all(f in r for f in fields)]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 6.5))
    for k, budget in sorted({(key(t), t["budget_gb"]) for t in tries}):
        pts = sorted((t["batch"], t["tokens_per_s"]) for t in tries
                     if (key(t), t["budget_gb"]) == (k, budget))  # fmt: skip
        label = f"{k[0]} {k[1]} {k[2]} {k[3]}+{k[4]}, {budget:.0f} GB"
        ax.plot(*zip(*pts, strict=True), "o-", label=label)
    for k in sorted({key(r) for r in rows}):
        pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows if key(r) == k)
        ax.plot(
            *zip(*pts, strict=True), "s", mfc="none", label=f"{k[1]} {k[2]} {k[3]}+{k[4]}, table"
        )
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)  # hides none
    bars = sorted(rows + tries, key=lambda r: (key(r), r["batch"]))
    x = np.arange(len(bars))
    bottom = np.zeros(len(bars))
    for name, field in (("weights", "weights_gb"), ("cache", "kv_bytes_gb")):
        vals = np.array([r[field] for r in bars])
        bx.bar(x, vals, bottom=bottom, label=name)
        bottom += vals
    bx.bar(x, np.array([r["peak_gb"] for r in bars]) - bottom, bottom=bottom, label="working")
    cap = lambda r: f"{r['budget_gb']:.0f} GB" if "budget_gb" in r else "no cap"
    labels = [f"{r['kv']} {r['prompt']}+{r['new_tokens']} b{r['batch']}, {cap(r)}, {r['call']}"
              for r in bars]  # fmt: skip
    bx.set_xticks(x, labels, fontsize=7, rotation=90)
    bx.set_ylabel("GB (peak, split)")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _given_batches(text: str) -> dict[str, list[int]]:
    """--batches: JSON {cache: [batch, ...]}, caches among KV_PRESETS, positive batches."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(given, dict) or not all(
        kv in KV_PRESETS and isinstance(b, list) and b and all(type(x) is int and x > 0 for x in b)
        for kv, b in given.items()
    ):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected {{cache: [batch, ...]}} with caches among {list(KV_PRESETS)} and "
            "non-empty lists of positive ints"
        )
    return given


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("group", help="measure bandwidth, then each row in its own process")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--call", required=True, help="name of this device call (ratios within it)")
    g.add_argument("--rows", nargs="*", help="model:kv:batch:prompt+new (default: all)")
    g.add_argument("--repeats", type=int, default=2)
    g.add_argument("--deadline-s", type=float, default=None, help="start no row after this")
    g.add_argument("--tensor-parallel", type=int, default=None, metavar="N", help="mesh of N")
    g.add_argument("--weights", choices=WEIGHTS, default="bf16", help="of rows naming none")
    mb = sub.add_parser("max-batch", help="the largest batch that fits a memory budget")
    mb.add_argument("--out", type=Path, required=True)
    mb.add_argument("--call", required=True)
    mb.add_argument("--models", nargs="+", default=["Llama-2-7B"], choices=list(MODELS))
    mb.add_argument("--settings", nargs="+", default=["2048+128", "160+338"])
    mb.add_argument("--kvs", nargs="+", default=["full", "kivi2", "kivi4"])
    mb.add_argument("--budgets", nargs="+", default=["80", "card"], help="GB (1e9), or card")
    mb.add_argument("--tries", type=int, default=4, help="generate calls per search")
    mb.add_argument(
        "--batches",
        type=_given_batches,
        default={},
        help="JSON {cache: [batch, ...]}: try these batches of a cache (for every model, "
        "setting and budget), no search; e.g. '{\"full\": [54, 56]}'",
    )
    mb.add_argument("--repeats", type=int, default=1)
    mb.add_argument("--deadline-s", type=float, default=None, help="start no row after this")
    mb.add_argument("--weights", choices=WEIGHTS, default="bf16")
    r = sub.add_parser("row", help="one row, in this process")
    r.add_argument("spec")
    r.add_argument("--read-gbps", type=float, required=True)
    r.add_argument("--call", required=True)
    r.add_argument("--repeats", type=int, default=2)
    r.add_argument("--json", type=Path, required=True)
    r.add_argument("--tensor-parallel", type=int, default=None, metavar="N")
    sub.add_parser("describe", help="print the device, versions and read bandwidths as JSON")
    m = sub.add_parser("merge", help="row files -> generate_gpu.json, .md, .png")
    m.add_argument("dirs", type=Path, nargs="+", help="call folders, or earlier generate_gpu.json")
    m.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.cmd == "group":
        group(args)
    elif args.cmd == "max-batch":
        max_batch(args)
    elif args.cmd == "row":
        out = run_row(Row.parse(args.spec), read_gbps=args.read_gbps, call=args.call,
                      repeats=args.repeats, tensor_parallel=args.tensor_parallel)  # fmt: skip
        args.json.write_text(json.dumps(out, indent=1))
    elif args.cmd == "describe":
        print(json.dumps(describe_device()))
    else:
        merge(args)


if __name__ == "__main__":
    main()
