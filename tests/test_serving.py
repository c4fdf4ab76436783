"""kivi_jax.serving.Engine: each request's tokens are what generate gives its prompt alone,
whatever else runs and whenever it arrives; the scheduler's limits; no compilation after warmup.

A tiny random model (untied embeddings, so greedy tokens vary) for all but one test.
"""

from __future__ import annotations

import asyncio
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import tiny_params

import kivi_jax
from kivi_jax.generate import Sampling, generate
from kivi_jax.memory import memory_report
from kivi_jax.serving import Engine, EngineError, QueueFullError, programs

compiled: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, fun_name="?", **_: (
        compiled.append(fun_name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
)

CHUNK = 32  # prompts of 33 tokens and more are prefilled in chunks


@pytest.fixture(scope="module")
def params():
    return tiny_params(seed=0, tie_embeddings=False)  # context 256, vocab 264


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 260, size=n).tolist()


def alone(params, kv, ids, n, **sampling):
    return np.asarray(generate(params, np.array([ids]), kv=kv, max_new_tokens=n, **sampling))[
        0
    ].tolist()


def log_softmax_of_forward(params, ids):
    """float32 [len(ids), V]: position p's log-probabilities of the next token, by forward
    (over a width of 128: one compile; causal, so the padding changes nothing before it)."""
    tokens = np.zeros((1, 128), np.int32)
    tokens[0, : len(ids)] = ids
    return np.asarray(jax.nn.log_softmax(kivi_jax.forward(params, tokens)[0, : len(ids)]))


def engine(params, kv, **kw):
    kw = dict(kv=kv, slots=2, max_len=128, prefill_chunk=CHUNK, decode_steps=4) | kw
    return Engine(params, **kw)


@pytest.mark.parametrize("kv", ["full", "kivi2", "kivi4", "kivi2-mix"])
def test_each_request_gets_the_tokens_of_its_prompt_alone(params, kv):
    """Two slots, five requests arriving over time: ragged lengths, prompts of two chunks
    (prefilled between decode calls), a neighbour cancelled mid-way, and slots reused after
    requests end. Each finished request's greedy tokens equal generate on its prompt alone
    (bit-identical here: the engine's reduction shapes differ from generate's (capacity,
    batch, the chunk's attention over the scratch) but no near-tie flips on this model)."""
    e = engine(params, kv)
    spec = {"a": (20, 15), "long": (50, 10), "cancelled": (40, 40), "d": (7, 6), "e": (60, 9)}
    ids = {name: prompt(n, seed=i) for i, (name, (n, _)) in enumerate(spec.items())}
    submit = lambda name: e.submit(ids[name], max_new_tokens=spec[name][1])
    h = {"a": submit("a"), "cancelled": submit("cancelled")}
    e.step()
    h["long"] = submit("long")  # waits for a slot
    for _ in range(3):
        e.step()
    assert len(h["cancelled"].tokens) > 0 and not h["cancelled"].done
    e.cancel(h["cancelled"])
    h["d"], h["e"] = submit("d"), submit("e")
    while e.step():
        pass
    assert h["cancelled"].finish_reason == "cancelled"
    assert len(h["cancelled"].tokens) < spec["cancelled"][1]
    for name in ["a", "long", "d", "e"]:
        assert h[name].finish_reason == "length"
        assert h[name].result() == alone(params, kv, ids[name], spec[name][1]), name
    stats = e.stats()
    assert stats.requests_finished == {"length": 4, "cancelled": 1}
    assert stats.live_slots == 0 and stats.free_slots == 2 and stats.queue_depth == 0


def test_a_sampled_request_does_not_depend_on_what_else_runs(params):
    e = engine(params, "kivi2")
    hot = Sampling(temperature=1.0, top_p=0.9, seed=7)
    ids = prompt(30, seed=10)
    solo = e.submit(ids, hot, max_new_tokens=12)
    while e.step():
        pass
    others = [e.submit(prompt(25, seed=11), Sampling(temperature=0.8, seed=1), max_new_tokens=5)]
    crowded = e.submit(ids, hot, max_new_tokens=12)
    others.append(e.submit(prompt(90, seed=12), max_new_tokens=8))
    while e.step():
        pass
    assert solo.result() == crowded.result()
    assert solo.result() == alone(params, "kivi2", ids, 12, temperature=1.0, top_p=0.9, seed=7)


