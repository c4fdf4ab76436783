"""A submitted request's handle: its tokens as they come (iterated, async-iterated or waited
for), its logprobs and finish reason; and the errors a request meets."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numpy as np

from kivi_jax.generate import Sampling


class QueueFullError(RuntimeError):
    """submit() while max_queue requests already wait."""


class EngineError(RuntimeError):
    """An exception inside the engine ended the request (raised when its tokens are read)."""


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A token's log-probability (TokenLogprobs) read back: `top` holds the request's
    `logprobs` most likely (id, logprob), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class RequestHandle:
    """A submitted request: its tokens as they are produced (iterate, async-iterate or
    result()), its finish_reason once done. With `logprobs` asked, `logprobs[i]` is token i's
    Logprob once token i is out, and with `prompt_logprobs` `prompt_logprobs` holds the
    prompt's (None for its first token, which nothing predicts) before the first token is out
    (or the request is done)."""

    def __init__(self, id: int, prompt: np.ndarray, sampling: Sampling, max_new_tokens: int,
                 stops: tuple[int, ...], logprobs: int | None = None,
                 prompt_logprobs: bool = False):  # fmt: skip
        self.id = id
        self.prompt_tokens = len(prompt)
        self.logprobs: list[Logprob] = []
        self.prompt_logprobs: list[Logprob | None] = [None] if prompt_logprobs else []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.submit_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self._prompt, self._sampling, self._max_new, self._stops = (
            prompt, sampling, max_new_tokens, stops
        )  # fmt: skip
        self._logprobs, self._prompt_logprobs = logprobs, prompt_logprobs
        self._page_keys: list[bytes] | None = None  # the engine's, with prefix_sharing
        self._tokens: list[int] = []
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._cancel = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        """The tokens produced so far."""
        with self._cond:
            return list(self._tokens)

    def _wake(self):
        self._cond.notify_all()
        for loop, event in self._waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop was closed
                pass

    @property
    def _extras(self) -> bool:
        """Its programs apply penalties or compute logprobs."""
        return self._sampling.penalized or self._logprobs is not None

    def _push(self, token: int, logprob: Logprob | None = None) -> str | None:
        """Adds a token (and its Logprob); returns the finish_reason it implies, if any."""
        with self._cond:
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            if logprob is not None:
                self.logprobs.append(logprob)
            self._tokens.append(token)
            self._wake()
            if token in self._stops:
                return "stop"
            return "length" if len(self._tokens) >= self._max_new else None

    def _finish(self, reason: str, error: BaseException | None = None):
        with self._cond:
            if self.finish_reason is None:
                self.finish_reason, self.error = reason, error
                self.finish_time = time.perf_counter()
            self._wake()

    def _raise_if_failed(self):
        if self.error is not None:
            raise EngineError(
                f"request {self.id} failed after {len(self._tokens)} tokens: {self.error!r}"
            ) from self.error

    def __iter__(self):
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda i=i: len(self._tokens) > i or self.done)
                new, done = self._tokens[i:], self.done
            yield from new
            i += len(new)
            if done and not new:
                self._raise_if_failed()
                return

    def __aiter__(self):
        return self._async_tokens()

    async def _async_tokens(self):
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event))
        try:
            i = 0
            while True:
                event.clear()
                with self._cond:
                    new, done = self._tokens[i:], self.done
                for t in new:
                    yield t
                i += len(new)
                if done and not new:
                    self._raise_if_failed()
                    return
                if not new:
                    await event.wait()
        finally:
            with self._cond:
                self._waiters.remove((loop, event))

    def result(self, timeout: float | None = None) -> list[int]:
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.id} not finished after {timeout} s")
            self._raise_if_failed()
            return list(self._tokens)
