"""`kivi-serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over the serving Engine.

    POST /v1/completions, POST /v1/chat/completions (stream: true as server-sent events)
    GET /v1/models, GET /health (200 once engine.warmup() has compiled the programs), GET /metrics

Requests are checked before they reach the engine (kivi_jax.serving.protocol); a bad one gets a
4xx with OpenAI's error body, a full queue 429 with Retry-After. Tokens reach the handler through
the request handle's async iterator; the text is decoded as it comes (detokenize.Detokenizer, which
also ends the answer at a stop string and then cancels the request). A client that goes away
cancels its request, so its slot frees within a few decode steps. An engine fault fails the
requests it touched with a 500 naming it; an engine that cannot recover turns /health 503 and
ends the process with status 1. The tokenizer and the chat template run off the event loop.

XLA's compiled programs are kept across starts in a persistent cache (compilation_cache_dir(),
--no-compilation-cache to turn it off): a second start with the same arguments loads them
instead of compiling. The port is bound before the model loads (one in use ends the command at
once, status 2). On
SIGTERM new requests get 503 and the requests in flight have --shutdown-timeout seconds to
finish; then the engine cancels what is left, whose clients get a 503 or an error event, and
the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from kivi_jax.generate import Sampling, check_prompt
from kivi_jax.serving import QueueFullError
from kivi_jax.serving.detokenize import Detokenizer
from kivi_jax.serving.metrics import CONTENT_TYPE, Metrics
from kivi_jax.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Reply,
    parse,
)

MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused (413)
RETRY_AFTER_S = 1  # told to a client whose request met a full queue (429) or a loading server
SHUTDOWN_TIMEOUT_S = 30.0
# After --shutdown-timeout, the time the cancelled requests' handlers have to answer before
# uvicorn closes their connections.
SHUTDOWN_GRACE_S = 5.0

log = logging.getLogger("kivi_jax.serving")


class _Generation:
    """One choice: its request's tokens turned into text pieces, counted, with its finish
    reason and (if asked) the logprobs of the tokens shown. With `echo` its first piece is the
    prompt's text (and its entries the prompt's logprobs, once the engine has them)."""

    def __init__(
        self,
        server: _Server,
        handle,
        detokenizer: Detokenizer,
        hidden: set[int],
        *,
        echo: str | None = None,
        prompt: list[int] = (),
        scored: bool = False,
    ):
        self.server, self.handle, self.hidden = server, handle, hidden
        self.detokenizer = detokenizer
        self.echo, self.prompt, self.scored = echo, prompt, scored
        self.tokens = 0
        self.entries: list = []  # (token id, Logprob or None) of the text so far, if scored
        self.taken = 0  # entries handed to a stream chunk
        self.finish_reason: str | None = None
        self.last_token_time: float | None = None

    def take_entries(self) -> list:
        """The entries not yet handed out."""
        new, self.taken = self.entries[self.taken :], len(self.entries)
        return new

    def _echoed(self) -> str:
        """The prompt's text, and its entries: logprobs are read once the engine has them
        (before the first token, or at the end)."""
        if self.scored:
            prompt_lps = self.handle.prompt_logprobs
            self.entries += list(zip(self.prompt, prompt_lps, strict=True))
        return self.echo

    async def pieces(self):
        """Yields the answer's text as it grows; raises APIError if the engine failed or the
        server cancelled the request while stopping."""
        echo = self.echo is not None
        try:
            async for token in self.handle:
                if echo:
                    echo = False
                    yield self._echoed()
                self.tokens += 1
                self.last_token_time = time.perf_counter()
                self.server.metrics.token()
                if token in self.hidden:  # EOS or a stop id: the request's last token
                    continue
                if self.scored:
                    self.entries.append((token, self.handle.logprobs[self.tokens - 1]))
                piece = self.detokenizer.add(token)
                if piece:
                    yield piece
                if self.detokenizer.stopped:
                    self.server.engine.cancel(self.handle)
                    self.finish_reason = "stop"
                    return
        except Exception as e:
            if self.handle.finish_reason == "error":
                error = self.handle.error or e
                raise APIError(
                    500, f"the engine failed: {type(error).__name__}: {error}", type="server_error"
                ) from e
            raise
        if self.handle.finish_reason == "cancelled":
            raise APIError(
                503, "the server is stopping: the request was cancelled", type="server_error",
                code="shutdown",
            )  # fmt: skip
        if echo:
            yield self._echoed()
        tail = self.detokenizer.flush()
        if tail:
            yield tail
        self.finish_reason = self.handle.finish_reason

    @property
    def text(self) -> str:
        return (self.echo or "") + self.detokenizer.text

    def record(self) -> None:
        """The outcome and latencies, once the answer is complete."""
        m, h = self.server.metrics, self.handle
        m.outcome(self.finish_reason)
        if h.first_token_time is not None:
            m.ttft.observe(h.first_token_time - h.submit_time)
            if self.tokens > 1:
                m.tpot.observe((self.last_token_time - h.first_token_time) / (self.tokens - 1))


class _Server:
    def __init__(self, engine, tokenizer, *, model_name: str, max_len: int, max_body_bytes: int,
                 shutdown_timeout: float):  # fmt: skip
        self.engine, self.tokenizer = engine, tokenizer
        self.model_name, self.max_len, self.max_body_bytes = model_name, max_len, max_body_bytes
        self.shutdown_timeout = shutdown_timeout
        self.metrics = Metrics(engine)
        self.ready = False
        self.stopping = False
        self.failure: BaseException | None = None  # warmup's, or the engine's past repair
        self.exit = lambda: None  # ends the process's serving (set by uvicorn_server)
        self._engine_stop = threading.Lock()
        self._engine_stopped = False

    def warm(self) -> None:
        """Compiles the engine's programs and starts its loop (in a thread: /health answers 503
        meanwhile), then waits for the loop: an engine that stops by a fault it could not
        recover from (engine.failure) turns /health 503 and stops the server."""
        try:
            t0 = time.perf_counter()
            self.engine.warmup()
            if self.stopping:  # a signal came while it compiled: nothing to start
                return
            self.engine.start()
            self.ready = True
            log.info("engine compiled and started in %.1f s", time.perf_counter() - t0)
        except Exception as e:
            self.failure = e
            log.exception("engine warmup failed")
            return
        self.engine.wait()
        if self.engine.failure is not None:
            self.ready, self.failure = False, self.engine.failure
            log.error("the engine stopped after a fault: %r; exiting", self.failure)
            self.exit()

    def begin_shutdown(self) -> None:
        """A signal: new requests get 503; the requests in flight have shutdown_timeout
        seconds, then the engine cancels the rest (their handlers answer 503 or an error
        event within SHUTDOWN_GRACE_S)."""
        self.ready, self.stopping = False, True
        timer = threading.Timer(self.shutdown_timeout, self.stop_engine)
        timer.daemon = True
        timer.start()

    def stop_engine(self) -> None:
        """Stops the engine (once), cancelling what it still runs."""
        with self._engine_stop:
            if not self._engine_stopped:
                self.engine.stop(timeout=SHUTDOWN_GRACE_S, cancel=True)
                self._engine_stopped = True

    async def body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise self._too_large()
        return bytes(body)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.max_body_bytes} bytes")

    def prompt_ids(self, req) -> list[list[int]]:
        """The token ids of each prompt (a chat request has one)."""
        tok = self.tokenizer
        if isinstance(req, ChatCompletionRequest):
            messages = [
                {"role": m.role, "content": m.text} | ({"name": m.name} if m.name else {})
                for m in req.messages
            ]
            try:
                text = tok.apply_chat_template(messages)
            except Exception as e:  # no template, or the template refused the messages
                raise APIError(400, f"messages: {e}", param="messages") from None
            prompts = [tok.encode(text)]
        else:
            prompts = []
            for prompt in req.prompts:
                if isinstance(prompt, str):
                    try:
                        check_prompt(prompt)
                    except ValueError as e:
                        raise APIError(400, f"prompt: {e}", param="prompt") from None
                    prompt = tok.encode(prompt)
                prompts.append(list(prompt))
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt: the prompt encodes to no tokens", param="prompt")
            self._check_ids(ids, "prompt")
        self._check_ids(req.stop_token_ids, "stop_token_ids")
        return prompts

    def _check_ids(self, ids, param: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise APIError(
                400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab})",
                param=param,
            )  # fmt: skip

    def submit(self, req, prompts: list[list[int]]) -> list:
        """Checks lengths, sampling and choices, then queues n requests per prompt; their
        handles, choice by choice (prompt by prompt, n each)."""
        if req.model is not None and req.model != self.model_name:
            raise APIError(
                404, f"model {req.model!r} is not served here; this server serves "
                f"{self.model_name!r}", param="model", code="model_not_found",
            )  # fmt: skip
        chat = isinstance(req, ChatCompletionRequest)
        if chat and req.max_tokens is not None and req.max_completion_tokens is not None:
            raise APIError(
                400, "give max_tokens or max_completion_tokens, not both", param="max_tokens"
            )
        if chat and req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        if not chat and req.max_tokens == 0 and not req.echo:
            raise APIError(
                400, "max_tokens: 0 is served with echo only (the prompt, and with logprobs its "
                "logprobs); otherwise at least 1", param="max_tokens",
            )  # fmt: skip
        choices, slots = len(prompts) * req.n, self.engine.slots
        if choices > slots:
            raise APIError(
                400, f"n: {len(prompts)} prompt(s) x n = {req.n} is {choices} choices, more than "
                f"the {slots} requests this server decodes at once", param="n",
            )  # fmt: skip
        limit = req.answer_limit if chat else req.max_tokens
        n = max(len(ids) for ids in prompts)  # the longest prompt
        if limit is None and n >= self.max_len:  # a chat answer fills what is left
            raise APIError(
                400, f"the prompt ({n} tokens) leaves no room for an answer in the "
                f"context of {self.max_len} tokens", param="messages",
                code="context_length_exceeded",
            )  # fmt: skip
        tokens = self.max_len - n if limit is None else limit
        if n + tokens > self.max_len:
            raise APIError(
                400, f"the prompt ({n} tokens) + max_tokens ({tokens}) exceeds the "
                f"context of {self.max_len} tokens", param="max_tokens",
                code="context_length_exceeded",
            )  # fmt: skip
        if chat:
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
        prompt_logprobs = not chat and req.echo and logprobs is not None
        seed = secrets.randbelow(2**31) if req.seed is None else req.seed
        if self.stopping:
            raise APIError(503, "the server is stopping", type="server_error", code="shutdown")
        if self.failure is not None:
            raise APIError(
                503, f"the engine failed: {self.failure!r}", type="server_error",
                code="engine_failed",
            )  # fmt: skip
        if not self.ready:
            raise APIError(
                503, "the server is still compiling its programs", type="server_error",
                code="not_ready", headers={"Retry-After": str(RETRY_AFTER_S)},
            )  # fmt: skip
        handles = []
        try:
            for ids in prompts:
                for j in range(req.n):  # choice j samples with seed + j
                    sampling = Sampling(
                        temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                        seed=(seed + j) % 2**32, frequency_penalty=req.frequency_penalty,
                        presence_penalty=req.presence_penalty,
                        repetition_penalty=req.repetition_penalty,
                    )  # fmt: skip
                    handles.append(self.engine.submit(
                        ids, sampling=sampling,
                        max_new_tokens=self.max_len - len(ids) if limit is None else limit,
                        stop_ids=req.stop_token_ids, logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                    ))  # fmt: skip
        except Exception as e:
            for h in handles:  # all of the request's choices, or none
                self.engine.cancel(h)
            if isinstance(e, QueueFullError):
                raise APIError(
                    429, f"the queue is full: {e}", type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from None  # fmt: skip
            if isinstance(e, ValueError):
                raise APIError(400, str(e)) from None
            raise
        return handles

    async def answer(self, request: Request, chat: bool):
        req = parse(ChatCompletionRequest if chat else CompletionRequest, await self.body(request))
        prompts = await asyncio.to_thread(self.prompt_ids, req)  # the tokenizer, off the loop
        handles = self.submit(req, prompts)
        hidden = set(req.stop_token_ids)
        if self.tokenizer.eos_id is not None:
            hidden.add(self.tokenizer.eos_id)
        echo = not chat and req.echo
        top = (req.top_logprobs or 0) if chat else req.logprobs
        scored = (req.logprobs if chat else req.logprobs is not None) or False
        texts = [None] * len(prompts)
        if echo:
            texts = [self._prompt_text(p, ids) for p, ids in zip(req.prompts, prompts, strict=True)]
        gens = [
            _Generation(self, h, Detokenizer(self.tokenizer, req.stop_strings), hidden,
                        echo=texts[i // req.n], prompt=prompts[i // req.n], scored=scored)
            for i, h in enumerate(handles)
        ]  # fmt: skip
        token_text = lambda i: self.tokenizer.decode([i], skip_special_tokens=False)
        reply = Reply(chat=chat, model=self.model_name, token_text=token_text)
        prompt_tokens = sum(map(len, prompts))
        if req.stream:
            return StreamingResponse(
                self._events(gens, reply, prompt_tokens, req.include_usage, top, scored),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await self._whole(request, gens, reply, prompt_tokens, top, scored)

    def _prompt_text(self, prompt, ids: list[int]) -> str:
        """An echoed prompt: the text as sent, or its token ids' text."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)

    def _cancel(self, gens) -> None:
        for gen in gens:
            self.engine.cancel(gen.handle)

    async def _whole(self, request: Request, gens, reply: Reply, prompt_tokens: int, top, scored):
        """The answer in one body; a client that leaves first cancels the requests."""

        async def collect(gen):
            async for _ in gen.pieces():
                pass

        work = asyncio.ensure_future(asyncio.gather(*(collect(g) for g in gens)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # uvicorn gave up on the request (shutdown timeout)
            self._cancel(gens)
            gone.cancel()
            raise
        if not work.done():
            self._cancel(gens)
            self.metrics.outcome("disconnected")
            with contextlib.suppress(Exception):
                await work
            return Response(status_code=499)  # nobody reads it
        gone.cancel()
        if work.exception() is not None:
            self._cancel(gens)
            work.result()  # raises the APIError of a failed request
        choices = []
        for i, gen in enumerate(gens):
            gen.record()
            logprobs = reply.logprobs(gen.entries, top) if scored else None
            choices.append(reply.choice(i, gen.text, gen.finish_reason, logprobs))
        completion_tokens = sum(gen.tokens for gen in gens)
        return JSONResponse(reply.full(choices, prompt_tokens, completion_tokens))

    async def _events(self, gens, reply: Reply, prompt_tokens: int, usage: bool, top, scored):
        """Server-sent events: OpenAI's chunks of every choice as each grows (`index` naming
        it), each choice's last chunk with its finish reason, then `data: [DONE]`. A client
        that leaves cancels this generator (Starlette watches the connection), which cancels
        the requests."""
        queue: asyncio.Queue = asyncio.Queue()

        async def run(i, gen):
            try:
                async for piece in gen.pieces():
                    await queue.put((i, piece, None))
                await queue.put((i, None, None))
            except Exception as e:
                await queue.put((i, None, e))

        tasks = [asyncio.ensure_future(run(i, gen)) for i, gen in enumerate(gens)]
        offsets = [0] * len(gens)  # text sent per choice (completions' text_offset)

        def chunk(i, text, finish_reason=None):
            logprobs = None
            if scored:
                logprobs = reply.logprobs(gens[i].take_entries(), top, offsets[i])
            offsets[i] += len(text or "")
            return _sse(reply.chunk(i, text, finish_reason, logprobs=logprobs))

        finished = False
        try:
            if reply.chat:
                for i in range(len(gens)):
                    yield _sse(reply.chunk(i, "", first=True))
            left = len(gens)
            while left:
                i, piece, error = await queue.get()
                if error is not None:
                    raise error
                if piece is None:
                    left -= 1
                    yield chunk(i, None, gens[i].finish_reason)
                else:
                    yield chunk(i, piece)
            if usage:
                completion_tokens = sum(gen.tokens for gen in gens)
                yield _sse(reply.usage_chunk(prompt_tokens, completion_tokens))
            for gen in gens:
                gen.record()
            finished = True
        except APIError as e:  # the stream has begun: the error goes as an event
            self._cancel(gens)
            self.metrics.outcome("error" if e.status == 500 else "shutdown")
            finished = True
            yield _sse(e.body())
        finally:
            for task in tasks:
                task.cancel()
            if not finished:  # the client went away
                self._cancel(gens)
                self.metrics.outcome("disconnected")
        yield "data: [DONE]\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def create_app(engine, tokenizer, *, model_name: str, max_len: int,
               max_body_bytes: int = MAX_BODY_BYTES,
               shutdown_timeout: float = SHUTDOWN_TIMEOUT_S) -> FastAPI:  # fmt: skip
    """The ASGI app over an engine that is not started yet: at startup a thread runs
    engine.warmup() then engine.start(); at shutdown engine.stop() finishes what is left within
    `shutdown_timeout` seconds and cancels the rest. `max_len` is the engine's slot capacity
    (prompt + answer tokens)."""
    server = _Server(
        engine, tokenizer, model_name=model_name, max_len=max_len, max_body_bytes=max_body_bytes,
        shutdown_timeout=shutdown_timeout,
    )  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=server.warm, name="kivi-warmup", daemon=True).start()
        yield
        server.ready, server.stopping = False, True
        await asyncio.to_thread(server.stop_engine)

    app = FastAPI(title="kivi-serve", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        outcome = {429: "queue_full", 500: "error", 503: e.code}.get(e.status, "invalid")
        server.metrics.outcome(outcome)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, e: HTTPException):
        """Starlette's own 404 (no such path) and 405 (a method the path does not take), counted
        as invalid requests like the server's own 4xx."""
        server.metrics.outcome("invalid")
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            message = f"{where}: no such path; see GET /v1/models, POST /v1/completions, "
            message += "POST /v1/chat/completions, GET /health, GET /metrics"
        elif e.status_code == 405:
            message = f"{where}: the method is not allowed; allowed: {e.headers.get('Allow')}"
        else:
            message = f"{where}: {e.detail}"
        error = APIError(e.status_code, message, code="not_found" if e.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        server.metrics.outcome("error")
        error = APIError(500, f"{type(e).__name__}: {e}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.answer(request, chat=True)

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "kivi-jax",
            "max_model_len": max_len}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r} is not served here; this server serves "
                           f"{model_name!r}", param="model", code="model_not_found")  # fmt: skip
        return card

    @app.get("/health")
    async def health():
        if server.ready:
            return {"status": "ok"}
        status = "stopping" if server.stopping else "failed" if server.failure else "compiling"
        detail = {"status": status}
        if server.failure:
            detail["error"] = f"{type(server.failure).__name__}: {server.failure}"
        return JSONResponse(detail, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE)

    return app