def test_stop_ids_and_eos_end_a_request_with_the_stop_token_last(params):
    ids = prompt(20, seed=3)
    free = alone(params, "kivi2", ids, 12)
    a, b = free[5], free[1]  # ends at the first occurrence of a, of b
    e = engine(params, "kivi2", eos_id=a)
    h = [
        e.submit(ids, max_new_tokens=12),
        e.submit(ids, max_new_tokens=12, stop_ids=[b]),
        e.submit(ids, Sampling(eos_id=b), max_new_tokens=12),
    ]
    while e.step():
        pass
    assert all(x.finish_reason == "stop" for x in h)
    assert h[0].result() == free[: free.index(a) + 1]
    assert h[1].result() == h[2].result() == free[: min(free.index(a), free.index(b)) + 1]


def test_no_compilation_over_50_mixed_requests_after_warmup(params):
    """With one page of 128 tokens for the two slots: requests are preempted and restored."""
    sized = engine(params, "kivi2").stats()
    one_page = sized.kv_slot_bytes + sized.kv_pool_bytes // 2
    e = engine(params, "kivi2", max_queue=64, kv_bytes=one_page)  # the programs of the tests above
    e.warmup()
    before = len(compiled)
    rng = np.random.default_rng(0)
    handles = []
    for i in range(50):
        n = int(rng.integers(1, 100))  # in one call or in chunks
        hot = dict(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.integers(1, 50)))
        penalties = dict(frequency_penalty=float(rng.uniform(-2, 2)),
                         repetition_penalty=float(rng.uniform(0.5, 2)))  # fmt: skip
        sampling = [None, Sampling(**hot, seed=i), Sampling(**penalties, seed=i)][i % 3]
        new = int(rng.integers(0 if i % 4 == 1 else 1, 20))
        scored = dict(logprobs=int(rng.integers(0, 21)), prompt_logprobs=True) if i % 4 == 1 else {}
        handles.append(e.submit(prompt(n, seed=100 + i), sampling, max_new_tokens=new, **scored))
        if i % 5 == 4:
            e.step()
    while e.step():
        pass
    assert all(h.finish_reason == "length" for h in handles)
    assert compiled[before:] == [] and e.stats().preemptions > 0


def test_penalties_and_logprobs_are_per_row_values(params):
    """Requests with penalties (greedy and sampled), with logprobs and with neither, decoded
    together: each gets the tokens generate gives its prompt alone with its values; a row's
    logprobs are the float32 log-softmax of the model's logits before penalties and
    temperature (here: forward's over its prompt and tokens: under 128 tokens a KIVI-2 state
    holds them all in full precision), with the alternatives most likely first."""
    pen = dict(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.6)
    rows = {  # name: (prompt, sampling values, logprobs)
        "penalized": (prompt(20, seed=30), pen, None),
        "sampled": (prompt(25, seed=31), dict(pen, temperature=1.0, seed=3), 2),
        "scored": (prompt(15, seed=32), {}, 5),
        "plain": (prompt(22, seed=33), {}, None),
    }
    e = engine(params, "kivi2")
    n = 12
    h = {k: e.submit(ids, Sampling(**kw), max_new_tokens=n, logprobs=lp)
         for k, (ids, kw, lp) in rows.items()}  # fmt: skip
    while e.step():
        pass
    for name, (ids, kw, lp) in rows.items():
        assert h[name].result() == alone(params, "kivi2", ids, n, **kw), name
        assert len(h[name].logprobs) == (0 if lp is None else n)
    assert h["penalized"].result() != alone(params, "kivi2", rows["penalized"][0], n)
    for name in ("sampled", "scored"):
        ids, tokens = rows[name][0], h[name].result()
        expected = log_softmax_of_forward(params, ids + tokens)[len(ids) - 1 : -1]  # [n, V]
        for i, (t, got) in enumerate(zip(tokens, h[name].logprobs, strict=True)):
            assert got.token == t
            np.testing.assert_allclose(got.logprob, expected[i, t], atol=1e-4)
            top_ids, top = zip(*got.top, strict=True)
            assert len(top) == rows[name][2] and list(top) == sorted(top, reverse=True)
            np.testing.assert_allclose(top, np.sort(expected[i])[::-1][: len(top)], atol=1e-4)
            np.testing.assert_allclose(top, expected[i, list(top_ids)], atol=1e-4)


