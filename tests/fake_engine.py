"""A model-free engine behind kivi_jax.serving.Engine's interface (JetStream's mock-engine idea):
each live slot produces one token of a fixed answer per step, so the server's scheduling, faults
and streaming are tested without compiling anything. `fail_next_step(exc)` makes the next step
raise inside the engine, failing the requests it touched; `break_down(exc)` is a fault the
engine cannot recover from (`failure` set, every request ended, the loop stopped)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time

from kivi_jax.serving import EngineError, QueueFullError


@dataclasses.dataclass(frozen=True)
class FakeStats:
    queue_depth: int
    live_slots: int
    free_slots: int
    slots: int
    kv_bytes_allocated: int
    kv_bytes_in_use: int
    requests_finished: dict
    generated_tokens: int
    pages_total: int = 0
    pages_used: int = 0
    preemptions: int = 0
    prefill_calls: int = 0
    prompt_tokens_computed: int = 0


class FakeHandle:
    def __init__(self, id: int, prompt_tokens: int, max_new_tokens: int, stop_ids):
        self.id, self.prompt_tokens = id, prompt_tokens
        self.max_new_tokens, self.stop_ids = max_new_tokens, set(stop_ids)
        self.tokens: list[int] = []
        self.finish_reason = self.error = None
        self.submit_time, self.first_token_time, self.finish_time = time.perf_counter(), None, None
        self._cond = threading.Condition()
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def _notify(self):
        self._cond.notify_all()
        for loop, event in self._wakers:
            loop.call_soon_threadsafe(event.set)

    def _push(self, token: int):
        with self._cond:
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            self.tokens.append(token)
            self._notify()

    def _finish(self, reason: str, error: BaseException | None = None):
        with self._cond:
            if self.finish_reason is None:
                self.finish_reason, self.error = reason, error
                self.finish_time = time.perf_counter()
            self._notify()

    def _end(self):
        if self.finish_reason == "error":
            raise EngineError(f"request {self.id} failed: {self.error!r}")

    def __iter__(self):
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda i=i: len(self.tokens) > i or self.done)
                if len(self.tokens) <= i:
                    self._end()
                    return
                token = self.tokens[i]
            i += 1
            yield token

    async def __aiter__(self):
        event = asyncio.Event()
        with self._cond:
            self._wakers.append((asyncio.get_running_loop(), event))
        i = 0
        while True:
            event.clear()
            if len(self.tokens) > i:
                i += 1
                yield self.tokens[i - 1]
            elif self.done:
                self._end()
                return
            else:
                await event.wait()

    def result(self, timeout=None) -> list[int]:
        with self._cond:
            self._cond.wait_for(lambda: self.done, timeout)
        self._end()
        return list(self.tokens)


class FakeEngine:
    def __init__(self, answer_ids, *, slots=2, max_len=256, max_queue=2, eos_id=None,
                 step_s=0.002):  # fmt: skip
        self.answer_ids, self.slots, self.max_len = list(answer_ids), slots, max_len
        self.max_queue, self.eos_id, self.step_s = max_queue, eos_id, step_s
        self.queue: collections.deque[FakeHandle] = collections.deque()
        self.live: list[FakeHandle] = []
        self.finished = collections.Counter()
        self.generated = 0
        self.submitted: list[FakeHandle] = []
        self._lock = threading.Lock()
        self._fail: BaseException | None = None
        self._thread = None
        self._stop = threading.Event()
        self.warmed = False
        self.failure: BaseException | None = None

    def warmup(self):
        self.warmed = True

    def submit(self, prompt_ids, sampling=None, max_new_tokens=256, stop_ids=(), logprobs=None,
               prompt_logprobs=False):  # fmt: skip
        if len(prompt_ids) + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds max_len {self.max_len}")  # fmt: skip
        with self._lock:
            if len(self.queue) >= self.max_queue:
                raise QueueFullError(f"{self.max_queue} requests already wait")
            h = FakeHandle(len(self.submitted), len(prompt_ids), max_new_tokens, stop_ids)
            self.submitted.append(h)
            self.queue.append(h)
        return h

    def cancel(self, handle):
        with self._lock:
            if handle in self.queue:
                self.queue.remove(handle)
            elif handle in self.live:
                self.live.remove(handle)
            else:
                return
            self.finished["cancelled"] += 1
        handle._finish("cancelled")

    def fail_next_step(self, error: BaseException):
        self._fail = error

    def break_down(self, error: BaseException):
        with self._lock:
            self.failure, ended = error, [*self.queue, *self.live]
            self.queue.clear()
            self.live.clear()
        for h in ended:
            h._finish("error", error)
        self._stop.set()

    def step(self) -> bool:
        with self._lock:
            while self.queue and len(self.live) < self.slots:
                self.live.append(self.queue.popleft())
            live, error, self._fail = list(self.live), self._fail, None
            if error is not None:
                self.live.clear()
        for h in live:
            if error is not None:
                self.finished["error"] += 1
                h._finish("error", error)
                continue
            token = self.answer_ids[len(h.tokens) % len(self.answer_ids)]
            h._push(token)
            self.generated += 1
            reason = None
            if token == self.eos_id or token in h.stop_ids:
                reason = "stop"
            elif len(h.tokens) == h.max_new_tokens:
                reason = "length"
            if reason:
                with self._lock:
                    if h in self.live:
                        self.live.remove(h)
                        self.finished[reason] += 1
                h._finish(reason)
        return bool(self.live or self.queue)

    def start(self):
        def loop():
            while not self._stop.is_set():
                if not self.step():
                    time.sleep(self.step_s)
                time.sleep(self.step_s)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self, timeout=None, cancel=True):
        if not cancel:
            while self.live or self.queue:
                time.sleep(self.step_s)
        for h in list(self.queue) + list(self.live):
            self.cancel(h)
        self._stop.set()
        self.wait(timeout)

    def wait(self, timeout=None):
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> FakeStats:
        with self._lock:
            live = len(self.live)
            return FakeStats(
                queue_depth=len(self.queue), live_slots=live, free_slots=self.slots - live,
                slots=self.slots, kv_bytes_allocated=1000 * self.slots,
                kv_bytes_in_use=1000 * live, requests_finished=dict(self.finished),
                generated_tokens=self.generated,
            )  # fmt: skip