class _Uvicorn(uvicorn.Server):
    """uvicorn's server whose signal handler also starts the app's side of a shutdown
    (_Server.begin_shutdown), and which an engine broken past repair stops."""

    def __init__(self, app: FastAPI, **config):
        self.app_server = app.state.server
        grace = self.app_server.shutdown_timeout + SHUTDOWN_GRACE_S
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace, **config))
        self.app_server.exit = self._exit

    def _exit(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.app_server.begin_shutdown()
        super().handle_exit(sig, frame)


def uvicorn_server(app: FastAPI, **config) -> uvicorn.Server:
    """A uvicorn server (`config`: uvicorn.Config's arguments) for create_app's app."""
    return _Uvicorn(app, **config)


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (a port in use fails at once); an
    IPv6 address (`::`, `::1`) on an IPv6 socket, as uvicorn binds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def compilation_cache_dir() -> str:
    """Where kivi-serve keeps XLA's compiled programs: $XDG_CACHE_HOME/kivi-jax/xla, by default
    ~/.cache/kivi-jax/xla (JAX's persistent compilation cache: keyed by the program, the
    device, jax's version and XLA's flags, so a stale entry is never used)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kivi-jax", "xla")


def _use_compilation_cache() -> None:
    """Every program compiled from now on is written to (or read from) the persistent cache,
    however short its compile."""
    import jax

    jax.config.update("jax_compilation_cache_dir", compilation_cache_dir())
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _slots(text: str) -> int | None:
    """--slots: a positive int, or "auto" (None: Engine sizes itself)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or 'auto', got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    """Every option's help ends with its default."""
    from kivi_jax.cli import add_model_arguments, add_tensor_parallel_argument

    p = argparse.ArgumentParser(
        prog="kivi-serve",
        description="Serve a Llama-family model with a KIVI KV cache over the OpenAI API.",
    )
    add_model_arguments(p)
    add_tensor_parallel_argument(p)
    p.add_argument(
        "--slots",
        type=_slots,
        default=8,
        metavar="N",
        help="requests decoded at once (rows of the KV state), or 'auto': as many as fit the "
        "device's memory (default: 8)",
    )
    p.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        metavar="GB",
        help="device memory (1e9 bytes) the server may hold on each device, the weights "
        "included; the allocator's own limit applies too (default: that limit alone)",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=2048,
        metavar="L",
        help="tokens a request holds: prompt + answer (default: 2048)",
    )
    p.add_argument(
        "--kv-bytes",
        type=float,
        default=None,
        metavar="GB",
        help="bytes (1e9) of the whole KV state, the slots' rings and the page pool together; "
        "the pool is what the slots leave (default: every slot's max-len tokens of pages)",
    )
    p.add_argument(
        "--page-size",
        type=int,
        metavar="P",
        help="tokens a page of the KV pool holds, a multiple of R (default: 128 rounded up to "
        "a multiple of R)",
    )
    p.add_argument(
        "--prefix-sharing",
        action="store_true",
        help="prompts that start with another's sealed pages take them and prefill only the "
        "rest, attending to the prefix's quantized keys and values (+14.5%% perplexity with "
        "kivi2, +0.3%% with kivi4: docs/serving.md) (default: off)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="Q",
        help="requests that may wait for a slot; more are answered 429 (default: 64)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        metavar="C",
        help="the width of a prefill call: prompts up to C tokens are prefilled whole (several "
        "as the rows of one call), longer ones in chunks of C (default: 256)",
    )
    p.add_argument(
        "--prefill-budget",
        type=int,
        default=None,
        metavar="T",
        help="prompt tokens prefilled per scheduler step while requests wait and slots are "
        "free; more fills the slots sooner, at a longer time per output token meanwhile "
        "(default: 8 x the chunk, about one chunk per decode step)",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="one process of a run across hosts (docs/scaling.md): process 0 serves HTTP, the "
        "others follow its engine; the coordinator, process count and id from the three "
        "options below or, where they are not given, from the environment jax.distributed "
        "reads (SLURM, Open MPI, a Cloud TPU slice, JAX_COORDINATOR_ADDRESS...); the mesh is "
        "every process's devices, --tensor-parallel devices a row (default: off)",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="process 0's address, where the others join (implies --distributed) "
        "(default: from the environment)",
    )
    p.add_argument(
        "--num-processes",
        type=int,
        default=None,
        metavar="N",
        help="processes of the run, one per host (implies --distributed) "
        "(default: from the environment)",
    )
    p.add_argument(
        "--process-id",
        type=int,
        default=None,
        metavar="I",
        help="this process's id in [0, N) (implies --distributed) (default: from the environment)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="compile every program at start instead of loading those a previous "
        f"start compiled from {compilation_cache_dir()} (default: the cache is on)",
    )
    p.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S, metavar="S",
                   help="on SIGTERM, seconds the requests in flight may take to finish before "
                   f"they are cancelled (default: {SHUTDOWN_TIMEOUT_S:g})")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from kivi_jax.cli import load_model_from_args, mesh_from_args
    from kivi_jax.loading import ModelLoadError
    from kivi_jax.serving import Engine

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    joined = (args.coordinator, args.num_processes, args.process_id)
    across = args.distributed or any(x is not None for x in joined)
    if across:  # before anything touches a device
        import jax

        from kivi_jax import distributed

        distributed.initialize(*joined)
    leader = not across or jax.process_index() == 0
    sock = None
    if leader:
        try:
            sock = _listen(args.host, args.port)
        except OSError as e:
            sys.stderr.write(f"kivi-serve: error: {e}\n")
            return 2
    if not args.no_compilation_cache:
        _use_compilation_cache()
    try:
        mesh = distributed.global_mesh(args.tensor_parallel) if across else mesh_from_args(args)
        model = load_model_from_args(args, mesh=mesh)
        engine = Engine(
            model.params, kv=args.kv, slots=args.slots, max_len=args.max_len,
            prefill_chunk=args.prefill_chunk, prefill_budget=args.prefill_budget,
            max_queue=args.max_queue,
            kv_bytes=None if args.kv_bytes is None else int(args.kv_bytes * 1e9),
            page_size=args.page_size, prefix_sharing=args.prefix_sharing,
            eos_id=model.tokenizer.eos_id, mesh=mesh,
            memory_budget=None if args.memory_budget is None else int(args.memory_budget * 1e9),
        )  # fmt: skip
    except (ModelLoadError, ValueError) as e:
        if sock is not None:
            sock.close()
        sys.stderr.write(f"kivi-serve: error: {e}\n")
        return 2
    if not leader:  # no HTTP here: the engine's plans come from process 0
        log.info("process %d follows process 0", jax.process_index())
        try:
            engine.warmup()
        except ValueError as e:  # the memory plan (its message names what does not fit)
            sys.stderr.write(f"kivi-serve: error: {e}\n")
            return 2
        engine.follow()
        return 0

    name = os.path.splitext(os.path.basename(os.path.normpath(model.source)))[0]
    app = create_app(
        engine, model.tokenizer, model_name=name, max_len=args.max_len,
        shutdown_timeout=args.shutdown_timeout,
    )  # fmt: skip
    # uvicorn handles SIGTERM (a graceful shutdown), then raises it again under the handler it
    # found at start: this one makes the process end with 0 rather than die by the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    return serve(app, sock, host=args.host, port=args.port)


def serve(app: FastAPI, sock: socket.socket, **config) -> int:
    """Serves create_app's app on the bound socket until a signal or an engine broken past
    repair; returns the exit status: 0, or 1 if the engine (or its warmup) failed."""
    uvicorn_server(app, **config).run(sockets=[sock])
    return 0 if app.state.server.failure is None else 1


if __name__ == "__main__":
    sys.exit(main())