def test_a_prompts_own_logprobs_are_forwards_log_softmax(params):
    """prompt_logprobs over a prompt of 70 tokens (three chunks of 32): position p's entry is
    log_softmax(forward(prompt))[p - 1] at prompt[p] (None for p = 0), with its 3 most likely
    alternatives; max_new_tokens 0 ends the request with them, no token generated."""
    ids = prompt(70, seed=34)
    expected = log_softmax_of_forward(params, ids)
    e = engine(params, "kivi2")
    only = e.submit(ids, max_new_tokens=0, logprobs=3, prompt_logprobs=True)
    more = e.submit(ids, max_new_tokens=5, logprobs=3, prompt_logprobs=True)
    while e.step():
        pass
    assert only.finish_reason == "length" and only.result() == []
    assert more.result() == alone(params, "kivi2", ids, 5)
    for h in (only, more):
        assert h.prompt_logprobs[0] is None and len(h.prompt_logprobs) == 70
        for p, got in enumerate(h.prompt_logprobs[1:], start=1):
            assert got.token == ids[p]
            np.testing.assert_allclose(got.logprob, expected[p - 1, ids[p]], atol=1e-4)
            _, top = zip(*got.top, strict=True)
            np.testing.assert_allclose(top, np.sort(expected[p - 1])[::-1][:3], atol=1e-4)


def test_submit_rejects_what_cannot_run(params):
    e = engine(params, "kivi2", max_queue=2)
    with pytest.raises(ValueError, match=r"prompt \(100 tokens\) \+ max_new_tokens \(50\) = 150 "
                       r"exceeds the engine's max_len of 128"):  # fmt: skip
        e.submit(prompt(100, seed=0), max_new_tokens=50)
    with pytest.raises(ValueError, match="non-empty"):
        e.submit([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.submit([1, 264])
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        e.submit([1, 2], max_new_tokens=-1)
    nothing = e.submit([1, 2], max_new_tokens=0)  # without prompt_logprobs: done at once
    assert nothing.finish_reason == "length" and nothing.result() == []
    with pytest.raises(ValueError, match=r"logprobs must be an int in \[0, 20\], got 21"):
        e.submit([1, 2], logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs needs logprobs"):
        e.submit([1, 2], prompt_logprobs=True)
    e.submit([1, 2], max_new_tokens=2)
    e.submit([1, 2], max_new_tokens=2)
    with pytest.raises(QueueFullError, match="max_queue=2"):
        e.submit([1, 2], max_new_tokens=2)
    assert e.stats().queue_depth == 2


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(slots=0), "slots must be a positive int"),
        (dict(max_len=1000), "exceeds the model's context"),
        (dict(prefill_chunk=0), "prefill_chunk must be a positive int"),
        (dict(prefill_budget=-1), "prefill_budget must be a positive int"),
        (dict(kv="kivi3"), "unknown kv"),
        (dict(eos_id=999), "eos_id 999 is outside"),
        (dict(kv="kivi2-mix", prefix_sharing=True), "not supported for a mixed-precision state"),
        (dict(page_size=96), "multiple of the residual length R=128"),
    ],
)
def test_bad_engine_arguments(params, kw, message):
    with pytest.raises(ValueError, match=message):
        engine(params, **{"kv": "kivi2"} | kw)


def test_background_thread_and_async_iteration(params):
    ids = prompt(20, seed=4)

    async def collect(h):
        return [t async for t in h]

    with engine(params, "full") as e:
        h1 = e.submit(ids, max_new_tokens=9)
        h2 = e.submit(prompt(10, seed=5), max_new_tokens=5)
        streamed = asyncio.run(collect(h1))
        assert streamed == h1.result(timeout=60) == alone(params, "full", ids, 9)
        assert list(h2) == h2.result(timeout=60)
        assert h1.first_token_time >= h1.submit_time and h1.finish_time >= h1.first_token_time
    with pytest.raises(RuntimeError, match="stopped"):
        e.submit(ids, max_new_tokens=4)


