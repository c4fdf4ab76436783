"""kivi-serve: the OpenAI API over the serving engine, spoken to by the official `openai` client.

One kivi-serve process for the module (the tiny random model with a real byte-level tokenizer,
on a free loopback port) answers the API tests and is stopped by SIGTERM in the last test; an
in-process server over a model-free engine (tests/fake_engine.py) is where engine faults and the
warmup wait are staged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from fake_engine import FakeEngine
from tiny_model import tiny_params, write_hf_dir

import kivi_jax
from kivi_jax.generate import encode_prompt, generate
from kivi_jax.serving import metrics as metrics_module
from kivi_jax.serving.detokenize import Detokenizer
from kivi_jax.serving.server import MAX_BODY_BYTES, create_app, main, uvicorn_server

SLOTS, MAX_QUEUE, MAX_LEN = 4, 4, 256
PROMPTS = [
    "the theme",
    "in the",
    "a tiny test",
    "hello there, server",
    "the end is near",
    "what is KIVI?",
    "0123456789",
    "the the the",
]


# ------------------------------------------------------------------------------------- helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(base: str, path: str, body: bytes | dict | None = None, *, method=None, timeout=60):
    """(status, headers, body) of one request, on a connection of its own."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if body is not None else {}
    try:
        conn.request(method or ("GET" if body is None else "POST"), path, body, headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _wait_healthy(base: str, deadline_s: float, alive=lambda: True) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        assert alive(), "the server exited while starting"
        with contextlib.suppress(OSError):
            if _http(base, "/health", timeout=5)[0] == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{base}/health not 200 within {deadline_s} s")


def _metrics(base: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    status, _, body = _http(base, "/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("serve") / "tiny")
    write_hf_dir(path, tiny_params(tie_embeddings=False))
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return kivi_jax.load_model(tiny_dir, dtype=jnp.float32)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """`kivi-serve` on the tiny model: base URL; the process is `server.proc`."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve-log") / "server.log", "w+")
    argv = [sys.executable, "-m", "kivi_jax.serving.server", "--model", tiny_dir, "--kv", "kivi2",
            "--slots", str(SLOTS), "--max-len", str(MAX_LEN), "--max-queue", str(MAX_QUEUE),
            "--prefill-chunk", "64", "--port", str(port), "--shutdown-timeout", "30",
            "--no-compilation-cache"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, 240, alive=lambda: proc.poll() is None)
        yield type("Server", (), {"base": base, "proc": proc, "log": log})
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        log.seek(0)
        sys.stderr.write(log.read()[-4000:])
        log.close()


FAKE_ANSWER = "the answer, said the fake engine, is forty-two. "


class _InProcess:
    """uvicorn in a thread over create_app(engine, ...), as kivi-serve runs it."""

    def __init__(self, engine, tokenizer, shutdown_timeout=30.0):
        self.engine, port = engine, _free_port()
        self.app = create_app(engine, tokenizer, model_name="fake", max_len=engine.max_len,
                              shutdown_timeout=shutdown_timeout)  # fmt: skip
        self.uvicorn = uvicorn_server(self.app, host="127.0.0.1", port=port, log_level="warning")
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.base = f"http://127.0.0.1:{port}"

    def __enter__(self):
        self.thread.start()
        end = time.monotonic() + 30
        while not self.uvicorn.started:
            assert time.monotonic() < end, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.uvicorn.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def fake(tiny):
    tok = tiny.tokenizer
    engine = FakeEngine(tok.encode(FAKE_ANSWER), slots=2, max_queue=2, eos_id=tok.eos_id)
    with _InProcess(engine, tok) as s:
        _wait_healthy(s.base, 30)
        yield s


def _reference(tiny, prompt: str, n: int, *, chat: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy answer ids up to and without EOS) as `generate` makes them."""
    ids = encode_prompt(tiny.tokenizer, prompt, chat=chat)
    out = np.asarray(generate(tiny.params, [ids], kv="kivi2", max_new_tokens=n))[0].tolist()
    eos = tiny.tokenizer.eos_id
    return ids, out[: out.index(eos)] if eos in out else out


# --------------------------------------------------------------------------------- the API


def test_models_and_health(server):
    models = _client(server.base).models.list().data
    assert [m.id for m in models] == ["tiny"]
    status, _, body = _http(server.base, "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_greedy_answers_equal_generate_text_while_8_run_at_once(server, tiny):
    """Chat and plain completions, 8 at a time (more than the slots: some wait in the queue).
    The engine admits one prompt per step (--prefill-chunk 64, one prompt bucket), so 8 arriving
    at once can find the queue full: such a request is answered 429 and the client retries it
    after the Retry-After (the overload test checks the 429s themselves)."""
    client, n = _client(server.base).with_options(max_retries=5), 12

    def ask(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            r = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=n,
                temperature=0,
            )  # fmt: skip
            return r, r.choices[0].message.content
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0)
        return r, r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    for i, (r, text) in enumerate(answers):
        prompt = PROMPTS[i % len(PROMPTS)]
        assert text == kivi_jax.generate_text(
            tiny, prompt, kv="kivi2", max_new_tokens=n, chat=bool(i % 2)
        ), prompt
        ids, answer = _reference(tiny, prompt, n, chat=bool(i % 2))
        assert r.usage.prompt_tokens == len(ids)
        stopped = len(answer) < n  # the model produced its EOS, counted as a completion token
        assert r.usage.completion_tokens == len(answer) + stopped
        assert r.usage.total_tokens == len(ids) + r.usage.completion_tokens
        assert r.choices[0].finish_reason == ("stop" if stopped else "length")


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_sends_the_same_answer_in_chunks(server, tiny, chat):
    client, prompt, n = _client(server.base), "the theme", 16
    common = dict(model="tiny", max_tokens=n, temperature=0, stream=True,
                  stream_options={"include_usage": True})  # fmt: skip
    if chat:
        chunks = list(client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], **common))  # fmt: skip
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert {c.object for c in chunks} == {"chat.completion.chunk"}
    else:
        chunks = list(client.completions.create(prompt=prompt, **common))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == kivi_jax.generate_text(tiny, prompt, kv="kivi2", max_new_tokens=n, chat=chat)
    *body, last, usage = chunks
    assert all(c.choices[0].finish_reason is None for c in body)
    assert last.choices[0].finish_reason in ("stop", "length")
    assert usage.choices == [] and usage.usage.completion_tokens >= 1
    assert len({c.id for c in chunks}) == 1


def test_a_stop_string_ends_the_answer_before_it(server, tiny):
    client, prompt, n = _client(server.base), "in the", 40
    full = kivi_jax.generate_text(tiny, prompt, kv="kivi2", max_new_tokens=n, chat=False)

    # The random model's answer is mostly bytes that decode to U+FFFD; the stop string: two
    # printable ASCII characters of it (after its start), at their first place.
    def plain(i):
        s = full[i : i + 2]
        return s.isascii() and s.isprintable() and full.find(s) == i

    k = next(i for i in range(1, len(full) - 2) if plain(i))
    stop = full[k : k + 2]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                  stop=[stop, "never-seen-stop"])  # fmt: skip
    assert r.choices[0].text == full[:k] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                         temperature=0, stop=stop, stream=True)  # fmt: skip
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == full[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_answer_at_that_token(server, tiny):
    client, prompt, n = _client(server.base), "a tiny test", 24
    _, answer = _reference(tiny, prompt, n, chat=False)
    stop_id = answer[5]
    at = answer.index(stop_id)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id]})  # fmt: skip
    assert r.choices[0].text == tiny.tokenizer.decode(answer[:at])
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == at + 1  # the stop token is produced, not shown


