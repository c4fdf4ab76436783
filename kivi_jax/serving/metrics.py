"""GET /metrics: the server's state in Prometheus' text format (prometheus_client).

Read from the engine at each scrape (EngineStats): queue depth, live and free slots, KV bytes in
use and allocated. Counted by the server: requests by outcome, output tokens (and their rate over
the last RATE_WINDOW_S seconds), time to first token and time per output token.
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

RATE_WINDOW_S = 10.0
# How a request ended: the two finish reasons, the client went away, an engine fault, a 4xx
# for its body, a full queue (429), the server still compiling (503), the server stopping
# before it finished (503).
OUTCOMES = (
    "stop", "length", "disconnected", "error", "invalid", "queue_full", "not_ready", "shutdown"
)  # fmt: skip
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Gauges:
    """Gauges computed when scraped: the engine's stats() and the recent output rate."""

    def __init__(self, engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics

    def collect(self):
        s = self.engine.stats()
        yield GaugeMetricFamily(
            "kivi_output_tokens_per_second",
            f"tokens generated per second over the last {RATE_WINDOW_S:g} s",
            value=self.metrics.tokens_per_s(),
        )
        for name, doc, value in (
            ("kivi_queue_depth", "requests waiting for a slot", s.queue_depth),
            ("kivi_slots_live", "slots holding a request", s.live_slots),
            ("kivi_slots_free", "slots free", s.free_slots),
            ("kivi_kv_bytes_in_use", "KV-state bytes held by live requests", s.kv_bytes_in_use),
            ("kivi_kv_bytes_allocated", "KV-state bytes allocated", s.kv_bytes_allocated),
            ("kivi_pages_total", "pages of the KV pool", s.pages_total),
            ("kivi_pages_used", "pages of the KV pool held by requests", s.pages_used),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("kivi_preemptions", "requests moved to host memory when pages ran out",
             s.preemptions),
            ("kivi_prefill_calls", "prefill calls (batches of prompts and chunks)",
             s.prefill_calls),
            ("kivi_prompt_tokens_computed", "prompt tokens run through the model",
             s.prompt_tokens_computed),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kivi_requests", "requests by outcome", ["outcome"], registry=self.registry
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.tokens = Counter("kivi_output_tokens", "tokens generated", registry=self.registry)
        self.ttft = Histogram(
            "kivi_time_to_first_token_seconds",
            "from submission to the first token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "kivi_time_per_output_token_seconds",
            "a request's time after its first token over its later tokens",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self._recent = collections.deque()  # (perf_counter, tokens) of the last RATE_WINDOW_S
        self._lock = threading.Lock()
        self.registry.register(_Gauges(engine, self))

    def outcome(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def token(self) -> None:
        self.tokens.inc()
        now = time.perf_counter()
        with self._lock:
            if self._recent and now - self._recent[-1][0] < 0.1:  # one entry per 0.1 s
                self._recent[-1][1] += 1
            else:
                self._recent.append([now, 1])
            self._forget(now)

    def tokens_per_s(self) -> float:
        now = time.perf_counter()
        with self._lock:
            self._forget(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def _forget(self, now: float) -> None:
        """Drops the entries older than the window: at most RATE_WINDOW_S / 0.1 + 1 remain,
        scraped or not."""
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