def test_a_fault_in_one_requests_prefill_ends_that_request_only(params, monkeypatch):
    MARK = 261  # a prompt starting with it fails in its prefill (prompt() draws ids < 260)
    real = programs.prefill_batch

    def prefill(params, tokens, lengths, **kw):
        if (tokens[:, 0] == MARK).any():
            raise RuntimeError("prefill fault")
        return real(params, tokens, lengths, **kw)

    monkeypatch.setattr(programs, "prefill_batch", prefill)
    e = engine(params, "full")
    ok, bad = prompt(20, seed=6), [MARK, *prompt(9, seed=7)]
    h_ok = e.submit(ok, max_new_tokens=10)
    h_bad = e.submit(bad, max_new_tokens=10)
    while e.step():
        pass
    assert h_bad.finish_reason == "error"
    with pytest.raises(EngineError, match="prefill fault"):
        list(h_bad)
    assert h_ok.finish_reason == "length" and h_ok.result() == alone(params, "full", ok, 10)
    assert e.stats().requests_finished == {"error": 1, "length": 1}
    # Batched: prompts of <= 64 tokens, two a call (2 x 64 = prefill_chunk); the fault ends
    # the requests of its call only.
    e = engine(params, "full", slots=4, prefill_chunk=64 * 2)
    ids = [bad, prompt(12, seed=8), ok, prompt(30, seed=9)]
    h = [e.submit(x, max_new_tokens=6) for x in ids]
    while e.step():
        pass
    assert [x.finish_reason for x in h] == ["error", "error", "length", "length"]
    assert [x.result() for x in h[2:]] == [alone(params, "full", x, 6) for x in ids[2:]]
    assert e.stats().prefill_calls == 1  # the failed call is not counted


def test_short_prompts_arriving_together_are_prefilled_as_the_rows_of_one_call(params):
    """Eight prompts of 5-60 tokens (bucket 64) with prefill_chunk 256: four rows a call, so
    two prefill calls, each request with the tokens of its prompt alone; a prompt arriving
    alone then runs at its own width (one row). prompt_tokens_computed counts the real
    tokens, not the padding."""
    e = engine(params, "kivi2", slots=8, prefill_chunk=256, prefill_budget=256)  # a call a step
    lengths = [5, 60, 17, 33, 48, 9, 64, 21]
    ids = [prompt(n, seed=30 + i) for i, n in enumerate(lengths)]
    h = [e.submit(x, max_new_tokens=5) for x in ids]
    e.step()
    assert e.stats().prefill_calls == 1 and e.stats().live_slots == 4  # the first four
    while e.step():
        pass
    stats = e.stats()
    assert stats.prefill_calls == 2 and stats.prompt_tokens_computed == sum(lengths)
    assert [x.result() for x in h] == [alone(params, "kivi2", x, 5) for x in ids]
    late = e.submit(prompt(70, seed=40), max_new_tokens=5)  # bucket 128: alone, one row
    while e.step():
        pass
    assert late.result() == alone(params, "kivi2", prompt(70, seed=40), 5)
    assert e.stats().prefill_calls == 3
    assert e.stats().prompt_tokens_computed == sum(lengths) + 70


@pytest.mark.parametrize("chunks_a_step, live_after_two_steps", [(1, 1), (4, 4)])
def test_a_step_prefills_up_to_its_budget(params, chunks_a_step, live_after_two_steps):
    """Four prompts of two chunks each: with a budget of one chunk a step the second prompt
    has not started after two steps; with four chunks a step every slot is filled by then.
    Either way each request gets the tokens of its prompt alone."""
    e = engine(params, "kivi2", slots=4, prefill_budget=chunks_a_step * CHUNK)
    ids = [prompt(2 * CHUNK, seed=50 + i) for i in range(4)]
    h = [e.submit(x, max_new_tokens=12) for x in ids]  # 3 decode calls: none ends in 2 steps
    e.step()
    e.step()
    assert e.stats().live_slots == live_after_two_steps
    assert e.stats().prefill_calls == 2 * chunks_a_step
    while e.step():
        pass
    assert [x.result() for x in h] == [alone(params, "kivi2", x, 12) for x in ids]