def test_sampling_with_a_seed_repeats(server):
    client = _client(server.base)
    kw = dict(model="tiny", prompt="the theme", max_tokens=10, temperature=1.0, top_p=0.9,
              seed=1234, extra_body={"top_k": 50})  # fmt: skip
    first, second = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert first == second


def test_penalties_reach_the_sampler(server, tiny):
    """frequency, presence and repetition penalties: the answer is generate's with them (the
    tiny model repeats itself: they change it)."""
    pen = dict(frequency_penalty=0.8, presence_penalty=0.5, repetition_penalty=1.5)
    prompt, n = "the end is near", 16
    r = _client(server.base).completions.create(
        model="tiny", prompt=prompt, max_tokens=n, temperature=0,
        frequency_penalty=pen["frequency_penalty"], presence_penalty=pen["presence_penalty"],
        extra_body={"repetition_penalty": pen["repetition_penalty"]},
    )  # fmt: skip
    ids = tiny.tokenizer.encode(prompt)
    out = np.asarray(generate(tiny.params, [ids], kv="kivi2", max_new_tokens=n, **pen))[0]
    eos = tiny.tokenizer.eos_id
    answer = out.tolist()[: out.tolist().index(eos)] if eos in out else out.tolist()
    assert r.choices[0].text == tiny.tokenizer.decode(answer)
    _, plain = _reference(tiny, prompt, n, chat=False)
    assert answer != plain


