"""Serving under load: the continuous-batching engine (kivi_jax.serving.Engine) fed a bounded
stream of requests, for each cache at the number of slots that fits one memory budget (the
engine's own sizing, `Engine(slots=None, memory_budget=)`: docs/serving.md).

Requests arrive as a Poisson process at each given rate ("inf": all at once, saturation; "seq":
one after another, each sent when the one before has finished), with prompt and output lengths
drawn uniformly from the given ranges with a fixed seed (or read from a JSON file of [prompt,
output] pairs); the run ends when all of them have finished. Per rate:
requests/s, output tokens/s, time to first token and time per output token (p50/p90/p99), the
mean number of live slots and peak memory. Per cache, measured in the same process: the prefill
rate (prompt tokens/s of requests run alone) and the decode rate with every slot live (the
engine's decode program at the mean context, `decode_rate`), from
which the saturation throughput is predicted (`predicted_out_tok_per_s`, the engine spending
P/prefill + O/decode seconds per request of P prompt and O output tokens, the mean lengths);
and, at a fixed batch, the engine's decode tokens/s beside `generate`'s on the same batch (the
wall-clock of each one's decode program; `decode_rate` says why not of requests).

    python benchmarks/serve.py run --model Llama-2-7B --budget-gb 80 --out DIR --call NAME
    python benchmarks/serve.py run --model default --slots 8 --requests 8 --rates seq inf \\
        --prompt-range 32 96 --output-range 64 64 --http --out DIR    # the CPU, through HTTP too
    python benchmarks/serve.py merge DIR [DIR ...] --out benchmarks/results

`--slots N --kv-bytes-gb X` runs the paged engine with N slots sharing X GB of KV state (the
default gives every slot max_len tokens of pages, the reservation of contiguous slots): at one
X, more slots than X holds at max_len is the pool's gain on a load of short requests.

`run` measures each cache in a process of its own (its peak memory is its own) and writes
DIR/serve_<model>_<kv>.json; `merge` writes serve.json, serve.md and serve.png (output tokens/s
and p99 time per output token against offered load, one line per cache), a row measured again in
a later DIR replacing the earlier one. On a GPU the models are random bf16 weights of the
benchmark shapes (benchmarks/generate_gpu.py's MODELS); "default" is SmolLM2-135M-Instruct.
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

KEY = ("mode", "model", "kv", "budget_gb", "rate")  # one row per key; later runs replace it
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


def fit_of(engine) -> dict:
    """The engine's memory plan (kivi_jax.serving.sizing.MemoryPlan, bytes on one device) and
    what compiling its programs cost, for the result rows."""
    plan = engine.memory_plan
    return dict(
        slots=engine.slots,
        prefill_chunk=engine.prefill_chunk,
        prefill_budget=engine.prefill_budget,
        pages=engine.stats().pages_total,
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


def run_load(engine, requests, vocab: int, seed: int, timeout_s: float, *, sequential=False):
    """Submits the requests at their arrival times (`sequential`: each once the one before has
    finished) to the running engine, waits for all of them, and returns the rate's measures."""
    from kivi_jax.generate import Sampling

    rng = np.random.default_rng(seed + 1)
    prompts = [prompt(rng, vocab, p) for _, p, _ in requests]
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
    return measures(done, t0, live.mean())


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
    span = length + (calls + 2) * engine.decode_steps  # the tokens the timed calls reach
    for s in range(live):
        if pages.missing(s, span) > pages.free(pages.shard(s)):
            raise ValueError(f"the pool holds no {live} slots of {span} tokens")
        pages.grow(s, span)  # each slot its own pages, from its shard's free list
    table = pages.table.copy()

    def call(state, pool):
        return programs.decode(
            engine.params, state, pool, table, steps=engine.decode_steps, sampled=False,
            extras=False, layout=engine._layout,
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
                totals = list(kernel_totals(runs[0]).items())[:20]
                trace.update(span_ms=span_seconds(runs[0]) * 1e3, live=live, length=length,
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
               call=args.call, **fit)  # fmt: skip
    print(f"  {mode} rate {rate}: {m['out_tok_per_s']:.0f} out tok/s, TTFT p99 "
          f"{m['ttft_p99_ms']:.0f} ms, TPOT p99 {m['tpot_p99_ms']:.1f} ms, "
          f"{m['mean_live_slots']:.1f} live slots", file=sys.stderr, flush=True)  # fmt: skip
    return row


def measure_kv(args, save=None) -> dict:
    """Every measure of one cache (in this process). The engine runs without an EOS, so every
    request produces its drawn number of tokens. `save(result)`, if given, is called with the
    result so far after each rate (a run cut short keeps the rows it measured)."""
    import jax

    from kivi_jax.serving import Engine

    max_len = args.prompt_range[1] + args.output_range[1]
    params, vocab, tokenizer = load(args.model, max_len)
    if args.http and tokenizer is None:
        raise ValueError(f"--http needs a model with a tokenizer ('default'), not {args.model}")
    budget = int(args.budget_gb * 1e9)

    def new_engine(slots):
        return Engine(
            params, kv=args.kv, slots=slots, max_len=max_len, prefill_chunk=args.prefill_chunk,
            prefill_budget=args.prefill_budget, max_queue=1 << 20, memory_budget=budget,
            kv_bytes=None if args.kv_bytes_gb is None else int(args.kv_bytes_gb * 1e9),
            page_size=args.page_size,
        )  # fmt: skip

    mean_p = sum(args.prompt_range) / 2
    mean_o = sum(args.output_range) / 2
    if args.overhead_batch:  # first: its programs compile and run while the device is free
        b, length, new = args.overhead_batch, int(mean_p), int(mean_o)
        gen = generate_decode_rate(
            params, vocab, args.kv, batch=b, length=length, new=new, seed=args.seed
        )
    t0 = time.perf_counter()
    engine = new_engine(args.slots)  # None: as many slots as fit the budget and the device
    engine.warmup()
    warmup_s = time.perf_counter() - t0
    fit = fit_of(engine)
    slots = engine.slots
    print(f"{args.model} {args.kv}: {engine.memory_plan.describe()}; {fit['programs']} programs "
          f"compiled in {fit['compile_s']:.0f} s (warmup {warmup_s:.0f} s)", file=sys.stderr,
          flush=True)  # fmt: skip
    for cost in engine.programs:
        print(f"  {cost.name}: {cost.compile_s:.1f} s, temporaries {cost.temp_bytes / 1e6:.0f} MB",
              file=sys.stderr, flush=True)  # fmt: skip
    prefill = prefill_rate(engine, vocab, int(mean_p), n=args.prefill_requests, seed=args.seed)
    trace: dict = {}
    decode = decode_rate(engine, live=slots, length=int(mean_p + mean_o / 2), trace=trace)
    for name, (n, ms) in list(trace.get("kernels", {}).items())[:8]:
        print(f"  decode step kernels: {name[:60]} x{n} {ms:.2f} ms", file=sys.stderr, flush=True)
    rates = dict(
        predicted_out_tok_per_s=mean_o / (mean_p / prefill + mean_o / decode),
        prefill_tok_per_s=prefill,
        decode_tok_per_s=decode,
    )
    print(f"  prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s at {slots} slots, "
          f"predicted {rates['predicted_out_tok_per_s']:.0f} out tok/s", file=sys.stderr,
          flush=True)  # fmt: skip
    overhead = None
    if args.overhead_batch and args.overhead_batch > slots:
        print(f"  overhead: batch {b} > {slots} slots, not measured", file=sys.stderr)
    elif args.overhead_batch:
        eng = decode_rate(engine, live=b, length=length + new // 2)
        overhead = dict(batch=b, prompt=length, new_tokens=new, engine_decode_tok_per_s=eng,
                        generate_decode_tok_per_s=gen, engine_vs_generate=eng / gen)  # fmt: skip
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
            m = run_load(engine, reqs, vocab, args.seed, timeout_s=args.timeout_s,
                         sequential=rate == 0)  # fmt: skip
            rows.append(_row(args, "engine", rate, m, fit, rates))
            if save is not None:
                save(result)
    if args.http:  # the same loads through kivi-serve's app (a new engine: programs cached)
        del engine
        with HttpServer(new_engine(slots), tokenizer, max_len) as server:
            for rate, reqs in workloads.items():
                m = run_load_http(server, reqs, vocab, args.seed, timeout_s=args.timeout_s,
                                  sequential=rate == 0)  # fmt: skip
                rows.append(_row(args, "http", rate, m, fit, rates))
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


def run_load_http(server: HttpServer, requests, vocab: int, seed: int, timeout_s: float, *,
                  sequential=False) -> dict:  # fmt: skip
    """run_load through the HTTP server: each request a streamed completion from a thread of
    its own, sent at its arrival time (`sequential`: one after another)."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(seed + 1)
    prompts = [prompt(rng, vocab, p) for _, p, _ in requests]
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
    return measures([(s, f, e, n) for s, f, e, n in done], t0, live.mean())


def versions() -> dict:
    import flax
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__}


def _one(args, kv: str, path: Path) -> None:
    """measure_kv in a process of its own (spawned: its device memory is its own)."""
    args.kv = kv
    save = lambda result: path.write_text(json.dumps(dict(result, versions=versions()), indent=1))
    save(measure_kv(args, save))


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
    for kv in args.kvs:
        path = args.out / f"serve_{args.model}_{kv}.json"
        proc = spawn.Process(target=_one, args=(args, kv, path))
        proc.start()
        proc.join()
        if proc.exitcode:
            print(f"{args.model} {kv}: FAILED (exit {proc.exitcode})", flush=True)


def merge(args) -> None:
    """serve.{json,md,png} from the runs' files, a later run's row replacing an earlier one."""
    path = args.out / "serve.json"
    merged = json.loads(path.read_text()) if path.exists() else {"rows": [], "overhead": []}
    for d in args.dirs:
        for f in sorted(Path(d).glob("serve_*.json")):
            r = json.loads(f.read_text())
            keys = {tuple(row[k] for k in KEY) for row in r["rows"]}
            merged["rows"] = [x for x in merged["rows"] if tuple(x[k] for k in KEY) not in keys]
            merged["rows"] += [dict(row, device=r["device"]) for row in r["rows"]]
            if r.get("overhead"):
                o = dict(r["overhead"], device=r["device"], model=r["rows"][0]["model"],
                         kv=r["rows"][0]["kv"], call=r["rows"][0]["call"])  # fmt: skip
                same = lambda x, o=o: (x["model"], x["kv"], x["device"]) == (
                    o["model"], o["kv"], o["device"])  # fmt: skip
                merged["overhead"] = [x for x in merged["overhead"] if not same(x)] + [o]
            if r.get("programs"):
                first = r["rows"][0]
                c = dict(device=r["device"], model=first["model"], kv=first["kv"],
                         call=first["call"], warmup_s=r["warmup_s"], programs=r["programs"],
                         **{k: first[k] for k in PLAN_FIELDS})  # fmt: skip
                same = lambda x, c=c: (x["model"], x["kv"], x["device"]) == (
                    c["model"], c["kv"], c["device"])  # fmt: skip
                merged["compile"] = [x for x in merged.get("compile", []) if not same(x)] + [c]
            merged["versions"] = r["versions"]
    rate_key = lambda x: _rate(str(x["rate"]))
    merged["rows"].sort(key=lambda x: (x["device"], x["model"], x["kv"], rate_key(x)))
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
        "| device | mode | model | kv | slots | budget GB | rate (req/s) | requests | req/s "
        "| out tok/s | predicted | TTFT p50 / p99 ms | TPOT p50 / p99 ms | live slots | peak GB "
        "| call |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['device']} | {r['mode']} | {r['model']} | {r['kv']} | {r['slots']} "
            f"| {r['budget_gb']:g} | {r['rate']} | {r['requests']} | {r['req_per_s']:.2f} "
            f"| {r['out_tok_per_s']:.0f} | {r['predicted_out_tok_per_s']:.0f} "
            f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
            f"| {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | {r['mean_live_slots']:.1f} "
            f"| {r['peak_gb']:.1f} | {r['call']} |"
        )
    if result.get("overhead"):
        lines += [
            "",
            "The engine's own overhead: decode tokens/s at a fixed batch (the wall-clock of each "
            "one's decode program, same process; the engine at its full slot count, `batch` of "
            "them live at the mean context; generate measured first, before the engine "
            "allocates).",
            "",
            "| device | model | kv | batch | prompt + new | engine tok/s | generate tok/s "
            "| engine / generate | call |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for o in result["overhead"]:
            lines.append(
                f"| {o['device']} | {o['model']} | {o['kv']} | {o['batch']} "
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
            "| device | model | kv | slots | limit | in use | slot | scratch | programs' temps "
            "| planned | programs | compile s | slowest | call |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in result["compile"]:
            slow = max(c["programs"], key=lambda p: p["compile_s"])
            lines.append(
                f"| {c['device']} | {c['model']} | {c['kv']} | {c['slots']} "
                f"| {c['limit_gb']:.1f} | {c['in_use_gb']:.1f} | {c['slot_gb']:.3f} "
                f"| {c['scratch_gb']:.2f} | {c['programs_gb']:.2f} | {c['planned_gb']:.1f} "
                f"| {len(c['programs'])} | {sum(p['compile_s'] for p in c['programs']):.0f} "
                f"| {slow['name']} {slow['compile_s']:.0f} s | {c['call']} |"
            )
    return "\n".join(lines) + "\n"


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
        for kv in sorted({r["kv"] for r in rows}):
            mine = sorted((r for r in rows if r["kv"] == kv), key=where)
            x = [where(r) for r in mine]
            label = f"{kv} ({mine[0]['slots']} slots)"
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
    q.add_argument("--slots", type=int, help="instead of the budget's")
    q.add_argument(
        "--kv-bytes-gb",
        type=float,
        help="the KV state's bytes, pool and slots (default: every slot's max_len)",
    )
    q.add_argument("--page-size", type=int, default=128)
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