def fails_at_call(real, n: int, message: str):
    """`real`, raising RuntimeError(message) at its n-th call (1-based) instead of running."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError(message)
        return real(*args, **kwargs)

    return wrapped


def test_a_decode_fault_ends_its_requests_and_the_engine_serves_on(params, monkeypatch):
    """The decode call fails once while a long prompt is between its chunks and another
    request waits: the decoding request ends with the fault; the state is rebuilt; the long
    prompt (its own one-row state) and the waiting request then get the tokens of their
    prompts alone."""
    monkeypatch.setattr(programs, "decode", fails_at_call(programs.decode, 2, "decode fault"))
    e = engine(params, "full", prefill_budget=CHUNK)  # one chunk a step
    ids = {"running": prompt(20, seed=8), "long": prompt(70, seed=9), "queued": prompt(9, 10)}
    running = e.submit(ids["running"], max_new_tokens=30)
    e.step()  # running admitted, decode call 1
    long, queued = (e.submit(ids[k], max_new_tokens=8) for k in ("long", "queued"))
    e.step()  # long's first chunk, decode call 2 fails
    assert running.finish_reason == "error" and e._long is not None
    while e.step():
        pass
    with pytest.raises(EngineError, match="decode fault"):
        running.result()
    for name, h in (("long", long), ("queued", queued)):
        assert h.result() == alone(params, "full", ids[name], 8), name


def test_a_reset_fault_ends_the_states_requests_and_the_engine_serves_on(params, monkeypatch):
    """Freeing a finished request's slot fails (the donated state is lost): the requests the
    state held end with the fault, the state is rebuilt, and the next request is served."""
    monkeypatch.setattr(programs, "reset", fails_at_call(programs.reset, 1, "reset fault"))
    e = engine(params, "full")
    short, long = (
        e.submit(prompt(9, seed=13), max_new_tokens=2),
        e.submit(prompt(12, seed=14), max_new_tokens=30),
    )
    while e.step():
        pass
    assert short.finish_reason == "length" and long.finish_reason == "error"
    after = e.submit(prompt(9, seed=15), max_new_tokens=6)
    while e.step():
        pass
    assert after.result() == alone(params, "full", prompt(9, seed=15), 6)


def test_a_fault_no_handler_places_breaks_the_engine_loudly(params, monkeypatch):
    """An exception outside every program's own handling (here in the scheduler's read-back
    bookkeeping) breaks the engine: every request ends with it and the thread stops, rather
    than leaving requests waiting on a dead thread."""
    e = engine(params, "full")

    def broken(keep):
        raise ValueError("bookkeeping fault")

    monkeypatch.setattr(e, "_drain", broken)
    hs = [e.submit(prompt(9, seed=s), max_new_tokens=5) for s in (16, 17, 18)]
    e.start()
    e.wait(timeout=120)
    assert not e._thread.is_alive() and isinstance(e.failure, ValueError)
    for h in hs:
        with pytest.raises(EngineError, match="bookkeeping fault"):
            h.result(timeout=1)
    with pytest.raises(RuntimeError, match="stopped after a fault"):
        e.submit(prompt(9, seed=19), max_new_tokens=5)


def test_an_engine_that_cannot_rebuild_its_state_stops(params, monkeypatch):
    """The decode call fails and the new state cannot be allocated: the request of the call
    ends with the fault, the waiting one with the allocation's error, the thread stops, and
    the engine refuses new requests."""

    def decode(*args, **kwargs):
        raise RuntimeError("decode fault")

    e = engine(params, "full", slots=1)
    e._allocate()
    allocate = e._allocate

    def no_memory():
        if e._state is None:
            raise MemoryError("no device memory left")
        allocate()

    monkeypatch.setattr(programs, "decode", decode)
    monkeypatch.setattr(e, "_allocate", no_memory)
    running, waiting = (e.submit(prompt(10, seed=s), max_new_tokens=5) for s in (11, 12))
    e.start()
    e.wait(timeout=120)
    assert not e._thread.is_alive()
    assert isinstance(e.failure, MemoryError)
    with pytest.raises(EngineError, match="decode fault"):
        running.result(timeout=1)
    with pytest.raises(EngineError, match="no device memory left"):
        waiting.result(timeout=1)
    with pytest.raises(RuntimeError, match="stopped after a fault: MemoryError"):
        e.submit(prompt(10, seed=13), max_new_tokens=5)
    with pytest.raises(EngineError, match="no device memory left"):
        e.step()


def test_submit_and_stats_never_wait_on_a_device_dispatch(params, monkeypatch):
    """A slot's reset (a jitted dispatch) that takes long: submit() and stats() answer
    meanwhile (the engine's lock is not held across dispatches)."""
    entered, release = threading.Event(), threading.Event()
    real = programs.reset

    def slow_reset(*args, **kwargs):
        entered.set()
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(programs, "reset", slow_reset)
    e = engine(params, "full")
    e.submit(prompt(10, seed=14), max_new_tokens=2)
    stepping = threading.Thread(target=lambda: [None for _ in iter(e.step, False)])
    stepping.start()
    try:
        assert entered.wait(120)  # the request ended: its slot is being reset
        asked = threading.Thread(target=lambda: (e.stats(), e.submit([1, 2], max_new_tokens=2)))
        asked.start()
        asked.join(10)
        assert not asked.is_alive(), "submit() or stats() waited on the dispatch"
    finally:
        release.set()
        stepping.join(120)


def test_memory_report_counts_the_slots_and_the_prefill_scratch(params):
    e = engine(params, "kivi2")
    s = e.stats()  # counted before the state is allocated (at the first step)
    h = e.submit(prompt(20, seed=0), max_new_tokens=4)
    e.step()
    state = memory_report(e._layout.layers(e._state.caches, e._pool, e._pages.table))
    assert (s.kv_slot_bytes, s.kv_pool_bytes) == (state.slot_bytes, state.pool_bytes)
    # without kv_bytes: each slot's max_len tokens of pages (one page of 128 here)
    assert s.pages_total == 2 and state.pool_bytes == state.codes_bytes + state.scales_zeros_bytes
    slots = state.total_bytes
    assert s.kv_bytes_allocated == slots + s.prefill_scratch_bytes
    # the scratch: each layer's full-precision K and V of max_len (a chunk multiple) tokens,
    # and the chunked prompt's one-row state
    c = params.config
    fp = c.num_layers * 2 * 128 * c.num_kv_heads * c.head_dim * 4
    assert s.prefill_scratch_bytes > fp
    # one slot's part; no page: its 23 tokens at most complete no key group of 32
    assert e.stats().kv_bytes_in_use == state.slot_bytes // 2 and e.stats().pages_used == 0
    # a slot's share of the memory plan: its KV state, the penalties' token counts over the
    # vocabulary (int32 generated + bool prompted: 5 bytes an id) and a few counters
    V = c.vocab_size
    assert slots // 2 + 5 * V < e.memory_plan.slot < slots // 2 + 5 * V + 200  # and its page
    while e.step():
        pass
    assert h.done and e.stats().kv_bytes_in_use == 0


def test_the_default_model_answers_through_the_engine(smollm_f32):
    """SmolLM2-135M-Instruct, a KIVI-2 state, greedy: the README's first question."""
    from kivi_jax.generate import encode_prompt

    tok = smollm_f32.tokenizer
    ids = encode_prompt(tok, "What is the capital of France? Answer in one sentence.")
    e = Engine(smollm_f32.params, kv="kivi2", slots=1, max_len=96, prefill_chunk=64,
               eos_id=tok.eos_id, decode_steps=8)  # fmt: skip
    h = e.submit(ids, max_new_tokens=24)
    while e.step():
        pass
    assert "Paris" in tok.decode(h.result())


def test_a_chunked_prompt_gives_the_logits_and_state_of_one_prefill(params):
    """prefill_chunk over 3 chunks against llama.prefill of the whole prompt (kivi2). The
    reductions have other shapes (the projections' matmuls over 32 rows instead of 128, each
    chunk's queries over the scratch's 128 keys against the prompt's causal pass), so values
    agree to float32 rounding: the states hold the same tokens with full-precision keys within
    1e-5 and the logits (of order 3) within 2e-5: a few ulps of float32 at that magnitude,
    compounded over 2 layers (measured: 1.6e-6 and 1.9e-6; key codes all equal)."""

    n = 70
    ids = np.zeros((1, 128), np.int32)
    ids[0, :n] = prompt(n, seed=20)
    (whole,), (states,) = programs.prefill_batch(
        params, ids, np.array([n], np.int32), kv=kivi_jax.KIVI2, max_len=128
    )
    e = engine(params, "kivi2")
    e._allocate()
    caches, scratch = programs.empty_row(params, kv=e.kv, max_len=128), e._scratch
    for offset in range(0, n, CHUNK):
        part = ids[:, offset : min(offset + CHUNK, n)]
        tokens = np.zeros((1, CHUNK), np.int32)
        tokens[:, : part.shape[1]] = part
        logits, scratch, caches = programs.prefill_chunk(
            params, tokens, np.int32(offset), np.array([part.shape[1]], np.int32), scratch, caches
        )
    for chunked, one in zip(caches, states, strict=True):
        np.testing.assert_array_equal(chunked.lengths, one.lengths)
        np.testing.assert_allclose(chunked.k_residual, one.k_residual, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(whole), rtol=0, atol=2e-5)


def test_slots_none_takes_as_many_slots_as_fit_the_budget(params):
    """The sizing rule: the weights already on the device, the slots' state, the prefill
    scratch, the largest compiled program's temporaries and the reserve fit the budget, and an
    engine of one slot more does not (its warmup says so); the programs are compiled once,
    while sizing."""
    budget = 4_000_000
    e = engine(params, "kivi2", slots=None, memory_budget=budget)
    plan = e.memory_plan
    assert plan.limit == budget and plan.slots == e.slots > 2
    assert plan.programs == max(p.temp_bytes for p in e.programs) > 0
    assert plan.needed <= budget
    assert plan.in_use == sum(x.nbytes for x in jax.tree.leaves(params))
    assert e._state is None  # nothing allocated yet
    before = len(compiled)
    e.warmup()  # allocates the state (small programs of its own) and compiles nothing else
    names = ["prefill_batch", "prefill_chunk", "empty_row", "insert_row", "reset", "decode"]
    jitted = {f"jit({name})" for name in names}
    assert jitted.isdisjoint(compiled[before:]) and e.memory_plan == plan
    h = e.submit(prompt(20, seed=1), max_new_tokens=5)
    while e.step():
        pass
    assert h.result() == alone(params, "kivi2", prompt(20, seed=1), 5)
    more = engine(params, "kivi2", slots=e.slots + 1, memory_budget=budget)  # fits unfilled
    with pytest.raises(ValueError, match=f"{e.slots + 1} slots x .* against the limit 4 MB"):
        more.warmup()  # the programs' temporaries counted


def test_the_default_page_holds_whole_flushes_of_any_ring(params):
    """page_size None: 128 tokens rounded up to a multiple of the ring's R (a KIVI page holds
    whole flushes), 128 for a full-precision state."""
    ring = lambda r: kivi_jax.KiviConfig(residual_length=r)
    sizes = [engine(params, kv, max_len=256)._layout.page_size
             for kv in ("full", "kivi2", ring(160), ring(64))]  # fmt: skip
    assert sizes == [128, 128, 160, 128]


def test_a_light_load_decodes_the_lowest_slots_only(params, monkeypatch):
    """From 32 slots the engine also compiles decode programs for a quarter of them; a request
    takes the lowest free slot, so while every live slot lies below 8 a decode call runs 8
    rows, and 10 at once run all 32. Each request's tokens are those of its prompt alone."""
    e = engine(params, "kivi2", slots=32)
    assert e._decode_rows(e.slots) == (8, 32)  # what warmup compiles (not run: it costs ~1 min)
    calls, decode = [], programs.decode
    monkeypatch.setattr(programs, "decode",
                        lambda *a, **kw: calls.append(kw["rows"]) or decode(*a, **kw))  # fmt: skip
    ids = [prompt(12, seed=i) for i in range(10)]
    few = [e.submit(x, max_new_tokens=6) for x in ids[:3]]
    while e.step():
        pass
    assert set(calls) == {8}
    many, before = [e.submit(x, max_new_tokens=40) for x in ids], len(calls)
    while e.step():
        pass
    assert 32 in calls[before:]
    assert [h.result() for h in few] == [alone(params, "kivi2", x, 6) for x in ids[:3]]
    assert [h.result() for h in many] == [alone(params, "kivi2", x, 40) for x in ids]


def test_slots_that_do_not_fit_are_refused_before_anything_is_allocated(params):
    with pytest.raises(ValueError, match=r"does not fit the device: 64 slots x .* against the "
                       r"limit 2 MB; at most \d+ slots fit"):  # fmt: skip
        engine(params, "kivi2", slots=64, memory_budget=2_000_000)
    with pytest.raises(ValueError, match="pass memory_budget"):  # the CPU reports no memory
        engine(params, "kivi2", slots=None)


def test_warmup_on_a_running_engine_runs_nothing_and_loses_no_token(params):
    e = engine(params, "kivi2")
    ids = [prompt(20, seed=2), prompt(9, seed=3)]
    hs = [e.submit(x, max_new_tokens=12) for x in ids]
    e.step()
    e.step()
    e.warmup()
    while e.step():
        pass
    assert [h.result() for h in hs] == [alone(params, "kivi2", x, 12) for x in ids]


def test_preempted_requests_stream_on_with_the_tokens_of_their_prompt_alone(params):
    """A pool of 5 pages of 32 tokens for 3 slots whose requests each grow to 3 pages: decode
    calls run out of pages, the most recently admitted request goes to host memory and comes
    back; every request's greedy tokens still equal generate's alone."""
    kv = kivi_jax.KiviConfig(residual_length=32)
    sized = engine(params, kv, slots=3, page_size=32).stats()
    slot, page = sized.kv_slot_bytes // 3, sized.kv_pool_bytes // sized.pages_total
    e = engine(params, kv, slots=3, page_size=32, kv_bytes=3 * slot + 5 * page)
    assert e.stats().pages_total == 5
    spec = [(25, 60), (30, 55), (45, 50), (20, 60)]  # the third prefilled in two chunks
    ids = [prompt(n, seed=20 + i) for i, (n, _) in enumerate(spec)]
    handles = [e.submit(x, max_new_tokens=new) for x, (_, new) in zip(ids, spec, strict=True)]
    most = 0
    while e.step():
        most = max(most, e.stats().pages_used)
    stats = e.stats()
    assert stats.preemptions > 0 and most <= 5 and stats.pages_used == 0
    for h, x, (_, new) in zip(handles, ids, spec, strict=True):
        assert h.finish_reason == "length"
        assert h.result() == alone(params, kv, x, new)


def test_requests_shorter_than_max_len_run_several_times_more_at_once():
    """bfloat16 state, max_len 2048, R 128 and the memory 8 slots reserve at max_len: 32
    requests of 40-80 prompt tokens + 16 new run at least 24 at a time (each holds one page
    and its ring), not 8."""
    params = tiny_params(seed=0, dtype=jnp.bfloat16, tie_embeddings=False, max_context=2048)
    c = params.config
    eight = kivi_jax.init_cache(kivi_jax.KIVI2, batch=8, max_len=2048, head_dim=c.head_dim,
                                num_kv_heads=c.num_kv_heads, dtype=jnp.bfloat16,
                                num_layers=c.num_layers)  # fmt: skip
    budget = memory_report(eight).total_bytes
    e = Engine(params, kv="kivi2", slots=24, max_len=2048, kv_bytes=budget, prefill_chunk=2048,
               max_queue=32)  # fmt: skip
    s = e.stats()
    assert s.kv_slot_bytes + s.kv_pool_bytes <= budget
    rng = np.random.default_rng(1)
    handles = [e.submit(prompt(int(rng.integers(40, 81)), seed=i), max_new_tokens=16)
               for i in range(32)]  # fmt: skip
    most = 0
    while e.step():
        most = max(most, e.stats().live_slots)
    assert most >= 24
    assert all(h.finish_reason == "length" and len(h.result()) == 16 for h in handles)


@pytest.mark.parametrize("kv", ["kivi2", "full"])
def test_requests_sharing_a_prefix_compute_it_once(kv):
    """16 requests whose prompts share their first 600 tokens: each after the first takes the
    prefix's sealed pages and computes only the rest, so the prompt tokens computed are at
    most half of 16 whole prompts'. KIVI-2: 3 pages of 128 (384 tokens, leaving R = 128 after
    them); the rest attends to the prefix's quantized keys and values. Full precision: 4 pages
    (512 tokens), read back exactly, so every request's tokens are generate's alone."""
    params = tiny_params(seed=0, tie_embeddings=False, max_context=1024)
    e = Engine(params, kv=kv, slots=4, max_len=768, prefill_chunk=128, decode_steps=4,
               prefix_sharing=True)  # fmt: skip
    prefix = prompt(600, seed=40)
    ids = [prefix + prompt(20, seed=41 + i) for i in range(16)]
    handles = [e.submit(x, max_new_tokens=4) for x in ids]
    while e.step():
        pass
    s = e.stats()
    assert all(h.finish_reason == "length" and len(h.result()) == 4 for h in handles)
    shared = 384 if kv == "kivi2" else 512
    assert s.prefix_hit_tokens == 15 * shared
    assert s.prompt_tokens == 16 * 620 and 2 * s.prompt_tokens_computed <= s.prompt_tokens
    assert s.pages_used == 0
    if kv == "full":
        for h, x in list(zip(handles, ids, strict=True))[:3]:
            assert h.result() == alone(params, kv, x, 4)