def _log_softmax(tiny, ids) -> np.ndarray:
    """[len(ids), V]: forward's log-probabilities of the token after each position."""
    logits = kivi_jax.forward(tiny.params, np.array([ids]))[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def test_echo_and_logprobs_give_the_prompts_log_softmax_as_lm_eval_reads_it(server, tiny):
    """lm-evaluation-harness's local-completions loglikelihood request: prompts as lists of
    token ids, echo, logprobs 1, max_tokens 1, temperature 0. Each choice's token_logprobs are
    forward's log-softmax at each prompt token (None first), then the answer's token; lm-eval's
    sum over the continuation (`[ctxlen:-1]`) is forward's."""
    prompts = [tiny.tokenizer.encode(t) for t in ("the theme of the end", "in the tiny test")]
    body = {"model": "tiny", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0, "seed": 1234}  # fmt: skip
    status, _, raw = _http(server.base, "/v1/completions", body)
    assert status == 200, raw
    reply = json.loads(raw)
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert reply["usage"]["prompt_tokens"] == sum(map(len, prompts))
    for ids, choice in zip(prompts, reply["choices"], strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        expected = _log_softmax(tiny, ids)
        want = [expected[p - 1, ids[p]] for p in range(1, len(ids))]
        np.testing.assert_allclose(lp["token_logprobs"][1 : len(ids)], want, atol=1e-4)
        ctxlen = 2
        np.testing.assert_allclose(sum(lp["token_logprobs"][ctxlen:-1]), sum(want[ctxlen - 1 :]),
                                   atol=1e-3)  # fmt: skip
        for p in range(1, len(ids)):  # the most likely token, and the prompt's own
            top = lp["top_logprobs"][p]
            best = expected[p - 1].max()
            assert max(top.values()) == pytest.approx(best, abs=1e-4) and len(top) <= 2
        # the answer: the greedy token, its logprob forward's at the prompt's end
        assert lp["token_logprobs"][-1] == pytest.approx(expected[-1].max(), abs=1e-4)
        assert choice["text"].startswith(tiny.tokenizer.decode(ids))
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    only = dict(body, max_tokens=0, prompt=prompts[0])  # the prompt's logprobs alone
    status, _, raw = _http(server.base, "/v1/completions", only)
    choice = json.loads(raw)["choices"][0]
    assert status == 200 and len(choice["logprobs"]["tokens"]) == len(prompts[0])
    assert choice["text"] == tiny.tokenizer.decode(prompts[0])
    assert json.loads(raw)["usage"]["completion_tokens"] == 0


def test_chat_logprobs_have_openais_shape_and_forwards_values(server, tiny):
    client, n = _client(server.base), 6
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the theme"}], max_tokens=n,
        temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    ids, answer = _reference(tiny, "the theme", n, chat=True)
    content = r.choices[0].logprobs.content
    assert len(content) == len(answer)  # an EOS is not shown
    expected = _log_softmax(tiny, ids + answer)[len(ids) - 1 :]
    for i, (entry, token) in enumerate(zip(content, answer, strict=True)):
        text = tiny.tokenizer.decode([token], skip_special_tokens=False)
        assert entry.token == text and entry.bytes == list(text.encode())
        assert entry.logprob == pytest.approx(expected[i, token], abs=1e-4)
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == pytest.approx(np.sort(expected[i])[::-1][:3].tolist(), abs=1e-4)


def test_n_choices_each_sample_with_its_own_seed_streamed_or_not(server):
    """n = 3: three choices (index 0-2), choice j sampled as a request of seed + j alone;
    usage counts the prompt once and every choice's tokens. Streamed, each chunk names its
    choice and each choice ends with its finish reason."""
    client = _client(server.base)
    kw = dict(model="tiny", prompt="the theme", max_tokens=8, temperature=1.0)
    r = client.completions.create(n=3, seed=40, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [client.completions.create(seed=40 + j, **kw) for j in range(3)]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    chunks = list(client.completions.create(n=3, seed=40, stream=True, **kw))
    for j in range(3):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == j]
        assert "".join(c.text for c in mine) == r.choices[j].text
        assert mine[-1].finish_reason == r.choices[j].finish_reason
        assert all(c.finish_reason is None for c in mine[:-1])


# -------------------------------------------------------------------------------- bad input

LONG = {"prompt": "hi", "max_tokens": MAX_LEN}
BAD = [  # (path, body, status, param, words in the message)
    ("/v1/completions", b'{"prompt": "hi", ', 400, None, "not valid JSON"),
    ("/v1/completions", b'["prompt"]', 400, None, "object"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": 7}, 400, "prompt",
     "must be a string, a list of token ids, or a list of either, got 7"),
    ("/v1/completions", {"prompt": ["hi", 7]}, 400, "prompt", "a list of either"),
    ("/v1/completions", {"prompt": [[1], []]}, 400, "prompt", "a list of token ids is empty"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model", "'gpt-9'"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": "  \n"}, 400, "prompt", "empty"),
    ("/v1/completions", {}, 400, "prompt", "required"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages.0.role", "'user'"),
    ("/v1/completions", LONG, 400, "max_tokens", f"context of {MAX_LEN} tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature", "0"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", "less than or equal"),
    ("/v1/completions", {"prompt": "hi", "n": SLOTS + 1}, 400, "n",
     f"{SLOTS + 1} choices, more than the {SLOTS} requests this server decodes at once"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, 400, "n", "6 choices"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs",
     "less than or equal to 5"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens",
     "0 is served with echo only"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
     "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
     "top_logprobs": 21}, 400, "top_logprobs", "less than or equal to 20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True},
     400, "echo", "unsupported"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty",
     "less than or equal to 2"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": -3}, 400, "presence_penalty",
     "greater than or equal to -2"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty",
     "greater than 0"),
    ("/v1/completions", b'{"prompt": "hi", "repetition_penalty": Infinity}', 400,
     "repetition_penalty", "must be a finite number, got Infinity"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {}}, 400, "logit_bias", "unsupported"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", "99999"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids.0", "0"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [99999]}, 400, "stop_token_ids",
     "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, 400, "stop", "must not be empty"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", ""]}, 400, "stop", "must not be empty"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "the list of token ids is empty"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature",
     "must be a finite number, got Infinity"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e309}', 400, "temperature",
     "must be a finite number, got Infinity"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": NaN}', 400, "top_p",
     "must be a finite number, got NaN"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * MAX_LEN}]}, 400,
     "messages", "leaves no room for an answer in the context of 256 tokens"),
    ("/v1/nowhere", {"prompt": "hi"}, 404, None, "POST /v1/nowhere: no such path"),
    ("/v1/completions", None, 405, None, "GET /v1/completions: the method is not allowed; "
     "allowed: POST"),
    ("/v1/models/gpt-9", None, 404, "model", "'gpt-9' is not served here"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed", "0"),
    ("/v1/completions", b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}', 413, None, "exceeds"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), BAD)
def test_bad_input_is_a_4xx_naming_the_problem(server, path, body, status, param, words):
    got, _, raw = _http(server.base, path, body)
    error = json.loads(raw)["error"]
    assert (got, error["param"]) == (status, param), error
    assert words in error["message"] and error["type"] == "invalid_request_error", error
    assert "Value error" not in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_a_model_has_its_own_card(server):
    card = _client(server.base).models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"


def test_null_fields_are_fields_left_out(server):
    """Every field sent as null takes its default: max_tokens in a completion 16 (not what the
    slot has left), top_p 1, no stop, one choice, not streamed; a chat message may carry a
    name."""
    ask = lambda body: json.loads(_http(server.base, "/v1/completions", body)[2])
    left_out = ask({"prompt": "the end is near", "temperature": 0})
    nulls = dict.fromkeys(["max_tokens", "top_p", "stop", "n", "stream", "seed", "logprobs"])
    null = ask({"prompt": "the end is near", "temperature": 0, **nulls})
    assert null["choices"] == left_out["choices"] and null["usage"] == left_out["usage"]
    assert null["usage"]["completion_tokens"] <= 16
    named = {"role": "user", "content": "hi", "name": "ada"}
    status, _, _ = _http(server.base, "/v1/chat/completions",
                         {"messages": [named], "max_tokens": 2, "temperature": 0})  # fmt: skip
    assert status == 200


def test_the_client_sees_bad_input_as_its_errors_and_the_server_serves_on(server):
    client = _client(server.base)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=MAX_LEN)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    # and serves the next request (greedy: a sampled pair of byte-level tokens may be half a
    # character, held back, so the text alone could be empty)
    done = client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    assert done.usage.completion_tokens == 2 and done.choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- faults and load


