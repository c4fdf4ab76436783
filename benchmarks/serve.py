"""Serving under load: the continuous-batching engine (kivi_jax.serving.Engine) fed a bounded
stream of requests, for each cache in two layouts of its KV state at one budget of KV bytes
(below), or at the number of slots that fits one memory budget (the engine's own sizing,
`Engine(slots=None, memory_budget=)`: docs/serving.md).

Requests arrive as a Poisson process at each given rate ("inf": all at once, saturation; "seq":
one after another, each sent when the one before has finished), with prompt and output lengths
drawn uniformly from the given ranges with a fixed seed (or read from a JSON file of [prompt,
output] pairs); the run ends when all of them have finished. Per rate: requests/s, output
tokens/s, time to first token and time per output token (p50/p90/p99), the mean number of live
requests (slots holding one), preemptions and peak memory. Per cache and layout, measured in
the same process: the prefill rate (prompt tokens/s of requests run alone) and the decode rate
with every slot live (as many as the pool holds at the mean context; the engine's decode
program, `decode_rate`), from which the saturation throughput is predicted
(`predicted_out_tok_per_s`, the engine spending P/prefill + O/decode seconds per request of P
prompt and O output tokens, the mean lengths); and, at a fixed batch, the engine's decode
tokens/s beside `generate`'s on the same batch (the wall-clock of each one's decode program;
`decode_rate` says why not of requests).

    # the CPU rows of cpu-s62 in benchmarks/results/serve.md (default model, float32; 23
    # minutes on the 2-core CPU shared with other jobs, 12 of them CPU time)
    python benchmarks/serve.py run --model default --kvs kivi2 --slots 4 --max-len 2048 \\
        --requests 16 --rates inf --prompt-range 32 96 --output-range 16 32 --overhead-batch 4 \\
        --shared-requests 8 --prefill-chunk 256 --call cpu-s62 --out DIR
    # a GPU (random bf16 weights of Llama-2-7B's shape): 30 GB of KV state for both layouts;
    # within a device call's 10 minutes, one layout a call into the same DIR (`--layouts slot`,
    # then `--layouts paged --shared-requests 0`)
    python benchmarks/serve.py run --model Llama-2-7B --kvs kivi2 --budget-gb 70 \\
        --kv-bytes-gb 30 --requests 160 --rates 3 inf --seconds 15 --call NAME --out DIR
    python benchmarks/serve.py run --model default --slots 8 --requests 8 --rates seq inf \\
        --prompt-range 32 96 --output-range 64 64 --layouts slot --shared-requests 0 --http \\
        --out DIR    # the CPU, through HTTP too
    python benchmarks/serve.py merge DIR [DIR ...] --out benchmarks/results

Each cache runs in each of two layouts of the engine's KV state at one budget of KV bytes
(`--layouts slot paged`): "slot" is the engine with every slot its max_len tokens of pages
(`kv_bytes=None`: the bytes contiguous slots of max_len reserve, and what they could hold); its
slots are --slots, as many as --kv-bytes-gb holds, or (neither given) as many as the device
holds. "paged" takes exactly the slot layout's KV bytes (`kv_bytes=`) and as many slots as they
hold of the load's mean request (its ring and table, and the pages of its mean prompt + output
tokens) beside the pages of one max_len request, at most --requests: the pool's gain is the
live requests it adds on the same load, preempting when pages run out. `--shared-requests N`
also runs a shared-system-prompt load on the slot layout's engine, prefix sharing off, then on:
N requests at once, one prefix of --shared-prefix tokens followed by distinct suffixes; it
reports the prompt tokens computed, the prefix hit tokens and the time to first token.

`run` measures each cache and layout (and the shared-prefix load) in a process of its own (its
peak memory is its own) and writes DIR/serve_<model>_<kv>_<layout>.json (and
DIR/serve_<model>_<kv>_shared.json); `merge` writes serve.json, serve.md and serve.png (output
tokens/s and p99 time per output token against offered load, one line per cache and layout), a
row measured again in a later DIR replacing the earlier one. On a GPU the models are random bf16
weights of the benchmark shapes (benchmarks/generate_gpu.py's MODELS); "default" is
SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

# one row per key (and device); a later run's row replaces an earlier one
KEY = ("mode", "model", "kv", "layout", "budget_gb", "rate")
SHARED_KEY = ("device", "model", "kv", "sharing")
LAYOUTS = ("slot", "paged")
PLAN_FIELDS = ("slots", "limit_gb", "in_use_gb", "slot_gb", "scratch_gb", "programs_gb",
               "planned_gb")  # fmt: skip


def percentile(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else float("nan")


def workload(n: int, rate: float, prompt_range, output_range, seed: int, lengths_file=None):
    """[(arrival_s, prompt_len, output_len)] of n requests: Poisson arrivals at `rate` per
    second (inf, and 0 for one after another: all at 0), lengths uniform in the closed ranges or
    read from a file."""
    rng = np.random.default_rng(seed)
    if lengths_file:
        pairs = json.loads(Path(lengths_file).read_text())[:n]
        if len(pairs) < n:
            raise ValueError(f"{lengths_file} holds {len(pairs)} requests, {n} asked for")
        prompts, outputs = (np.array(x) for x in zip(*pairs, strict=True))
    else:
        prompts = rng.integers(prompt_range[0], prompt_range[1] + 1, n)
        outputs = rng.integers(output_range[0], output_range[1] + 1, n)
    gaps = np.zeros(n) if rate in (0, math.inf) else rng.exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    return [(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs, strict=True)]


def load(model: str, max_len: int):
    """(params, vocab, tokenizer) of the default model, or random bf16 weights of a benchmark
    shape (no tokenizer)."""
    import jax
    import jax.numpy as jnp
    from generate_gpu import MODELS, random_params
    from kivi_jax.models.config import LlamaConfig

    import kivi_jax

    if model == "default":  # float32 on the CPU, as kivi-generate's --dtype auto
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
        m = kivi_jax.load_model(dtype=dtype)
        return m.params, m.params.config.vocab_size, m.tokenizer
    # a context past the slots' max_len: the engine pads prompts to a PROMPT_BUCKET multiple
    config = LlamaConfig(**MODELS[model], max_context=max_len + 128)
    return random_params(config, jax.random.key(0)), config.vocab_size, None


def max_len_of(args) -> int:
    """Tokens a request may hold: --max-len, else the longest prompt + output the load draws."""
    longest = args.prompt_range[1] + args.output_range[1]
    if args.max_len is None:
        return longest
    if args.max_len < longest:
        raise ValueError(f"--max-len {args.max_len} is below the load's longest request "
                         f"({args.prompt_range[1]} + {args.output_range[1]} tokens)")  # fmt: skip
    return args.max_len


@dataclasses.dataclass(frozen=True)
class Size:
    """An engine's slots and kv_bytes (None: every slot's max_len tokens of pages)."""

    slots: int | None
    kv_bytes: int | None


def size_of(args, params, max_len: int, layout: str) -> Size:
    """The layout's engine at the budget of KV bytes both layouts share (the module's
    docstring). One slot's part and one page are an engine's of one slot (nothing allocated)."""
    from kivi_jax.serving import Engine

    if args.slots is not None and args.kv_bytes_gb is not None:
        raise ValueError("--slots and --kv-bytes-gb both size the slot layout: give one")
    one = Engine(params, kv=args.kv, slots=1, max_len=max_len, page_size=args.page_size)
    st = one.stats()
    part, page = st.kv_slot_bytes, st.kv_pool_bytes // st.pages_total
    reserved = part + st.pages_total * page  # a slot of max_len tokens
    slots = args.slots
    if args.kv_bytes_gb is not None:
        slots = int(args.kv_bytes_gb * 1e9) // reserved
        if slots < 1:
            raise ValueError(f"--kv-bytes-gb {args.kv_bytes_gb}: one slot of max_len={max_len} "
                             f"takes {reserved / 1e9:.4f} GB")  # fmt: skip
    if layout == "slot":
        return Size(slots, None)  # slots None: as many as the device holds
    if slots is None:
        raise ValueError("the paged layout takes the slot layout's KV bytes: give --slots or "
                         "--kv-bytes-gb (not the device's whole memory)")  # fmt: skip
    mean = int(sum(args.prompt_range) / 2 + sum(args.output_range) / 2)
    held = part + one._pages.pages_for(mean) * page  # a slot of the mean request
    # beside the pages of one max_len request: the least pool an engine takes
    fits = (slots * reserved - st.pages_total * page) // held
    return Size(min(args.requests, fits), slots * reserved)


def fit_of(engine, layout: str) -> dict:
    """The engine's layout, memory plan (kivi_jax.serving.sizing.MemoryPlan, bytes on one
    device) and what compiling its programs cost, for the result rows."""
    plan, st = engine.memory_plan, engine.stats()
    return dict(
        layout=layout,
        slots=engine.slots,
        prefill_chunk=engine.prefill_chunk,
        prefill_budget=engine.prefill_budget,
        pages=st.pages_total,
        kv_gb=(st.kv_slot_bytes + st.kv_pool_bytes) / 1e9,
        max_len=engine.max_len,
        limit_gb=None if plan.limit is None else plan.limit / 1e9,
        in_use_gb=plan.in_use / 1e9,
        slot_gb=plan.slot / 1e9,
        scratch_gb=plan.scratch / 1e9,
        programs_gb=plan.programs / 1e9,
        planned_gb=plan.needed / 1e9,
        programs=len(engine.programs),
        compile_s=sum(p.compile_s for p in engine.programs),
    )


def peak_gb() -> float:
    """Peak device memory (a GPU's allocator), or this process's peak resident set (the CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class LiveSlots:
    """Samples the engine's live slots every `every` seconds in a thread, for their mean."""

    def __init__(self, engine, every: float = 0.05):
        self.engine, self.every, self.samples = engine, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.every):
            self.samples.append(self.engine.stats().live_slots)

    def mean(self) -> float:
        self._stop.set()
        self._thread.join()
        return float(np.mean(self.samples)) if self.samples else 0.0


def requests_at(args, rate: float) -> int:
    """Requests sent at `rate`: --requests, or at a finite rate with --seconds that rate's
    arrivals over that many seconds (at most --requests)."""
    if args.seconds is None or rate in (0, math.inf):
        return args.requests
    return min(args.requests, math.ceil(rate * args.seconds))


def prompt(rng, vocab: int, n: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


def prompts_of(requests, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts of the requests' lengths."""
    rng = np.random.default_rng(seed + 1)
    return [prompt(rng, vocab, p) for _, p, _ in requests]


def shared_workload(args, vocab: int) -> tuple[list, list[list[int]]]:
    """The shared-system-prompt load: --shared-requests requests at once, each one prefix of
    --shared-prefix tokens + a suffix of its own (lengths uniform in --shared-suffix-range),
    outputs in --output-range. Returns (requests, prompts) as workload and prompts_of do."""
    rng = np.random.default_rng(args.seed + 4)
    n, lo, hi = args.shared_requests, *args.shared_suffix_range
    prefix = prompt(rng, vocab, args.shared_prefix)
    prompts = [prefix + prompt(rng, vocab, int(k)) for k in rng.integers(lo, hi + 1, n)]
    outs = rng.integers(args.output_range[0], args.output_range[1] + 1, n)
    return [(0.0, len(p), int(o)) for p, o in zip(prompts, outs, strict=True)], prompts


def run_load(engine, requests, prompts, timeout_s: float, *, sequential=False):
    """Submits the requests' prompts at their arrival times (`sequential`: each once the one
    before has finished) to the running engine, waits for all of them, and returns the rate's
    measures: those of `measures`, and the preemptions and prefill work done meanwhile."""
    from kivi_jax.generate import Sampling

    before = engine.stats()
    live = LiveSlots(engine)
    handles, t0 = [], time.perf_counter()
    for (arrival, _, out), ids in zip(requests, prompts, strict=True):
        delay = t0 + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        handles.append(engine.submit(ids, Sampling(), max_new_tokens=out))
        if sequential:
            handles[-1].result(timeout=timeout_s)
    deadline = t0 + timeout_s
    for h in handles:
        h.result(timeout=max(1.0, deadline - time.perf_counter()))
    done = [(h.submit_time, h.first_token_time, h.finish_time, len(h.result())) for h in handles]
    return measures(done, t0, live.mean()) | work(before, engine.stats())


def work(before, after) -> dict:
    """What the engine did between two EngineStats: preemptions and prompt work."""
    fields = ("preemptions", "prompt_tokens", "prompt_tokens_computed", "prefix_hit_tokens",
              "prefill_calls")  # fmt: skip
    return {f: getattr(after, f) - getattr(before, f) for f in fields}


def measures(done, t0: float, live_slots: float) -> dict:
    """A rate's measures from each request's (sent, first token, finish, output tokens)."""
    wall = max(f for _, _, f, _ in done) - t0
    outs = [n for *_, n in done]
    ttft = [(first - sent) * 1e3 for sent, first, _, _ in done]
    tpot = [(f - first) * 1e3 / (n - 1) for _, first, f, n in done if n > 1]
    return dict(
        requests=len(done),
        req_per_s=len(done) / wall,
        out_tok_per_s=sum(outs) / wall,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot, 50),
        tpot_p90_ms=percentile(tpot, 90),
        tpot_p99_ms=percentile(tpot, 99),
        mean_live_slots=live_slots,
        wall_s=wall,
    )


def step_until(engine, done) -> None:
    while not done():
        engine.step()


def prefill_rate(engine, vocab: int, length: int, n: int, seed: int) -> float:
    """Prompt tokens/s of n requests of `length` tokens run one at a time (one output token:
    the prefill and its first token)."""
    from kivi_jax.generate import Sampling

    rng = np.random.default_rng(seed + 2)
    t0 = time.perf_counter()
    for _ in range(n):
        h = engine.submit(prompt(rng, vocab, length), Sampling(), max_new_tokens=1)
        step_until(engine, lambda h=h: h.done)
    return n * length / (time.perf_counter() - t0)


def _occupied(state, live: int, length: int):
    """An engine's state with slots [0, live) decoding at `length` tokens of context and the
    rest free, in the state's own shardings (so its compiled decode program takes it). The
    caches' contents stay as they are: the program's time does not depend on the values."""
    import jax
    import jax.numpy as jnp

    def fill(state):
        active = jnp.arange(state.active.shape[0]) < live
        lengths = jnp.where(active, length, 0).astype(jnp.int32)
        caches = tuple(dataclasses.replace(c, lengths=lengths) for c in state.caches)
        return dataclasses.replace(
            state, caches=caches, active=active, count=jnp.zeros_like(state.count),
            limit=jnp.full_like(state.limit, 1 << 30),
        )  # fmt: skip

    where = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(fill, out_shardings=where, donate_argnums=0)(state)


def decode_span(engine, length: int, calls: int = 6) -> int:
    """The tokens decode_rate's slots reach: `calls` timed calls, a first one and a spare."""
    return length + (calls + 2) * engine.decode_steps


def pool_holds(engine, length: int) -> int:
    """Slots that decode_rate can make live at `length` tokens of context: the engine's, or as
    many as its pool holds (a paged layout's pool holds fewer slots of a long context)."""
    pages = engine._pages
    return min(engine.slots, pages.total // pages.pages_for(decode_span(engine, length)))


def decode_rate(engine, *, live: int, length: int, calls: int = 6, trace: dict | None = None):
    """Decode tokens/s of the engine's own decode program (the one its scheduler calls, of
    `decode_steps` steps) with `live` of its slots decoding at `length` tokens of context:
    the wall-clock of `calls` calls after a first one, on the engine's state with those slots
    made active in place, each given its own pages (benchmark-only access to the engine's
    state and pool; the slots freed again after).
    Real requests cannot measure this: admitting S prompts of `length` tokens takes S or more
    scheduler steps, during which the first ones decode and finish, so a wall-clock over
    requests never has every slot live (docs/serving.md). `trace` (a dict), on
    a GPU, gets the kernels of one call summed by name and its GPU span."""
    import jax
    from timing import gpu_kernels, kernel_totals, span_seconds, split_runs

    from kivi_jax.serving import programs

    engine._allocate()
    pages = engine._pages
    if any(o is not None for o in engine._occupant) or engine.prefix_sharing:
        raise ValueError("decode_rate takes an idle engine without prefix sharing")
    span = decode_span(engine, length, calls)
    for s in range(live):
        if pages.missing(s, span) > pages.free(pages.shard(s)):
            raise ValueError(f"the pool holds no {live} slots of {span} tokens")
        pages.grow(s, span)  # each slot its own pages, from its shard's free list
    table = pages.table.copy()

    def call(state, pool):  # the program the engine runs for slots [0, live)
        return programs.decode(
            engine.params, state, pool, table, steps=engine.decode_steps, sampled=False,
            extras=False, layout=engine._layout, rows=engine._rows_for(live),
        )[:3]  # fmt: skip

    state, pool = _occupied(engine._state, live, length), engine._pool
    try:
        state, pool, out = call(state, pool)  # compiled by warmup(): this one runs it once
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(calls):
            state, pool, out = call(state, pool)
        jax.block_until_ready(out)
        seconds = (time.perf_counter() - t0) / calls
        if trace is not None and jax.default_backend() == "gpu":
            import tempfile

            with tempfile.TemporaryDirectory() as d:
                with jax.profiler.trace(d):
                    state, pool, out = call(state, pool)
                    jax.block_until_ready(out)
                runs = split_runs(gpu_kernels(d))
            if runs:
                # the longest run is the decode program's (the table's copy to the device and
                # the state's set-up come before it as runs of their own)
                run = max(runs, key=span_seconds)
                totals = list(kernel_totals(run).items())[:20]
                trace.update(span_ms=span_seconds(run) * 1e3, live=live, length=length,
                             kernels={n: [c, t * 1e3] for n, (c, t) in totals})  # fmt: skip
    finally:
        engine._pool = pool
        engine._state = _occupied(state, 0, 0)
        for s in range(live):
            pages.release(s)
    return live * engine.decode_steps / seconds


def generate_decode_rate(params, vocab: int, kv: str, *, batch: int, length: int, new: int,
                         seed: int) -> float:  # fmt: skip
    """`generate`'s decode tokens/s on the same batch: its decode program (every step after the
    first token) timed alone, after a first call that compiles both programs."""
    import jax
    import jax.numpy as jnp

    from kivi_jax.generate import Sampling, _decode_jit, _prepare, _program_args, _start_jit

    rng = np.random.default_rng(seed + 3)
    ids = np.asarray([prompt(rng, vocab, length) for _ in range(batch)], np.int32)
    sampling = Sampling()
    for _ in range(2):  # the first call compiles; the second is timed
        tokens, lengths, cache, rows = _prepare(
            params, ids, None, kv=kv, max_new_tokens=new, sampling=sampling
        )
        per_row, start_kw, decode_kw = _program_args(sampling, batch, new)
        state = _start_jit(params, tokens, lengths, cache, per_row, **start_kw, prefill_rows=rows)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        jax.block_until_ready(_decode_jit(params, state, jnp.int32(new), **decode_kw))
        elapsed = time.perf_counter() - t0
    return batch * (new - 1) / elapsed


def _row(args, mode: str, rate: float, m: dict, fit: dict, rates: dict) -> dict:
    row = dict(mode=mode, model=args.model, kv=args.kv, budget_gb=args.budget_gb,
               rate=_rate_label(rate), **m, **rates, peak_gb=peak_gb(),
               call=args.call, page_size=args.page_size, **fit)  # fmt: skip
    print(f"  {fit['layout']} {mode} rate {rate}: {m['out_tok_per_s']:.0f} out tok/s, TTFT p99 "
          f"{m['ttft_p99_ms']:.0f} ms, TPOT p99 {m['tpot_p99_ms']:.1f} ms, "
          f"{m['mean_live_slots']:.1f} live requests, {m['preemptions']} preemptions",
          file=sys.stderr, flush=True)  # fmt: skip
    return row


def new_engine(args, params, max_len: int, size: Size, prefix_sharing=False):
    from kivi_jax.serving import Engine

    return Engine(
        params, kv=args.kv, slots=size.slots, max_len=max_len, kv_bytes=size.kv_bytes,
        page_size=args.page_size, prefix_sharing=prefix_sharing,
        prefill_chunk=args.prefill_chunk, prefill_budget=args.prefill_budget,
        max_queue=1 << 20, memory_budget=int(args.budget_gb * 1e9),
    )  # fmt: skip


def measure_kv(args, layout: str, save=None) -> dict:
    """Every measure of one cache in one layout (in this process). The engine runs without an
    EOS, so every request produces its drawn number of tokens. `save(result)`, if given, is
    called with the result so far after each rate (a run cut short keeps the rows it
    measured). The fixed-batch comparison with `generate` runs in the first of --layouts."""
    import jax

    max_len = max_len_of(args)
    params, vocab, tokenizer = load(args.model, max_len)
    if args.http and tokenizer is None:
        raise ValueError(f"--http needs a model with a tokenizer ('default'), not {args.model}")
    size = size_of(args, params, max_len, layout)

    mean_p = sum(args.prompt_range) / 2
    mean_o = sum(args.output_range) / 2
    overhead_batch = args.overhead_batch if layout == args.layouts[0] else 0
    if overhead_batch:  # first: its programs compile and run while the device is free
        b, length, new = overhead_batch, int(mean_p), int(mean_o)
        gen = generate_decode_rate(
            params, vocab, args.kv, batch=b, length=length, new=new, seed=args.seed
        )
    t0 = time.perf_counter()
    engine = new_engine(args, params, max_len, size)  # slots None: as many as fit the device
    engine.warmup()
    warmup_s = time.perf_counter() - t0
    fit = fit_of(engine, layout)
    slots = engine.slots
    print(f"{args.model} {args.kv} {layout}: {engine.memory_plan.describe()}; {fit['pages']} "
          f"pages, KV {fit['kv_gb']:.3f} GB; {fit['programs']} programs compiled in "
          f"{fit['compile_s']:.0f} s (warmup {warmup_s:.0f} s)", file=sys.stderr,
          flush=True)  # fmt: skip
    for cost in engine.programs:
        print(f"  {cost.name}: {cost.compile_s:.1f} s, temporaries {cost.temp_bytes / 1e6:.0f} MB",
              file=sys.stderr, flush=True)  # fmt: skip
    prefill = prefill_rate(engine, vocab, int(mean_p), n=args.prefill_requests, seed=args.seed)
    trace: dict = {}
    context = int(mean_p + mean_o / 2)
    live = pool_holds(engine, context)
    decode = decode_rate(engine, live=live, length=context, trace=trace)
    for name, (n, ms) in list(trace.get("kernels", {}).items())[:8]:
        print(f"  decode step kernels: {name[:60]} x{n} {ms:.2f} ms", file=sys.stderr, flush=True)
    rates = dict(
        predicted_out_tok_per_s=mean_o / (mean_p / prefill + mean_o / decode),
        prefill_tok_per_s=prefill,
        decode_tok_per_s=decode,
        decode_live=live,
    )
    print(f"  prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s at {live} live of {slots} "
          f"slots, predicted {rates['predicted_out_tok_per_s']:.0f} out tok/s", file=sys.stderr,
          flush=True)  # fmt: skip
    overhead = None
    if overhead_batch and overhead_batch > pool_holds(engine, length + new // 2):
        print(f"  overhead: batch {b} > the slots the engine holds, not measured",
              file=sys.stderr)  # fmt: skip
    elif overhead_batch:
        eng = decode_rate(engine, live=b, length=length + new // 2)
        overhead = dict(batch=b, prompt=length, new_tokens=new, engine_decode_tok_per_s=eng,
                        generate_decode_tok_per_s=gen, engine_vs_generate=eng / gen,
                        layout=layout)  # fmt: skip
        print(f"  overhead at batch {b}: engine {eng:.0f}, generate {gen:.0f} tok/s",
              file=sys.stderr, flush=True)  # fmt: skip
    rows = []
    workloads = {
        rate: workload(
            requests_at(args, rate),
            rate,
            args.prompt_range,
            args.output_range,
            args.seed,
            args.lengths,
        )
        for rate in args.rates
    }
    programs = [dataclasses.asdict(cost) for cost in engine.programs]
    result = dict(rows=rows, overhead=overhead, device=jax.devices()[0].device_kind,
                  programs=programs, warmup_s=warmup_s, decode_trace=trace)  # fmt: skip
    with engine:
        for rate, reqs in workloads.items():
            m = run_load(engine, reqs, prompts_of(reqs, vocab, args.seed),
                         timeout_s=args.timeout_s, sequential=rate == 0)  # fmt: skip
            rows.append(_row(args, "engine", rate, m, fit, rates))
            if save is not None:
                save(result)
    if args.http:  # the same loads through kivi-serve's app (a new engine: programs cached)
        del engine
        with HttpServer(new_engine(args, params, max_len, size), tokenizer, max_len) as server:
            for rate, reqs in workloads.items():
                m = run_load_http(server, reqs, prompts_of(reqs, vocab, args.seed),
                                  timeout_s=args.timeout_s, sequential=rate == 0)  # fmt: skip
                rows.append(_row(args, "http", rate, m, fit, rates))
                if save is not None:
                    save(result)
    return result


def measure_shared(args, save=None) -> dict:
    """The shared-system-prompt load (shared_workload) on the slot layout's engine, prefix
    sharing off, then on (a second engine: its programs but one are the first's, compiled)."""
    import jax

    max_len = max_len_of(args)
    params, vocab, _ = load(args.model, max_len)
    reqs, prompts = shared_workload(args, vocab)
    longest = max(p for _, p, _ in reqs) + args.output_range[1]
    if longest > max_len:
        raise ValueError(f"a shared-prefix request holds up to {longest} tokens, over max_len "
                         f"{max_len} (--max-len, or a shorter --shared-prefix)")  # fmt: skip
    size = size_of(args, params, max_len, "slot")
    rows = []
    result = dict(shared=rows, device=jax.devices()[0].device_kind)
    for sharing in (False, True):
        engine = new_engine(args, params, max_len, size, prefix_sharing=sharing)
        engine.warmup()
        with engine:
            m = run_load(engine, reqs, prompts, timeout_s=args.timeout_s)
        rows.append(dict(
            model=args.model, kv=args.kv, layout="slot", slots=engine.slots,
            kv_gb=fit_of(engine, "slot")["kv_gb"], sharing=sharing, prefix=args.shared_prefix,
            suffix_range=list(args.shared_suffix_range), output_range=list(args.output_range),
            page_size=args.page_size, prefill_chunk=args.prefill_chunk, call=args.call, **m,
        ))  # fmt: skip
        print(f"  shared prefix, sharing {'on' if sharing else 'off'}: "
              f"{m['prompt_tokens_computed']} of {m['prompt_tokens']} prompt tokens computed, "
              f"{m['prefix_hit_tokens']} hit; TTFT p50 {m['ttft_p50_ms']:.0f} ms, p99 "
              f"{m['ttft_p99_ms']:.0f} ms", file=sys.stderr, flush=True)  # fmt: skip
        del engine
        if save is not None:
            save(result)
    return result


class HttpServer:
    """kivi-serve's app (kivi_jax.serving.server.create_app) under uvicorn in a thread, on a
    free loopback port; `with` waits until /health answers 200 (warmup done, engine started)."""

    def __init__(self, engine, tokenizer, max_len: int):
        import socket

        import uvicorn

        from kivi_jax.serving.server import create_app

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.engine = engine
        app = create_app(engine, tokenizer, model_name="bench", max_len=max_len)
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        import urllib.error
        import urllib.request

        self.thread.start()
        end = time.monotonic() + 1800
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.5)
        raise TimeoutError("the server did not become healthy")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(60)


def _stream(base: str, ids: list[int], out: int, timeout_s: float) -> tuple[float, float, int]:
    """One streamed completion: (first token time, finish time, completion tokens)."""
    import urllib.request

    body = dict(model="bench", prompt=ids, max_tokens=out, temperature=0.0, stream=True,
                stream_options={"include_usage": True})  # fmt: skip
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    first, tokens = None, 0
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, time.perf_counter(), tokens


def run_load_http(server: HttpServer, requests, prompts, timeout_s: float, *,
                  sequential=False) -> dict:  # fmt: skip
    """run_load through the HTTP server: each request a streamed completion from a thread of
    its own, sent at its arrival time (`sequential`: one after another)."""
    from concurrent.futures import ThreadPoolExecutor

    before = server.engine.stats()
    live = LiveSlots(server.engine)
    t0 = time.perf_counter()

    def one(i):
        arrival, _, out = requests[i]
        delay = t0 + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sent = time.perf_counter()
        return (sent, *_stream(server.base, prompts[i], out, timeout_s))

    with ThreadPoolExecutor(max_workers=1 if sequential else len(requests)) as pool:
        done = list(pool.map(one, range(len(requests))))
    done = [(s, f, e, n) for s, f, e, n in done]
    return measures(done, t0, live.mean()) | work(before, server.engine.stats())


def versions() -> dict:
    import flax
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__}


def _one(args, kv: str, layout: str, path: Path) -> None:
    """measure_kv (or measure_shared, layout "shared") in a process of its own (spawned: its
    device memory is its own). The run's processes share their compiled programs through JAX's
    persistent cache in DIR/xla: a program of the same shapes compiles once a run (the prompt
    programs of both layouts, the shared-prefix load's all but one)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(args.out / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    args.kv = kv
    head = dict(model=args.model, kv=kv, layout=layout, call=args.call, versions=versions())
    save = lambda result: path.write_text(json.dumps(head | result, indent=1))
    save(measure_shared(args, save) if layout == "shared" else measure_kv(args, layout, save))


def run(args) -> None:
    import multiprocessing

    # Inherited by the spawned processes: XLA's allocator takes one region of 95% of the card
    # (the budget then limits the engine). Grown on demand instead (PREALLOCATE=false), its
    # regions are separate allocations that free memory cannot merge across: an H100 engine
    # planned 0.16 GB under the limit found no 6-25 MB for its decode temporaries and retried
    # every 10 s (docs/serving.md).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    args.out.mkdir(parents=True, exist_ok=True)
    spawn = multiprocessing.get_context("spawn")
    shared = ["shared"] if args.shared_requests else []
    for kv in args.kvs:
        for layout in [*args.layouts, *shared]:
            t0 = time.perf_counter()
            path = args.out / f"serve_{args.model}_{kv}_{layout}.json"
            proc = spawn.Process(target=_one, args=(args, kv, layout, path))
            proc.start()
            proc.join()
            status = f"FAILED (exit {proc.exitcode})" if proc.exitcode else "done"
            print(f"{args.model} {kv} {layout}: {status} in {time.perf_counter() - t0:.0f} s",
                  flush=True)  # fmt: skip


def _replace(old: list, new: list, key) -> list:
    """`old` without the entries whose key one of `new` has, then `new`."""
    keys = {key(x) for x in new}
    return [x for x in old if key(x) not in keys] + new


def merge(args) -> None:
    """serve.{json,md,png} from the runs' files, a later run's row replacing an earlier one."""
    path = args.out / "serve.json"
    merged = json.loads(path.read_text()) if path.exists() else {"rows": [], "overhead": []}
    for entry in merged["rows"] + merged["overhead"] + merged.get("compile", []):
        # rows measured before the page pool (kivi_jax/paged.py) name no layout: their slots
        # were contiguous, max_len tokens each
        entry.setdefault("layout", "contiguous")
    by = lambda *fields: lambda x: tuple(x[k] for k in fields)
    for d in args.dirs:
        for f in sorted(Path(d).glob("serve_*.json")):
            r = json.loads(f.read_text())
            which = dict(device=r["device"], model=r["model"], kv=r["kv"], call=r["call"])
            rows = [dict(row, device=r["device"]) for row in r.get("rows", [])]
            merged["rows"] = _replace(merged["rows"], rows, by(*KEY, "device"))
            shared = [dict(row, device=r["device"]) for row in r.get("shared", [])]
            merged["shared"] = _replace(merged.get("shared", []), shared, by(*SHARED_KEY))
            if r.get("overhead"):
                o = dict(r["overhead"], **which)
                merged["overhead"] = _replace(merged["overhead"], [o],
                                              by("model", "kv", "layout", "device"))  # fmt: skip
            if r.get("programs") and rows:
                plan = {k: rows[0][k] for k in PLAN_FIELDS}
                c = dict(which, layout=r["layout"], warmup_s=r["warmup_s"],
                         programs=r["programs"], **plan)  # fmt: skip
                merged["compile"] = _replace(merged.get("compile", []), [c],
                                             by("model", "kv", "layout", "device"))  # fmt: skip
            merged["versions"] = r["versions"]
    rate_key = lambda x: _rate(str(x["rate"]))
    merged["rows"].sort(key=lambda x: (x["device"], x["model"], x["kv"], x["layout"],
                                       rate_key(x)))  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=1))
    (args.out / "serve.md").write_text(markdown(merged))
    plot(merged, args.out / "serve.png")


def markdown(result: dict) -> str:
    lines = [
        "# Serving under load (benchmarks/serve.py)",
        "",
        f"Versions: {result.get('versions')}. Rows of one model and device come from one call.",
        "",
        "Layouts at one budget of KV bytes (`KV GB`, the slots' parts and the pool): `slot`, "
        "every slot its max_len tokens of pages (what contiguous slots reserve); `paged`, the "
        "same bytes shared by more slots, pages taken as tokens arrive; `contiguous`, rows "
        "measured before the page pool. Live requests: the mean over the run of the slots "
        "holding one.",
        "",
        "| device | mode | model | kv | layout | slots | pages | KV GB | budget GB "
        "| rate (req/s) | requests | req/s | out tok/s | predicted | TTFT p50 / p99 ms "
        "| TPOT p50 / p99 ms | live requests | preempted | peak GB | call |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['device']} | {r['mode']} | {r['model']} | {r['kv']} | {r['layout']} "
            f"| {r['slots']} | {_cell(r, 'pages', 'd')} | {_cell(r, 'kv_gb', '.3g')} "
            f"| {r['budget_gb']:g} | {r['rate']} | {r['requests']} | {r['req_per_s']:.2f} "
            f"| {r['out_tok_per_s']:.0f} | {r['predicted_out_tok_per_s']:.0f} "
            f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
            f"| {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | {r['mean_live_slots']:.1f} "
            f"| {_cell(r, 'preemptions', 'd')} | {r['peak_gb']:.1f} | {r['call']} |"
        )
    if result.get("shared"):
        lines += [
            "",
            "A shared system prompt: the requests submitted at once, each one prefix + a "
            "suffix of its own, on the slot layout's engine with prefix sharing off and on. "
            "Computed: prompt tokens run through the model; hits: prompt tokens read from "
            "another request's sealed pages instead.",
            "",
            "| device | model | kv | slots | requests | prefix + suffix | sharing "
            "| prompt tokens | computed | hits | prefill calls | TTFT p50 / p99 ms | out tok/s "
            "| call |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result["shared"]:
            lo, hi = r["suffix_range"]
            lines.append(
                f"| {r['device']} | {r['model']} | {r['kv']} | {r['slots']} | {r['requests']} "
                f"| {r['prefix']} + {lo}-{hi} | {'on' if r['sharing'] else 'off'} "
                f"| {r['prompt_tokens']} | {r['prompt_tokens_computed']} "
                f"| {r['prefix_hit_tokens']} | {r['prefill_calls']} "
                f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['out_tok_per_s']:.0f} "
                f"| {r['call']} |"
            )
    if result.get("overhead"):
        lines += [
            "",
            "The engine's own overhead: decode tokens/s at a fixed batch (the wall-clock of each "
            "one's decode program, same process; the engine at its full slot count, `batch` of "
            "them live at the mean context; generate measured first, before the engine "
            "allocates).",
            "",
            "| device | model | kv | layout | batch | prompt + new | engine tok/s "
            "| generate tok/s | engine / generate | call |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for o in result["overhead"]:
            lines.append(
                f"| {o['device']} | {o['model']} | {o['kv']} | {o['layout']} | {o['batch']} "
                f"| {o['prompt']} + {o['new_tokens']} | {o['engine_decode_tok_per_s']:.0f} "
                f"| {o['generate_decode_tok_per_s']:.0f} | {o['engine_vs_generate']:.2f} "
                f"| {o['call']} |"
            )
    if result.get("compile"):
        lines += [
            "",
            "The engine's memory plan (GB on the device: the limit is the smaller of the budget "
            "and the allocator's) and its programs, compiled by warmup() before the state is "
            "allocated; peak is the allocator's over the whole run.",
            "",
            "| device | model | kv | layout | slots | limit | in use | slot | scratch "
            "| programs' temps | planned | programs | compile s | slowest | call |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in result["compile"]:
            slow = max(c["programs"], key=lambda p: p["compile_s"])
            lines.append(
                f"| {c['device']} | {c['model']} | {c['kv']} | {c['layout']} | {c['slots']} "
                f"| {_cell(c, 'limit_gb', '.1f')} | {c['in_use_gb']:.1f} | {c['slot_gb']:.3f} "
                f"| {c['scratch_gb']:.2f} | {c['programs_gb']:.2f} | {c['planned_gb']:.1f} "
                f"| {len(c['programs'])} | {sum(p['compile_s'] for p in c['programs']):.0f} "
                f"| {slow['name']} {slow['compile_s']:.0f} s | {c['call']} |"
            )
    return "\n".join(lines) + "\n"


def _cell(row: dict, field: str, spec: str) -> str:
    """A table cell: the row's field in `spec`, "-" where the row has none (older rows)."""
    value = row.get(field)
    return "-" if value is None else format(value, spec)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["device"], r["model"], r["mode"]) for r in result["rows"]})
    fig, axes = plt.subplots(2, max(len(groups), 1), figsize=(5 * max(len(groups), 1), 7),
                             squeeze=False)  # fmt: skip
    for j, (device, model, mode) in enumerate(groups):
        rows = [r for r in result["rows"] if (r["device"], r["model"], r["mode"]) == (
            device, model, mode)]  # fmt: skip
        finite = [float(r["rate"]) for r in rows if r["rate"] not in ("inf", "seq")]
        inf_at = 2 * max(finite) if finite else 1.0  # saturation drawn right of the others
        where = lambda r, inf_at=inf_at: inf_at if r["rate"] == "inf" else _rate(str(r["rate"]))
        for kv, layout in sorted({(r["kv"], r["layout"]) for r in rows}):
            mine = sorted((r for r in rows if (r["kv"], r["layout"]) == (kv, layout)), key=where)
            x = [where(r) for r in mine]
            label = f"{kv}, {layout} ({mine[0]['slots']} slots)"
            axes[0, j].plot(x, [r["out_tok_per_s"] for r in mine], "o-", label=label)
            axes[1, j].plot(x, [r["tpot_p99_ms"] for r in mine], "o-", label=label)
        axes[0, j].set_title(f"{model}, {mode} ({device})", fontsize=9)
        axes[0, j].set_ylabel("output tokens/s")
        axes[1, j].set_ylabel("p99 time per output token (ms)")
        axes[1, j].set_xlabel(
            f"offered load (requests/s; one after another at 0, all at once at {inf_at:g})"
        )
        axes[0, j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rate(text: str) -> float:
    """A --rates value: requests/s, "inf" (all at once) or "seq" (one after another, as 0)."""
    return {"inf": math.inf, "seq": 0.0}.get(text) if text in ("inf", "seq") else float(text)


def _rate_label(rate: float):
    return "inf" if math.isinf(rate) else "seq" if rate == 0 else rate


def main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("run")
    q.add_argument("--model", default="Llama-2-7B")
    q.add_argument("--budget-gb", type=float, default=80.0)
    q.add_argument("--rates", type=_rate, nargs="+", default=[1.0, 2.0, 4.0, math.inf])
    q.add_argument("--requests", type=int, default=200)
    q.add_argument("--prompt-range", type=int, nargs=2, default=[512, 2048])
    q.add_argument("--output-range", type=int, nargs=2, default=[128, 512])
    q.add_argument("--lengths", help="JSON file of [prompt, output] pairs instead")
    q.add_argument("--seconds", type=float, help="finite rates: requests over this many seconds")
    q.add_argument("--prefill-chunk", type=int, default=512)
    q.add_argument("--prefill-budget", type=int, help="prompt tokens a step (the engine's default)")
    q.add_argument("--prefill-requests", type=int, default=4)
    q.add_argument("--overhead-batch", type=int, default=16)
    q.add_argument("--max-len", type=int, help="tokens a slot holds (default: the longest load)")
    q.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    q.add_argument("--slots", type=int, help="the slot layout's (default: the KV budget's)")
    q.add_argument("--kv-bytes-gb", type=float, help="the KV budget of both layouts")
    q.add_argument("--page-size", type=int, default=128)
    q.add_argument("--shared-requests", type=int, default=16, help="0: no shared-prefix load")
    q.add_argument("--shared-prefix", type=int, default=1024)
    q.add_argument("--shared-suffix-range", type=int, nargs=2, default=[128, 256])
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--timeout-s", type=float, default=600.0)
    q.add_argument("--call", default="local")
    q.add_argument("--out", type=Path, default=Path("serve-out"))
    q.add_argument("--kvs", nargs="+", default=["full", "kivi2"])
    q.add_argument("--http", action="store_true", help="also through kivi-serve (default model)")
    q = sub.add_parser("merge")
    q.add_argument("dirs", nargs="+")
    q.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return p


def main(argv=None) -> None:
    args = main_parser().parse_args(argv)
    run(args) if args.cmd == "run" else merge(args)


if __name__ == "__main__":
    main()