def test_a_client_leaving_mid_stream_frees_its_slot(server):
    before = _metrics(server.base)
    u = urllib.parse.urlsplit(server.base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"prompt": "the theme", "max_tokens": MAX_LEN - 8, "stream": True, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    events = 0
    while events < 3:  # three tokens' chunks arrived: the request holds a slot
        line = r.fp.readline()
        events += line.startswith(b"data: ")
    assert _metrics(server.base)["kivi_slots_live"] == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    end = time.monotonic() + 10
    while (m := _metrics(server.base))["kivi_slots_live"] != 0:
        assert time.monotonic() < end, "the slot was not freed"
        time.sleep(0.05)
    key = 'kivi_requests_total{outcome="disconnected"}'
    assert m[key] == before[key] + 1
    generated = m["kivi_output_tokens_total"] - before["kivi_output_tokens_total"]
    assert 3 <= generated < MAX_LEN - 8  # cancelled, not run to its end


def test_metrics_move(server):
    before = _metrics(server.base)
    r = _client(server.base).completions.create(model="tiny", prompt="hi", max_tokens=5,
                                                temperature=0)  # fmt: skip
    after = _metrics(server.base)
    outcome = f'kivi_requests_total{{outcome="{r.choices[0].finish_reason}"}}'
    assert after[outcome] == before[outcome] + 1
    assert after["kivi_output_tokens_total"] == (
        before["kivi_output_tokens_total"] + r.usage.completion_tokens
    )
    for h in ("kivi_time_to_first_token_seconds", "kivi_time_per_output_token_seconds"):
        assert after[f"{h}_count"] == before[f"{h}_count"] + 1
    assert after["kivi_output_tokens_per_second"] > 0
    assert after["kivi_slots_live"] + after["kivi_slots_free"] == SLOTS
    assert after["kivi_queue_depth"] == 0
    assert 0 <= after["kivi_kv_bytes_in_use"] <= after["kivi_kv_bytes_allocated"]
    assert after["kivi_kv_bytes_allocated"] > 0
    assert 0 <= after["kivi_pages_used"] <= after["kivi_pages_total"]
    assert after["kivi_preemptions_total"] == 0
    assert after["kivi_prefill_calls_total"] == before["kivi_prefill_calls_total"] + 1
    assert after["kivi_prompt_tokens_computed_total"] == (
        before["kivi_prompt_tokens_computed_total"] + r.usage.prompt_tokens
    )
    bad = 'kivi_requests_total{outcome="invalid"}'
    _http(server.base, "/v1/completions", {"prompt": ""})
    _http(server.base, "/v1/nowhere", {"prompt": "hi"})  # 404: no such path
    _http(server.base, "/v1/completions", None)  # 405: GET
    assert _metrics(server.base)[bad] == after[bad] + 3


def test_overload_at_twice_the_capacity_answers_429_and_loses_nothing(server):
    """Twice what the server holds at once (slots + queue) sent together: every request gets an
    answer, those beyond the capacity a 429 with Retry-After, none a 5xx, within a time limit."""
    sent = 2 * (SLOTS + MAX_QUEUE)
    body = {"prompt": "the theme", "max_tokens": 64, "temperature": 0}
    before = _metrics(server.base)
    start = threading.Barrier(sent)

    def one(_):
        start.wait()
        status, headers, raw = _http(server.base, "/v1/completions", body, timeout=120)
        return status, headers, json.loads(raw)

    with concurrent.futures.ThreadPoolExecutor(sent) as pool:
        results = list(pool.map(one, range(sent), timeout=180))
    statuses = [s for s, _, _ in results]
    assert len(results) == sent and set(statuses) <= {200, 429}, statuses
    # at least a full queue's worth accepted (more as the engine admits waiting requests to
    # free slots meanwhile), the rest refused
    assert statuses.count(200) >= MAX_QUEUE and statuses.count(429) >= 1, statuses
    for status, headers, reply in results:
        if status == 429:
            assert headers["retry-after"] == "1" and reply["error"]["code"] == "queue_full"
        else:
            assert reply["usage"]["completion_tokens"] >= 1
    after = _metrics(server.base)
    key = 'kivi_requests_total{outcome="queue_full"}'
    assert after[key] == before[key] + statuses.count(429)


# ------------------------------------------------------------ staged on the model-free engine


def test_an_engine_fault_fails_its_requests_with_a_500_and_the_server_serves_on(fake):
    client = _client(fake.base)
    stream = client.completions.create(model="fake", prompt="hi", max_tokens=200, stream=True)
    assert next(iter(stream)).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(_http, fake.base, "/v1/completions",
                            {"prompt": "hi", "max_tokens": 200})  # fmt: skip
        while fake.engine.stats().live_slots < 2:
            time.sleep(0.005)
        fake.engine.fail_next_step(RuntimeError("injected fault"))
        status, _, raw = whole.result(30)
    assert status == 500
    error = json.loads(raw)["error"]
    assert error["type"] == "server_error"
    assert "the engine failed: RuntimeError: injected fault" in error["message"]
    with pytest.raises(openai.APIError, match="injected fault"):
        list(stream)
    r = client.completions.create(model="fake", prompt="hi", max_tokens=5)
    assert FAKE_ANSWER.startswith(r.choices[0].text) and r.usage.completion_tokens == 5
    assert _metrics(fake.base)['kivi_requests_total{outcome="error"}'] == 2


def test_a_client_leaving_before_its_whole_answer_cancels_it(fake):
    u = urllib.parse.urlsplit(fake.base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = json.dumps({"prompt": "hi", "max_tokens": 240})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    end = time.monotonic() + 10
    while fake.engine.stats().live_slots == 0:
        assert time.monotonic() < end
        time.sleep(0.005)
    handle = fake.engine.submitted[-1]
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert handle.result(timeout=10) is not None and handle.finish_reason == "cancelled"
    assert len(handle.tokens) < 240


def test_health_is_503_until_the_programs_are_compiled(tiny):
    class SlowWarmup(FakeEngine):
        def warmup(self):
            release.wait(30)

    release = threading.Event()
    engine = SlowWarmup(tiny.tokenizer.encode(FAKE_ANSWER))
    with _InProcess(engine, tiny.tokenizer) as s:
        status, _, body = _http(s.base, "/health")
        assert status == 503 and json.loads(body) == {"status": "compiling"}
        status, headers, _ = _http(s.base, "/v1/completions", {"prompt": "hi"})
        assert status == 503 and headers["retry-after"] == "1"
        release.set()
        _wait_healthy(s.base, 10)
        m = _metrics(s.base)
        assert m['kivi_requests_total{outcome="not_ready"}'] == 1
        assert m['kivi_requests_total{outcome="shutdown"}'] == 0


def test_a_failed_warmup_keeps_health_503_naming_it(tiny):
    class BrokenWarmup(FakeEngine):
        def warmup(self):
            raise RuntimeError("no device memory")

    with _InProcess(BrokenWarmup(tiny.tokenizer.encode(FAKE_ANSWER)), tiny.tokenizer) as s:
        end = time.monotonic() + 10
        while (reply := _http(s.base, "/health"))[2] == b'{"status":"compiling"}':
            assert time.monotonic() < end
            time.sleep(0.01)
        status, _, body = reply
        assert status == 503
        assert json.loads(body) == {"status": "failed", "error": "RuntimeError: no device memory"}


def test_an_unexpected_engine_exception_at_submit_is_a_500_with_the_error_body(tiny):
    class Stopped(FakeEngine):
        def submit(self, *args, **kwargs):
            raise RuntimeError("the engine is stopped")

    with _InProcess(Stopped(tiny.tokenizer.encode(FAKE_ANSWER)), tiny.tokenizer) as s:
        _wait_healthy(s.base, 10)
        status, _, body = _http(s.base, "/v1/completions", {"prompt": "hi"})
        assert status == 500
        assert json.loads(body)["error"]["message"] == "RuntimeError: the engine is stopped"


def test_an_engine_broken_past_repair_stops_the_server(tiny):
    """The engine stops by a fault it cannot recover from: the server stops serving (kivi-serve
    then exits with status 1, for a supervisor to restart it)."""
    engine = FakeEngine(tiny.tokenizer.encode(FAKE_ANSWER))
    with _InProcess(engine, tiny.tokenizer) as s:
        _wait_healthy(s.base, 10)
        engine.break_down(MemoryError("no device memory left"))
        s.thread.join(30)
        assert not s.thread.is_alive(), "the server kept serving"
    server = s.app.state.server
    assert isinstance(server.failure, MemoryError) and not server.ready


def test_requests_left_at_the_shutdown_timeout_are_answered_503_or_an_error_event(tiny):
    """A shutdown (uvicorn's signal handler) with a stream and a whole-body request that
    outlast --shutdown-timeout: the whole one gets a 503 naming the shutdown, the stream an
    error event and [DONE]; no connection is dropped."""
    engine = FakeEngine(tiny.tokenizer.encode(FAKE_ANSWER), step_s=0.02)
    with _InProcess(engine, tiny.tokenizer, shutdown_timeout=0.5) as s:
        _wait_healthy(s.base, 10)
        u = urllib.parse.urlsplit(s.base)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        body = json.dumps({"prompt": "hi", "max_tokens": 240, "stream": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.readline().startswith(b"data: ")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(_http, s.base, "/v1/completions",
                                {"prompt": "hi", "max_tokens": 240}, timeout=30)  # fmt: skip
            while engine.stats().live_slots < 2:
                time.sleep(0.005)
            s.uvicorn.handle_exit(signal.SIGTERM, None)
            status, _, raw = whole.result(30)
        rest = stream.read().decode()
        conn.close()
    assert status == 503 and json.loads(raw)["error"]["code"] == "shutdown"
    events = [line[len("data: ") :] for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutdown"


def test_tokenizing_runs_off_the_event_loop(tiny):
    class Watched:
        """The tokenizer, noting whether each encode or chat template ran on an event loop."""

        def __init__(self, tok):
            self.tok, self.on_loop = tok, []

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def _note(self):
            try:
                asyncio.get_running_loop()
                self.on_loop.append(True)
            except RuntimeError:
                self.on_loop.append(False)

        def encode(self, text):
            self._note()
            return self.tok.encode(text)

        def apply_chat_template(self, messages):
            self._note()
            return self.tok.apply_chat_template(messages)

    tok = Watched(tiny.tokenizer)
    with _InProcess(FakeEngine(tok.encode(FAKE_ANSWER)), tok) as s:
        _wait_healthy(s.base, 10)
        tok.on_loop.clear()
        assert _http(s.base, "/v1/completions", {"prompt": "hi", "max_tokens": 3})[0] == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert _http(s.base, "/v1/chat/completions", chat)[0] == 200
    assert tok.on_loop == [False, False, False]  # encode, then the template and its encode


def test_the_token_rate_keeps_bounded_memory_unscraped(monkeypatch):
    m = metrics_module.Metrics(FakeEngine([1]))
    clock = [0.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: clock[0])
    for i in range(5000):  # 1000 s of tokens, 5 a second, never scraped
        clock[0] = i * 0.2
        m.token()
    assert len(m._recent) <= metrics_module.RATE_WINDOW_S / 0.1 + 1
    assert m.tokens_per_s() == pytest.approx(5.0, abs=0.1)  # the window's two ends counted


def test_a_port_in_use_ends_the_command_at_once(tiny_dir, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.perf_counter()
        assert main(["--model", tiny_dir, "--port", str(port), "--no-compilation-cache"]) == 2
        assert time.perf_counter() - t0 < 5  # before the model loads
    err = capsys.readouterr().err
    assert f"kivi-serve: error: cannot listen on 127.0.0.1:{port}: Address already in use" in err


@pytest.mark.parametrize("process_id", [0, 1])
def test_kivi_serve_across_processes_serves_http_in_process_0_only(tiny_dir, monkeypatch,
                                                                  process_id):  # fmt: skip
    """--coordinator, --num-processes, --process-id go to distributed.initialize; process 0
    listens and serves; another opens no port, builds the same engine on the global mesh,
    warms it up and follows it. (The processes themselves: tests/test_distributed.py.)"""
    import jax

    from kivi_jax import distributed
    from kivi_jax.serving import Engine, server

    joined, calls = [], []
    monkeypatch.setattr(distributed, "initialize", lambda *a: joined.append(a))
    monkeypatch.setattr(jax, "process_index", lambda: process_id)
    monkeypatch.setattr(Engine, "warmup", lambda e: calls.append("warmup"))
    monkeypatch.setattr(Engine, "follow", lambda e: calls.append(("follow", e.mesh.shape)))
    monkeypatch.setattr(server, "create_app", lambda engine, *a, **kw: calls.append("app"))
    monkeypatch.setattr(server, "serve", lambda app, sock, **kw: sock.close() or 0)
    opened = []
    listen = server._listen
    monkeypatch.setattr(server, "_listen", lambda *a: opened.append(a) or listen(*a))
    argv = ["--model", tiny_dir, "--max-len", "64", "--slots", "2", "--port", "0",
            "--no-compilation-cache", "--coordinator", "127.0.0.1:1234", "--num-processes", "2",
            "--process-id", str(process_id)]  # fmt: skip
    assert server.main(argv) == 0
    assert joined == [("127.0.0.1:1234", 2, process_id)]
    if process_id == 0:
        assert len(opened) == 1 and calls == ["app"]
    else:
        assert opened == [] and calls == ["warmup", ("follow", {"model": 1})]


# -------------------------------------------------------------------------------- the CLI


def test_cli_options_state_their_defaults():
    from kivi_jax.serving.server import _parser

    actions = [a for a in _parser()._actions if a.option_strings and a.dest != "help"]
    assert {a.option_strings[0] for a in actions} >= {
        "--model", "--kv", "--dtype", "--slots", "--max-len", "--max-queue", "--prefill-chunk",
        "--host", "--port", "--shutdown-timeout", "--tensor-parallel", "--memory-budget",
        "--no-compilation-cache", "--kv-bytes", "--page-size", "--prefix-sharing",
        "--distributed", "--coordinator", "--num-processes", "--process-id",
    }  # fmt: skip
    for a in actions:
        if a.dest == "no_compilation_cache":  # a switch: its default is the cache on
            assert "(default: the cache is on)" in a.help
            continue
        if a.dest in ("prefix_sharing", "distributed"):  # a switch, off unless given
            assert "(default: off)" in a.help
            continue
        shown = f"{a.default:g}" if isinstance(a.default, float) else a.default
        expected = "(default: " if a.default is None else f"(default: {shown})"
        assert expected in a.help, a.option_strings


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/no/such/model.gguf"], "no such model file or directory"),
        (["--slots", "0"], "slots must be a positive int"),
        (["--slots", "auto"], "this device does not report: pass memory_budget"),
        (["--slots", "64", "--memory-budget", "0.001"], "the engine does not fit the device: 64 "),
        (["--max-len", "4096"], "exceeds the model's context of 256"),
        (["--tensor-parallel", "2"], "--tensor-parallel: tensor parallelism over 2 devices, but"),
    ],
)
def test_cli_errors_exit_2_before_serving(tiny_dir, argv, message, capsys):
    from kivi_jax.serving.server import main

    argv = ["--model", tiny_dir, "--max-len", "256", "--port", "0", "--no-compilation-cache",
            *argv]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kivi-serve: error: ") and message in err


# ----------------------------------------------------------------------------- detokenizing


def test_detokenizer_holds_back_a_stop_string_spanning_tokens(tiny):
    tok = tiny.tokenizer
    ids = tok.encode("the theme of the end")
    d = Detokenizer(tok, stop=["of th"])
    shown = "".join(d.add(i) for i in ids[:-1] if not d.stopped)
    assert d.stopped and shown == d.text == "the theme "


def test_detokenizer_decodes_a_few_ids_per_token(tiny):
    """Each token costs a decode of the few ids around it, not of the whole answer, and the
    pieces add up to the decoding of all the ids."""

    class Counted:
        def __init__(self, tok):
            self.tok, self.decoded = tok, 0

        def decode(self, ids):
            self.decoded += len(ids)
            return self.tok.decode(ids)

    tok = Counted(tiny.tokenizer)
    ids = tiny.tokenizer.encode("Le thème: « é, ü, ∑ » and the end. " * 12)
    d = Detokenizer(tok)
    text = "".join(d.add(i) for i in ids) + d.flush()
    assert text == d.text == tiny.tokenizer.decode(ids)
    assert len(ids) > 300 and tok.decoded <= 8 * len(ids)


def test_detokenizer_waits_for_a_whole_character(tiny):
    tok = tiny.tokenizer
    ids = tok.encode("é!")  # byte-level: é is two tokens
    d = Detokenizer(tok)
    assert [d.add(i) for i in ids] == ["", "é", "!"] and d.flush() == ""
    assert d.text == "é!"


# ----------------------------------------------------------------------- stopping the server


def test_sigterm_finishes_the_requests_in_flight_and_exits_0(server):
    """The module's last test: it stops the server the others share."""
    u = urllib.parse.urlsplit(server.base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"prompt": "the theme", "max_tokens": 48, "stream": True, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.readline().startswith(b"data: ")
    server.proc.send_signal(signal.SIGTERM)
    rest = r.read().decode()  # the stream runs to its end
    conn.close()
    events = [line[len("data: ") :] for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.proc.wait(60) == 0
    with pytest.raises(OSError):
        _http(server.base, "/health", timeout=5)


def test_an_ipv6_host_is_bound_on_an_ipv6_socket():
    """`--host ::1` (or `::`) listens as uvicorn would, on an IPv6 socket (loopback only)."""
    from kivi_jax.serving.server import _listen

    with _listen("::1", 0) as sock:
        assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"
