"""A continuous-batching engine: requests arrive and finish at any time, each in a slot (a row)
of one fixed-shape KV state whose quantized tokens live in a pool of pages, decoded together.

The device side is `kivi_jax.serving.programs` (pure jitted functions over the slots' state and
the pool); the host side here (`Engine`) is the scheduler: a bounded FIFO queue, slot and page
bookkeeping (`kivi_jax.serving.pool`), preemption, and the tokens read back one decode call late
(the next call is dispatched before the previous one's tokens are read), so the device never
waits for the host between calls. A request's handle is `kivi_jax.serving.handle`.

Every device call the scheduler decides is an operation (`Engine._op_*`, named by
`kivi_jax.serving.plan.Op`) with host arguments only: in one process it runs as it is decided;
on a mesh across processes process 0 collects a step's operations into the step's plan,
broadcasts it, and every process runs it (`follow()` in the others).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from kivi_jax import distributed, paged, sharding
from kivi_jax.config import KiviConfig
from kivi_jax.generate import PROMPT_BUCKET, RowSampling, Sampling, resolve_kv
from kivi_jax.memory import memory_report
from kivi_jax.models.llama import LlamaParams
from kivi_jax.serving import plan, programs, sizing
from kivi_jax.serving.handle import EngineError, Logprob, QueueFullError, RequestHandle
from kivi_jax.serving.plan import Op
from kivi_jax.serving.pool import PagePool
from kivi_jax.serving.programs import (
    MAX_LOGPROBS,
    MAX_STOP_IDS,
    PageLayout,
    SlotState,
    TokenLogprobs,
)
from kivi_jax.serving.sizing import MemoryPlan


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """One compiled program of the engine: its compile time and its temporaries on a device."""

    name: str
    compile_s: float
    temp_bytes: int


def _spec(x, sharding=None) -> jax.ShapeDtypeStruct:
    """x's shape and dtype (and `sharding`, if given) without its data."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _trimmed(s: NamedSharding) -> NamedSharding:
    """`s` with its spec's trailing Nones dropped, as compiled programs return it (jit keys its
    programs on the spec as written: P("data", None) and P("data") are two signatures)."""
    spec = list(s.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return NamedSharding(s.mesh, jax.sharding.PartitionSpec(*spec))


def _i32(*shape) -> jax.ShapeDtypeStruct:
    """An int32 host input of `shape` (a numpy array at the call)."""
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _bytes(tree) -> int:
    """Bytes of `tree`'s arrays (concrete or abstract), whole."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _lost(tree) -> bool:
    """Some array of `tree` was deleted (donated to a program that failed)."""
    return any(x.is_deleted() for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (bytes exact, from the arrays' shapes)."""

    queue_depth: int
    live_slots: int  # slots holding a request (prefilling or decoding)
    free_slots: int
    slots: int
    kv_bytes_allocated: int  # the KV state (the slots' parts + the pool) + the prefill scratch
    kv_bytes_in_use: int  # the live slots' parts, the pages in use, the scratch if in use
    kv_slot_bytes: int  # the slots' parts of the KV state: rings, counters, page tables
    kv_pool_bytes: int  # the page pool
    pages_total: int
    pages_used: int
    preemptions: int  # requests moved to host memory when pages ran out
    prefix_hit_tokens: int  # prompt tokens taken from shared pages, not computed
    prefill_scratch_bytes: int  # the full-precision K/V of a chunked prompt (+ its one-row state)
    requests_finished: dict[str, int]  # by finish_reason
    generated_tokens: int
    prompt_tokens: int  # prefilled (of the requests submitted)
    prompt_tokens_computed: int  # real prompt tokens run through the model (padding not counted)
    prefill_calls: int  # jitted prefill calls: batches of short prompts and chunks
    decode_calls: int  # jitted calls of decode_steps steps


@dataclasses.dataclass
class _LongPrompt:
    """A prompt being prefilled chunk by chunk into a reserved slot."""

    request: RequestHandle
    slot: int
    offset: int


@dataclasses.dataclass
class _Preempted:
    """A preempted request (its row in host memory: Engine._saved[request.id]) and the tokens
    the row holds at most."""

    request: RequestHandle
    held: int


@dataclasses.dataclass
class _Tokens:
    """Tokens on the device, not yet read (the matching entry of Engine._results: tokens int32
    [rows, n], their TokenLogprobs or None), and whose they are: {slot: (its request, its
    row)}."""

    owners: dict[int, tuple[RequestHandle, int]]


@dataclasses.dataclass
class _PromptScores:
    """TokenLogprobs [R, C] of a prompt chunk's `count` positions from `offset`, not yet read
    (the matching entry of Engine._results; row 0 read); `last`: the request ends with them
    (max_new_tokens 0)."""

    request: RequestHandle
    slot: int
    offset: int
    count: int
    last: bool


# Engine's method of each operation, by its value (a tuple: indexing it by an Op is C-fast)
_OP_METHODS = tuple(f"_op_{op.name.lower()}" for op in sorted(Op))


def _logprob(scores, at, token: int, k: int) -> Logprob:
    """The Logprob of `token` at index `at` of read-back TokenLogprobs, with k alternatives."""
    ids, lps = scores.top_ids[at][:k].tolist(), scores.top_logprobs[at][:k].tolist()
    top = tuple(zip(ids, lps, strict=True))
    return Logprob(token=token, logprob=float(scores.logprob[at]), top=top)


class Engine:
    """Serves requests as they arrive over one KV state of `slots` rows whose quantized tokens
    live in a pool of pages (docs/serving.md).

    Args:
      params: the model's weights.
      kv: "full", "kivi2", "kivi4", "kivi2-mix", "kivi2-lean" or a KiviConfig.
      slots: requests decoded together (rows of the state: each holds its ring, counters,
        sampling values and page table, a fixed cost); None: as many as fit the device's
        memory beside what is already on it, each with max_len tokens of pages (the programs
        are compiled first to count their temporaries: memory_plan).
      max_len: tokens a request may hold (prompt + max_new_tokens).
      kv_bytes: bytes of the whole KV state, the slots' parts and the pool together, as
        `stats()` counts them; the pool is what the slots leave of it. None: every slot's
        max_len tokens of pages (what `slots` slots reserved at max_len take, max_len
        rounded up to a page).
      page_size: tokens a page holds: a multiple of a KIVI state's residual length R.
        Default: 128 rounded up to a multiple of R (paged.default_page_size: 160 for
        kivi2-lean).
      prefix_sharing: a prompt that starts with the sealed pages of an earlier prompt (its
        tokens R past their end; the pages of a request that ended are kept until needed)
        takes them by reference and prefills only the rest, which then attends to the
        prefix's quantized keys and values (not full precision: a different result from a
        cold prefill, docs/serving.md). Off by default. Refused for a mixed-precision state
        (kivi2-mix, kivi2-lean), whose per-sequence sinks and heavy tokens are not shared.
      prefill_chunk: the width of a prefill call (per "data" shard of a mesh): prompts up to
        this long are prefilled whole, several waiting ones as the rows of one call (rows x
        their bucket's width <= prefill_chunk); longer ones in chunks of this many tokens.
      prefill_budget: prompt tokens prefilled per scheduler step (per "data" shard), in calls
        of prefill_chunk, while requests wait and slots are free (at least one call a step).
        Default: decode_steps x prefill_chunk, about one chunk per decode step: a step's
        prefill then costs several times its decode call, so admitting a burst raises the
        time per output token of the requests decoding meanwhile, but the slots fill (one
        chunk a step leaves most slots empty under long prompts: docs/serving.md).
      max_queue: requests that may wait for a slot; one more is a QueueFullError.
      eos_id: a token that ends every request (finish_reason "stop").
      decode_steps: decode steps per jitted call (tokens are read back once per call).
      mesh: a jax.sharding.Mesh with a "model" axis and optionally "data" (kivi_jax.sharding):
        the params are placed on it (sharding.shard_params) and the state split over it.
        Default: the mesh the params carry, else one device.
      memory_budget: bytes the process may hold on each device, the weights included (the
        device allocator's own limit applies too, the smaller one counts).

    A request is admitted while a slot is free and its slot's pool holds its prompt and its
    first decode call; pages are taken as its tokens reach them and freed when it ends. When a
    decode call's pages run out, the most recently admitted request of that pool is preempted:
    its row and pages are copied to host memory and put back, exactly, once pages are free
    (before any new request is admitted); its handle streams on without a repeat or a gap.

    A decode call runs the slots below the highest one in use, rounded up to a compiled size:
    off a mesh, an engine of 32 slots or more also compiles decode programs for a quarter of its
    slots (rounded up to a multiple of 8), and since a request takes the lowest free slot,
    a light load decodes that many rows, not every slot (`programs.decode`'s rows).

    The state is allocated by warmup() (after it has compiled every program, so that XLA's
    autotuner measures in free memory) or by the first step.

    On a mesh across processes (kivi_jax.distributed) every process builds the engine with the
    same arguments; process 0 takes the requests and schedules, each step's device operations
    are its plan (kivi_jax.serving.plan), broadcast before any of them runs, and every other
    process runs `follow()`, which carries out the plans as they come. A fault there is not
    recovered: the engine breaks (docs/serving.md).

    Raises:
      ValueError: a bad argument, a mesh that does not fit the model or `slots` (not
        divisible by "data"): sharding.check_mesh, or slots whose state, scratch and the
        weights already there exceed the memory limit (the numbers named), before anything
        is allocated.
    """

    def __init__(
        self,
        params: LlamaParams,
        *,
        kv: str | KiviConfig = "kivi2",
        slots: int | None = 8,
        max_len: int = 2048,
        kv_bytes: int | None = None,
        page_size: int | None = None,
        prefix_sharing: bool = False,
        prefill_chunk: int = 256,
        max_queue: int = 64,
        eos_id: int | None = None,
        decode_steps: int = 8,
        mesh: Mesh | None = None,
        memory_budget: int | None = None,
        prefill_budget: int | None = None,
    ):
        if not isinstance(params, LlamaParams):
            raise TypeError(f"params must be LlamaParams, got {type(params).__name__}")
        c = params.config
        optional = {
            "slots": slots,
            "memory_budget": memory_budget,
            "kv_bytes": kv_bytes,
            "prefill_budget": prefill_budget,
            "page_size": page_size,
        }
        for name, value in [("max_len", max_len), ("prefill_chunk", prefill_chunk),
                            ("max_queue", max_queue), ("decode_steps", decode_steps),
                            *((k, v) for k, v in optional.items() if v is not None)]:  # fmt: skip
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_len > c.max_context:
            raise ValueError(f"max_len {max_len} exceeds the model's context of {c.max_context}")
        if eos_id is not None and not 0 <= eos_id < c.vocab_size:
            raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {c.vocab_size})")
        if not isinstance(prefix_sharing, bool):
            raise ValueError(f"prefix_sharing must be a bool, got {prefix_sharing!r}")
        if prefix_sharing and isinstance(resolve_kv(kv), KiviConfig) and resolve_kv(kv).mixed:
            raise ValueError(
                "prefix_sharing is not supported for a mixed-precision state (kivi2-mix, "
                "kivi2-lean): its per-sequence sinks and heavy tokens would not be shared"
            )
        if slots is None and kv_bytes is not None:
            raise ValueError("kv_bytes needs slots (slots=None sizes both to the device)")
        mesh = sharding.mesh_for(params, mesh)
        # the processes of a mesh across several: 0 schedules and sends each step's plan
        self._across = mesh is not None and any(
            d.process_index != jax.process_index() for d in mesh.devices.flat
        )
        if self._across and slots is None:
            raise ValueError(
                "slots=None sizes the engine to this process's devices; on a mesh across "
                "processes pass slots (every process must build the same engine)"
            )
        if mesh is not None:
            sharding.check_mesh(mesh, c, batch=None if slots is None else int(slots))
            params = sharding.shard_params(params, mesh)
            self._devices = list(mesh.devices.flat)
        else:  # committed, so that every program's outputs are (one signature each)
            self._devices = [jax.tree.leaves(params)[0].device]
            params = jax.device_put(params, self._devices[0])
        self.params, self.kv, self.mesh = params, resolve_kv(kv), mesh
        self.prefix_sharing = prefix_sharing
        self.max_len, self.prefill_chunk = int(max_len), int(prefill_chunk)
        self.max_queue, self.eos_id, self.decode_steps = int(max_queue), eos_id, int(decode_steps)
        self.prefill_budget = int(prefill_budget or self.decode_steps * self.prefill_chunk)
        self._rows_per_device = 1 if mesh is None else dict(mesh.shape).get(sharding.DATA_AXIS, 1)
        self._scratch_spec = self._abstract_scratch()
        row = jax.eval_shape(
            functools.partial(programs.empty_row, kv=self.kv, max_len=self.max_len), params
        )
        d = self._rows_per_device
        if page_size is None:
            page_size = paged.default_page_size(self.kv)
        paged.check_page_size(row[0], page_size)
        self._layout = PageLayout(int(page_size), paged.token_axes(row[0]))
        M = self._max_pages = paged.max_pages(self.max_len, self._layout.page_size)
        # one slot's part of the KV state (its ring, counters, table row) and one page, all layers
        slot_part = _bytes(self._abstract_state(1).caches) + 4 * M
        page = _bytes(self._abstract_pool(1))
        on_device = lambda n: sizing.device_bytes(self._abstract_pool(n))  # n pages, shards
        # the one-row states on a device at once: a batch's (one per row) and a long prompt's
        rows = self._batch_rows(PROMPT_BUCKET, 2 * d) + 1
        self._plan = MemoryPlan(
            limit=sizing.device_limit(self._devices, memory_budget),
            in_use=sizing.device_in_use(self._devices, params),
            # d slots: one on each device, with max_len tokens of pages unless kv_bytes sizes
            slot=sizing.device_bytes(self._abstract_state(d)) + 4 * M
            + (M * on_device(d) if kv_bytes is None else 0),
            scratch=sizing.device_bytes(self._scratch_spec) + rows * sizing.device_bytes(row) // d,
            programs=0,
            slots=0 if slots is None else int(slots) // d,
        )  # fmt: skip
        self.programs: list[ProgramCost] = []  # what warmup compiled (or slots=None's sizing)
        if slots is None:
            slots = self._fit_slots()
        self.slots = int(slots)
        if kv_bytes is None:
            pages = self.slots * M
        else:
            pages = (int(kv_bytes) - self.slots * slot_part) // page // d * d
            if pages < d * M:
                raise ValueError(
                    f"kv_bytes={kv_bytes}: {self.slots} slots take {self.slots * slot_part} "
                    f"bytes (rings, counters, page tables), leaving {max(pages, 0)} pages of "
                    f"{page} bytes; a request of max_len={self.max_len} needs {M}"
                    + (f" in each of the {d} 'data' shards" if d > 1 else "")
                )
            self._plan = dataclasses.replace(self._plan, pool=on_device(pages))
        self._plan.check()
        self._pages = PagePool(pages=pages, shards=d, slots=self.slots, max_pages=M,
                               page_size=self._layout.page_size,
                               unit=1 if self.kv is None else self.kv.group_size)  # fmt: skip
        self._state_spec = self._abstract_state(self.slots)
        self._pool_spec = self._abstract_pool(pages)
        self._state: SlotState | None = None  # allocated by warmup() or the first step
        self._pool: tuple | None = None
        self._scratch: tuple | None = None
        self._slot_bytes, self._page_bytes = self.slots * slot_part, page
        self._scratch_bytes = (
            sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((self._scratch_spec, row)))
            + (rows - 1) * memory_report(row).total_bytes
        )
        self._lock = threading.Lock()  # the queue, the slots, the counters
        self._step_lock = threading.Lock()  # one scheduler step at a time
        self._work = threading.Condition(self._lock)
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._occupant: list[RequestHandle | None] = [None] * self.slots
        self._long: _LongPrompt | None = None
        # device results not yet read, in order: _Tokens and _PromptScores (process 0), and
        # their arrays (every process: what the device operations returned, one entry each)
        self._events: collections.deque = collections.deque()
        self._results: collections.deque = collections.deque()
        # the device side of the operations (Engine._op_*): the last prefill_batch's (logits,
        # states), a long prompt's one-row state and last logits, preempted rows in host memory
        self._batch: tuple | None = None
        self._long_row: tuple | None = None
        self._long_logits: jax.Array | None = None
        self._saved: dict[int, tuple] = {}
        # across processes, process 0's operations of the step not yet sent (None: run at once)
        self._ops: list[tuple] | None = [] if self._across else None
        self._codec = plan.Codec((self.slots, self._max_pages)) if self._across else None
        self._ids = itertools.count()
        self._finished: collections.Counter = collections.Counter()
        self._generated = self._prompted = self._decode_calls = 0
        self._computed = self._prefill_calls = self._preemptions = 0
        self._bound = [0] * self.slots  # tokens each slot's row holds at most after the calls made
        self._salt = repr((self.kv, jnp.dtype(params.dtype).name, self._layout.page_size))
        self._shared = [0] * self.slots  # each slot's leading pages taken by reference
        self._hit_tokens = 0
        self._order: dict[RequestHandle, int] = {}  # admission order of the admitted requests
        self._admissions = itertools.count()
        self._preempted: collections.deque[_Preempted] = collections.deque()
        self._accepting, self._thread, self._running = True, None, False
        self.failure: BaseException | None = None  # the fault the engine could not recover from

    @property
    def memory_plan(self) -> MemoryPlan:
        """The engine's bytes on one device (the fullest of a mesh; `slots` per device) against
        its limit; `programs` is counted once warmup() has compiled them."""
        return self._plan

    # ------------------------------------------------------------------------- public

    def submit(
        self,
        prompt_ids: Sequence[int],
        sampling: Sampling | None = None,
        max_new_tokens: int = 256,
        stop_ids: Sequence[int] = (),
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
    ) -> RequestHandle:
        """Queues a request; returns its handle. Thread-safe.

        logprobs: None, or each token's Logprob with this many alternatives (at most
          MAX_LOGPROBS) in handle.logprobs. A request with logprobs or a penalty runs the
          programs that compute them (`extras`) and with it every request decoded meanwhile.
        prompt_logprobs: (with logprobs) the prompt's own in handle.prompt_logprobs: its
          prompt is prefilled in chunks (the chunk program that returns every position's
          logits), whatever its length.
        max_new_tokens: 0 generates nothing: the request ends once its prompt's logprobs are
          read, or without prompt_logprobs at once (finish_reason "length")."""
        if self._across and jax.process_index() != 0:
            raise RuntimeError(
                f"process {jax.process_index()} follows process 0, which takes the requests"
            )
        V = self.params.config.vocab_size
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"prompt_ids must be a non-empty sequence of ints, got {prompt_ids!r}")
        bad = np.flatnonzero((prompt < 0) | (prompt >= V))
        if bad.size:
            raise ValueError(
                f"prompt token id {prompt[bad[0]]} at {bad[0]} is outside the vocabulary [0, {V})"
            )
        sampling = Sampling() if sampling is None else sampling
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a Sampling or None, got {type(sampling).__name__}")
        if logprobs is not None and (
            not isinstance(logprobs, int | np.integer) or not 0 <= logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {logprobs!r}")
        if prompt_logprobs and logprobs is None:
            raise ValueError("prompt_logprobs needs logprobs (the alternatives to report)")
        if not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = "
                f"{len(prompt) + max_new_tokens} exceeds the engine's max_len of {self.max_len}"
            )
        stops = [int(t) for t in stop_ids]
        for t in [*stops, sampling.eos_id]:
            if t is not None and not 0 <= t < V:
                raise ValueError(f"stop id {t} is outside the vocabulary [0, {V})")
        stops = tuple(
            dict.fromkeys(t for t in [*stops, self.eos_id, sampling.eos_id] if t is not None)
        )
        if len(stops) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop ids (eos included), got {len(stops)}")
        with self._lock:
            if self.failure is not None:
                raise RuntimeError(f"the engine stopped after a fault: {self.failure!r}")
            if not self._accepting:
                raise RuntimeError("the engine is stopped")
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self._queue)} requests already wait (max_queue={self.max_queue})"
                )
            h = RequestHandle(next(self._ids), prompt.astype(np.int32), sampling,
                              int(max_new_tokens), stops, logprobs, prompt_logprobs)  # fmt: skip
            if max_new_tokens == 0 and not prompt_logprobs:  # nothing to run
                self._end(h, "length")
                return h
            self._queue.append(h)
            self._work.notify_all()
        return h

    def cancel(self, handle: RequestHandle) -> None:
        """Ends the request (finish_reason "cancelled"); its slot is freed at the next step."""
        with self._lock:
            if handle.done:
                return
            if handle in self._queue:
                self._queue.remove(handle)
                self._end(handle, "cancelled")
            else:
                handle._cancel = True
            self._work.notify_all()

    def step(self) -> bool:
        """One scheduler iteration: free cancelled slots, put preempted requests back, admit
        (prefill up to prefill_budget prompt tokens: batches of short prompts, chunks of a long
        one), one decode call, read back the previous call's tokens. Returns True while work
        remains.

        A fault ends only the requests it touched, with finish_reason "error" (iterating their
        handles raises EngineError): a request's own prefill, chunk or insert ends that
        request; the shared decode call (or reading its tokens) ends the requests of the state,
        which is then freed and allocated again. If it cannot be, the engine is broken:
        `failure` is set, every request ends with it, submit() refuses, the thread stops and
        step() raises EngineError."""
        with self._step_lock:
            if self.failure is None:
                self._allocate_or_break()
            if self.failure is not None:
                raise EngineError(f"the engine stopped after a fault: {self.failure!r}")
            if self._across and self._ops is None:
                raise EngineError("the engine is stopped (its other processes returned)")
            try:
                self._cancelled()
                self._admit()
                dispatched = self._decode_call()
                if self._ops is not None:
                    self._send(reads=max(len(self._events) - (1 if dispatched else 0), 0))
                self._drain(keep=1 if dispatched else 0)
            except Exception as e:  # a fault none of the above could place: nothing is trusted
                self._break(e)
                raise EngineError(f"the engine stopped after a fault: {e!r}") from e
            return self._busy()

    def start(self) -> Engine:
        """Runs the scheduler in a background daemon thread (not after stop())."""
        if not self._accepting:
            raise RuntimeError("the engine is stopped")
        if self._thread is None:
            self._running = True
            self._thread = threading.Thread(target=self._loop, name="kivi-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = None, cancel: bool = True) -> None:
        """Stops accepting requests; cancels (or, cancel=False, finishes) those in flight and
        waits for the background thread. Across processes, process 0's stop then ends the
        others' follow() (unless the engine broke)."""
        with self._lock:
            self._accepting = False
            if cancel:
                waiting = [p.request for p in self._preempted]
                for h in [*self._queue, *(o for o in self._occupant if o is not None), *waiting]:
                    if h in self._queue:
                        self._queue.remove(h)
                        self._end(h, "cancelled")
                    else:
                        h._cancel = True
            self._running = False
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        else:  # steps until what was in flight is freed (none: no step, so no wait on warmup)
            while self.failure is None and self._busy() and self.step():
                pass
        if self._ops is not None and self.failure is None:  # the followers return
            with self._step_lock:
                ops, self._ops = self._ops, None
                plan.send(self._codec.encode([*ops, (Op.STOP,)]))
                for op, *args in ops:  # what the last steps left (resets of ended rows)
                    self._run(op, *args)

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the background thread ends: after stop(), or after a fault the engine
        could not recover from (`failure`)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def warmup(self) -> None:
        """Compiles every program the engine runs (each prompt bucket, the chunk, insert,
        reset, decode; greedy and sampled) before the state is allocated, then checks that the
        state, the scratch and the largest program's temporaries fit the device
        (memory_plan; a ValueError naming the numbers if not) and allocates them. It runs no
        program, so it touches no request and may be called at any time."""
        with self._step_lock:
            if not self.programs:
                row, logits = self._compile_prompt_programs()
                self._compile_slot_programs(self.slots, self._pages.total, row, logits)
                most = max(cost.temp_bytes for cost in self.programs)
                self._plan = dataclasses.replace(self._plan, programs=most)
                if self._state is None:
                    self._plan.check()
            self._allocate()

    def stats(self) -> EngineStats:
        with self._lock:
            live = sum(o is not None for o in self._occupant)
            scratch_used = self._scratch_bytes if self._long is not None else 0
            pool = self._pages.total * self._page_bytes
            return EngineStats(
                queue_depth=len(self._queue),
                live_slots=live,
                free_slots=self.slots - live,
                slots=self.slots,
                kv_bytes_allocated=self._slot_bytes + pool + self._scratch_bytes,
                kv_bytes_in_use=self._slot_bytes * live // self.slots
                + self._pages.used * self._page_bytes
                + scratch_used,
                kv_slot_bytes=self._slot_bytes,
                kv_pool_bytes=pool,
                pages_total=self._pages.total,
                pages_used=self._pages.used,
                preemptions=self._preemptions,
                prefix_hit_tokens=self._hit_tokens,
                prefill_scratch_bytes=self._scratch_bytes,
                requests_finished=dict(self._finished),
                generated_tokens=self._generated,
                prompt_tokens=self._prompted,
                prompt_tokens_computed=self._computed,
                prefill_calls=self._prefill_calls,
                decode_calls=self._decode_calls,
            )

    # ------------------------------------------------------------------------- scheduler

    def _abstract_state(self, slots: int) -> SlotState:
        """The shapes, dtypes and shardings of the state of `slots` rows (nothing allocated)."""
        return self._abstract(lambda: self._empty_state(slots), programs.state_sharding)

    def _abstract_pool(self, pages: int) -> tuple:
        """The shapes, dtypes and shardings of a pool of `pages` pages (nothing allocated)."""
        return self._abstract(lambda: self._empty_pool(pages), sharding.cache_sharding)

    def _abstract(self, build, shardings_on):
        """`build()`'s shapes and dtypes, placed on the one device or, on a mesh, as
        `shardings_on(tree, mesh)` places them."""
        tree = jax.eval_shape(build)
        if self.mesh is None:
            shardings = jax.tree.map(lambda _: SingleDeviceSharding(self._devices[0]), tree)
        else:
            shardings = jax.tree.map(_trimmed, shardings_on(tree, self.mesh))
        return jax.tree.map(_spec, tree, shardings)

    def _empty_state(self, slots: int) -> SlotState:
        p = self.params
        caches, _ = programs.empty_paged(p, self.kv, slots, 1, self.max_len, self._layout)
        return programs.empty_state(caches, slots, p.config.vocab_size)

    def _empty_pool(self, pages: int) -> tuple:
        return programs.empty_paged(self.params, self.kv, 1, pages, self.max_len, self._layout)[1]

    def _abstract_scratch(self) -> tuple:
        """The chunked prompt's full-precision K/V per layer: (k, v) [R, P, H, D], P the
        multiple of prefill_chunk that covers max_len (R = programs.prompt_rows); on a mesh in its
        shards (sharding.scratch_spec)."""
        p, C = self.params, self.prefill_chunk
        shape = (
            programs.prompt_rows(p),
            -(-self.max_len // C) * C,
            programs.kv_heads(p),
            p.config.head_dim,
        )
        if self.mesh is None:
            where = SingleDeviceSharding(self._devices[0])
        else:
            where = _trimmed(NamedSharding(self.mesh, sharding.scratch_spec(self.mesh)))
        one = jax.ShapeDtypeStruct(shape, p.dtype, sharding=where)
        return tuple((one, one) for _ in range(p.config.num_layers))

    def _allocate(self) -> None:
        """The slots' state, the pool and the prefill scratch on the device, if not there yet."""
        where = lambda specs: jax.tree.map(lambda x: x.sharding, specs)
        if self._state is None:
            empty = functools.partial(self._empty_state, self.slots)
            self._state = jax.jit(empty, out_shardings=where(self._state_spec))()
        if self._pool is None:
            empty = functools.partial(self._empty_pool, self._pages.total)
            self._pool = jax.jit(empty, out_shardings=where(self._pool_spec))()
        if self._scratch is None:
            zeros = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), self._scratch_spec)
            self._scratch = jax.jit(zeros, out_shardings=where(self._scratch_spec))()

    def _compile(self, name: str, fn, *args, **static):
        """Compiles fn(*args, **static) ahead of its first call (jit reuses the program), records
        its cost, and returns the shapes and shardings of its outputs."""
        t0 = time.perf_counter()
        lowered = fn.lower(*args, **static)
        compiled = lowered.compile()
        self.programs.append(
            ProgramCost(name, time.perf_counter() - t0, sizing.temp_bytes(compiled))
        )
        return jax.tree.map(_spec, lowered.out_info, compiled.output_shardings)

    def _compile_prompt_programs(self):
        """The programs that do not depend on the slots: each prompt bucket's prefill, the
        chunk and the echo's chunk. Returns the specs of a prefilled one-row state and its
        logits."""
        p, kv, L, C = self.params, self.kv, self.max_len, self.prefill_chunk
        r = programs.prompt_rows(p)
        empty = self._compile("empty_row", programs.empty_row, p, kv=kv, max_len=L)
        for w in self._buckets():
            for n in sorted({self._batch_rows(w, 1), self._batch_rows(w, 2 * r)}):
                logits, rows = self._compile(
                    f"prefill_batch[{n}x{w}]",
                    programs.prefill_batch,
                    p,
                    _i32(n, w),
                    _i32(n),
                    kv=kv,
                    max_len=L,
                )
        chunk = (p, _i32(r, C), _i32(), _i32(r), self._scratch_spec, empty)
        if L > C:  # a prompt may need chunks
            self._compile(f"prefill_chunk[{C}]", programs.prefill_chunk, *chunk)
        self._compile(f"echo_chunk[{C}]", programs.echo_chunk, *chunk, _i32(r, C))
        return rows[0], logits[0]

    def _compile_slot_programs(self, slots: int, pages: int, row, logits) -> None:
        """insert (greedy, sampled), decode (each with or without extras), reset, a
        preemption's save and restore, and with prefix_sharing the shared prefix's read, for a
        state of `slots` rows and `pages` pages."""
        p, state, pool = self.params, self._abstract_state(slots), self._abstract_pool(pages)
        table = _i32(slots, self._max_pages)
        rows = jax.tree.map(_spec, RowSampling.of([Sampling()]))
        prompted = jax.ShapeDtypeStruct((1, p.config.vocab_size), bool)
        stops = _i32(1, MAX_STOP_IDS)
        kw = dict(mesh=self.mesh, layout=self._layout)
        for sampled in (False, True):
            kind = "sampled" if sampled else "greedy"
            self._compile(
                f"insert_row[{kind}]",
                programs.insert_row,
                state,
                pool,
                table,
                row,
                logits,
                rows,
                prompted,
                _i32(1),
                stops,
                _i32(),
                sampled=sampled,
                **kw,
            )
            for extras, n in itertools.product((False, True), self._decode_rows(slots)):
                self._compile(f"decode[{kind}{', extras' if extras else ''}, "
                              f"{self.decode_steps} steps, {n} rows]", programs.decode, p,
                              state, pool, table, steps=self.decode_steps, sampled=sampled,
                              extras=extras, layout=self._layout, rows=n)  # fmt: skip
        self._compile("reset", programs.reset, p, state, _i32(), kv=self.kv, layout=self._layout)
        saved = self._compile("save_row", programs.save_row, state, pool, table, _i32(),
                              layout=self._layout)  # fmt: skip
        self._compile("restore_row", programs.restore_row, state, pool, table, saved, _i32(), **kw)
        if self.prefix_sharing:
            self._compile("shared_prefix", programs.shared_prefix, p, pool,
                          _i32(1, self._max_pages), _i32(), self._scratch_spec, kv=self.kv,
                          max_len=self.max_len, layout=self._layout)  # fmt: skip

    def _decode_rows(self, slots: int) -> tuple[int, ...]:
        """The rows of the decode programs of an engine of `slots` slots (the class doc):
        (slots,), or off a mesh from 32 slots on (a quarter of them rounded up to 8, slots)."""
        quarter = -(-slots // 32) * 8
        return (slots,) if self.mesh is not None or slots < 32 else (quarter, slots)

    def _rows_for(self, top: int) -> int:
        """The decode program's rows for a call whose live slots all lie below `top`."""
        return next(r for r in self._decode_rows(self.slots) if r >= top)

    def _fit_slots(self) -> int:
        """slots=None: compiles the programs, then takes as many slots as fit the limit beside
        the weights, the scratch and the largest program's temporaries. The decode program's
        temporaries grow with the slots: taken as proportional to them from its last compile,
        and the slot programs compiled again at fewer slots while the plan overshoots."""
        if self._plan.limit is None:
            raise ValueError(
                "slots=None sizes the engine to the device's memory, which this device does not "
                "report: pass memory_budget (bytes) or slots"
            )
        dataclasses.replace(self._plan, slots=1).check()  # before anything compiles
        row, logits = self._compile_prompt_programs()
        prompt_costs = list(self.programs)
        prompt_temps = max(cost.temp_bytes for cost in prompt_costs)
        plan, d, per_slot, M = self._plan, self._rows_per_device, 0.0, self._max_pages
        rest = plan.limit - plan.in_use - plan.scratch - plan.reserve
        for _ in range(4):
            slots = min((rest - prompt_temps) // plan.slot, int(rest // (plan.slot + per_slot)))
            plan = dataclasses.replace(plan, slots=max(slots, 0), programs=prompt_temps)
            if plan.slots == 0:
                break
            self.programs = list(prompt_costs)
            self._compile_slot_programs(plan.slots * d, plan.slots * d * M, row, logits)
            slot_temps = max(cost.temp_bytes for cost in self.programs[len(prompt_costs) :])
            plan = dataclasses.replace(plan, programs=max(prompt_temps, slot_temps))
            per_slot = slot_temps / plan.slots
            if plan.fits:
                break
        self._plan = plan
        plan.check()
        return plan.slots * d

    def _buckets(self) -> list[int]:
        """Prompt widths of the one-call prefill: PROMPT_BUCKET doubled up to the longest such
        prompt (prefill_chunk or max_len, rounded up to a PROMPT_BUCKET multiple), so that few
        programs cover every prompt."""
        longest = min(self.prefill_chunk, self.max_len)
        top = -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET
        widths = [PROMPT_BUCKET]
        while widths[-1] < top:
            widths.append(min(2 * widths[-1], top))
        return widths

    def _new_row(self):
        """The empty one-row state a chunked prompt starts from, committed to the device(s) as
        the chunk program's outputs are (its first chunk and the next ones: one signature).
        Its program reads no input array, so on one device its output would be uncommitted."""
        row = programs.empty_row(self.params, kv=self.kv, max_len=self.max_len)
        return row if self.mesh is not None else jax.device_put(row, self._devices[0])

    def _prefix_pages(self, slot: int) -> np.ndarray:
        """int32 [1, M]: the slot's shared prefix's pages, then NO_PAGE."""
        pages = np.full((1, self._max_pages), paged.NO_PAGE, np.int32)
        pages[0, : self._shared[slot]] = self._pages.table[slot, : self._shared[slot]]
        return pages

    def _bucket(self, n: int) -> int:
        return next(w for w in self._buckets() if w >= n)

    def _batch_rows(self, width: int, prompts: int) -> int:
        """Rows of the batched prefill of `prompts` prompts at `width`: one per "data" shard
        while they fit (one prompt alone computes only its width), else as many per shard as
        fit prefill_chunk (two programs a width)."""
        d = programs.prompt_rows(self.params)
        return d if prompts <= d else d * max(1, self.prefill_chunk // width)

    def _is_long(self, h: RequestHandle) -> bool:
        """(Under the lock.) Prefilled in chunks: longer than prefill_chunk, its prompt's
        logprobs asked, or a prefix in shared pages."""
        shards = range(self._rows_per_device)
        return (
            len(h._prompt) > self.prefill_chunk
            or h._prompt_logprobs
            or any(self._hits(h, shard) for shard in shards)
        )

    def _page_keys(self, h: RequestHandle) -> list[bytes]:
        """The keys of the prompt's whole pages: each the hash of the previous page's key and
        its tokens (the first's: of the engine's kv, dtype and page size)."""
        if h._page_keys is None:
            ps, key, keys = self._layout.page_size, self._salt.encode(), []
            for m in range(len(h._prompt) // ps):
                page = h._prompt[m * ps : (m + 1) * ps].astype(np.int32).tobytes()
                key = hashlib.blake2b(key + page, digest_size=16).digest()
                keys.append(key)
            h._page_keys = keys
        return h._page_keys

    def _hits(self, h: RequestHandle, shard: int) -> list[int]:
        """(Under the lock.) The shared pages of `shard` the prompt starts with that it may
        take: as many as leave R tokens to prefill after them (so that they stay sealed),
        ending at a multiple of prefill_chunk (a chunk's offset)."""
        if not self.prefix_sharing or h._prompt_logprobs:
            return []
        hits = self._pages.hits(shard, self._page_keys(h))
        ps, r = self._layout.page_size, 0 if self.kv is None else self.kv.residual_length
        k = min(len(hits), (len(h._prompt) - max(r, 1)) // ps)
        while k > 0 and k * ps % self.prefill_chunk:
            k -= 1
        return hits[:k]

    def _pending(self) -> bool:
        """(Under the lock.) Requests wait, run or are preempted, or results are unread."""
        return bool(self._queue or self._events or any(self._occupant) or self._preempted)

    def _busy(self) -> bool:
        with self._lock:
            return self._pending()

    def _end(self, h: RequestHandle, reason: str, error=None) -> None:
        h._finish(reason, error)
        self._finished[reason] += 1
        self._order.pop(h, None)

    def _free(self, slot: int) -> None:
        """The slot's row back to empty, then free with its pages (the step thread only; the
        dispatch is made without the lock, so that submit() and stats() never wait on the
        device)."""
        try:
            self._do(Op.RESET, slot)
        except Exception as e:  # the state was donated: it is lost
            self._state_fault(e)
            return
        with self._lock:
            self._occupant[slot] = None
            self._pages.release(slot)

    def _release(self, h: RequestHandle) -> None:
        """An ended request's slot freed, or its preempted copy dropped."""
        slot = next((s for s, o in enumerate(self._occupant) if o is h), None)
        if slot is not None:
            self._free(slot)
            return
        with self._lock:
            dropped = [p for p in self._preempted if p.request is h]
            self._preempted = collections.deque(p for p in self._preempted if p.request is not h)
        for p in dropped:
            self._do(Op.DROP, p.request.id)

    def _cancelled(self) -> None:
        with self._lock:
            for h in [*self._occupant, *(p.request for p in self._preempted)]:
                if h is not None and h._cancel and not h.done:
                    self._end(h, "cancelled")
            dropped = [p for p in self._preempted if p.request.done]
            self._preempted = collections.deque(p for p in self._preempted if not p.request.done)
            done = [s for s, h in enumerate(self._occupant) if h is not None and h.done]
        for p in dropped:
            self._do(Op.DROP, p.request.id)
        for slot in done:
            if self._long is not None and self._long.slot == slot:
                self._long = None
            self._free(slot)

    def _first_tokens(self, h: RequestHandle, held: int) -> int:
        """Tokens the request's row holds after one more decode call, from `held` (a row
        appends one token a step, the last token it generates not appended)."""
        return min(held + self.decode_steps, len(h._prompt) + max(h._max_new - 1, 0))

    def _place(self, h: RequestHandle, held: int, free: list[int], share: bool = True):
        """(Under the lock.) The first of the `free` slots whose pool part holds the request's
        `held` tokens and its next decode call's, beside what the decoding rows need for
        theirs: its pages taken (with `share`, its prefix's shared pages first), the request its
        occupant (the slot removed from `free`); None if no slot's pool has the pages."""
        want = self._first_tokens(h, held)
        for slot in free:
            shard = self._pages.shard(slot)
            hits = self._hits(h, shard) if share else []
            kept = sum(self._pages.is_kept(p) for p in hits)
            spare = self._pages.free(shard) - kept - self._next_call_pages(shard)
            if self._pages.missing(slot, want) - len(hits) <= spare:
                self._pages.share(slot, hits)
                self._shared[slot] = len(hits)
                self._pages.grow(slot, want)
                free.remove(slot)
                self._occupant[slot], self._bound[slot] = h, held
                self._order.setdefault(h, next(self._admissions))
                return slot
        return None

    def _next_call_pages(self, shard: int) -> int:
        """(Under the lock.) Pages the shard's decoding rows lack for the next decode call: kept
        back from admissions, which would otherwise take them and be preempted by _make_room."""
        rows = [s for s in self._decoding() if self._pages.shard(s) == shard]
        return sum(self._pages.missing(s, self._first_tokens(self._occupant[s], self._bound[s]))
                   for s in rows)  # fmt: skip

    def _decoding(self) -> list[int]:
        """(Under the lock.) The slots whose request decodes (not ended, not prefilling)."""
        long = None if self._long is None else self._long.slot
        return [s for s, h in enumerate(self._occupant) if h is not None and not h.done
                and s != long]  # fmt: skip

    def _make_room(self) -> None:
        """Every decoding row's pages for the next decode call: where a shard's pool lacks
        them, its most recently admitted decoding request is preempted, until they fit."""
        while True:
            with self._lock:
                rows = self._decoding()
                want = {s: self._first_tokens(self._occupant[s], self._bound[s]) for s in rows}
                need = collections.Counter()
                for s in rows:
                    need[self._pages.shard(s)] += self._pages.missing(s, want[s])
                short = [shard for shard, n in need.items() if n > self._pages.free(shard)]
                if not short:
                    for s in rows:
                        self._pages.grow(s, want[s])
                    return
                mine = [s for s in rows if self._pages.shard(s) == short[0]]
                victim = max(mine, key=lambda s: self._order[self._occupant[s]])
            if not self._preempt(victim):
                return

    def _preempt(self, slot: int) -> bool:
        """The slot's request preempted: its row and pages copied to host memory (waiting for
        the calls made before), the slot freed. False if the state was lost on the way."""
        h = self._occupant[slot]
        try:
            self._do(Op.SAVE, self._pages.table.copy(), slot, h.id)
        except Exception as e:  # a call before it failed: the state is not trusted
            self._state_fault(e)
            return False
        with self._lock:
            self._preempted.append(_Preempted(h, self._bound[slot]))
            self._preemptions += 1
        self._free(slot)
        return self._state is not None

    def _restore(self) -> bool:
        """Preempted requests back into free slots, oldest first, while their pages fit;
        True when none waits any more."""
        while self._preempted:
            with self._lock:
                p = self._preempted[0]
                free = [s for s, o in enumerate(self._occupant) if o is None]
                slot = self._place(p.request, p.held, free, share=False)
                if slot is None:
                    return False
                self._preempted.popleft()
            try:
                self._do(Op.RESTORE, self._pages.table.copy(), slot, p.request.id)
            except Exception as e:
                self._request_fault(p.request, slot, e)
        return True

    def _admit(self) -> None:
        """Prefills up to prefill_budget prompt tokens (per "data" shard) in FIFO order: the
        waiting short prompts as batched calls of at most prefill_chunk tokens, a long one in
        chunks."""
        budget = self.prefill_budget
        while budget > 0:
            waiting = not self._restore()  # preempted requests come back first (no budget)
            if self._long is not None:
                self._chunk()
                budget -= self.prefill_chunk
                continue
            if waiting:  # nothing new before them
                return
            with self._lock:
                free = [s for s, o in enumerate(self._occupant) if o is None]
                if not free or not self._queue:
                    return
                if self._is_long(self._queue[0]):
                    h, batch = self._queue[0], None
                    slot = self._place(h, len(h._prompt), free)
                    if slot is None:
                        return
                    self._queue.popleft()
                else:
                    batch = self._take_batch(free, min(budget, self.prefill_chunk))
                    if not batch:
                        return
            if batch is not None:
                budget -= self._prefill(batch)
                continue
            shared = self._shared[slot] * self._layout.page_size
            try:
                if shared:
                    self._do(Op.PREFIX_ROW, self._prefix_pages(slot), shared)
                else:
                    self._do(Op.NEW_ROW)
            except Exception as e:
                self._request_fault(h, slot, e)
                continue
            self._hit_tokens += shared
            self._long = _LongPrompt(request=h, slot=slot, offset=shared)

    def _take_batch(self, free: list[int], budget: int) -> list[tuple[RequestHandle, int]]:
        """(Under the lock.) The short prompts at the queue's head that one batched call of at
        most `budget` tokens per "data" shard holds, each given a free slot whose pool holds
        it (none if the first does not fit)."""
        d, batch, longest = programs.prompt_rows(self.params), [], 0
        while self._queue and free and not self._is_long(self._queue[0]):
            h = self._queue[0]
            n = max(longest, len(h._prompt))
            if batch and len(batch) >= d * max(1, budget // self._bucket(n)):
                break
            slot = self._place(h, len(h._prompt), free)
            if slot is None:
                break
            self._queue.popleft()
            longest = n
            batch.append((h, slot))
        return batch

    def _prefill(self, batch: list[tuple[RequestHandle, int]]) -> int:
        """One programs.prefill_batch call of the batch's prompts, then each inserted into its slot.
        A fault in the call ends the batch's requests; in an insert, that request's. Returns
        the call's tokens per "data" shard."""
        width = self._bucket(max(len(h._prompt) for h, _ in batch))
        rows = self._batch_rows(width, len(batch))
        tokens, lengths = np.zeros((rows, width), np.int32), np.ones(rows, np.int32)
        for i, (h, _) in enumerate(batch):
            tokens[i, : len(h._prompt)], lengths[i] = h._prompt, len(h._prompt)
        cost = rows // programs.prompt_rows(self.params) * width
        try:
            self._do(Op.PREFILL, tokens, lengths)
        except Exception as e:
            for h, slot in batch:
                self._request_fault(h, slot, e)
            return cost
        self._prefill_calls += 1
        self._computed += int(lengths[: len(batch)].sum())
        for i, (h, slot) in enumerate(batch):
            if h.done:  # ended by a fault of the state in an earlier insert
                continue
            try:
                self._insert(h, slot, i)
            except Exception as e:
                self._request_fault(h, slot, e)
        if self._ops is None:  # the rows are inserted (across processes: after the plan runs)
            self._batch = None
        return cost

    def _chunk(self) -> None:
        lp, C = self._long, self.prefill_chunk
        h = lp.request
        part = h._prompt[lp.offset : lp.offset + C]
        r = programs.prompt_rows(self.params)
        tokens = np.zeros((r, C), np.int32)
        tokens[:, : len(part)] = part
        following = None
        if h._prompt_logprobs:
            following = np.zeros((r, C), np.int32)
            after = h._prompt[lp.offset + 1 : lp.offset + C + 1]
            following[:, : len(after)] = after
        try:
            self._do(Op.CHUNK, tokens, lp.offset, np.full(r, len(part), np.int32), following)
            self._prefill_calls += 1
            self._computed += len(part)
            offset, lp.offset = lp.offset, lp.offset + len(part)
            last = lp.offset == len(h._prompt)
            if h._prompt_logprobs:
                ends = last and h._max_new == 0
                self._events.append(_PromptScores(h, lp.slot, offset, len(part), ends))
            if last:
                self._long = None
                if h._max_new > 0:
                    self._insert(h, lp.slot, -1)
        except Exception as e:
            self._long = None
            self._request_fault(h, lp.slot, e)

    def _insert(self, h: RequestHandle, slot: int, source: int) -> None:
        """The request's prefilled row (row `source` of the last batch, -1 the long prompt's)
        into `slot`."""
        s = h._sampling
        stops = np.full((1, MAX_STOP_IDS), -1, np.int32)
        stops[0, : len(h._stops)] = h._stops
        table = self._pages.table.copy()
        table[slot, : self._shared[slot]] = paged.NO_PAGE  # shared pages are not written
        rows = jax.tree.leaves(RowSampling.of([s]))
        self._do(Op.INSERT, table, source, slot, h._prompt, np.array([h._max_new], np.int32),
                 stops, s.temperature > 0, *rows)  # fmt: skip
        self._events.append(_Tokens({slot: (h, 0)}))
        if self.prefix_sharing:  # its prompt's pages R tokens behind its end are final
            r = 0 if self.kv is None else self.kv.residual_length
            with self._lock:
                sealed = (len(h._prompt) - r) // self._layout.page_size
                self._pages.register(slot, self._page_keys(h)[:sealed])
        self._prompted += h.prompt_tokens

    def _decode_call(self) -> bool:
        self._make_room()
        if self._state is None:  # lost while preempting
            return False
        with self._lock:
            live = tuple(
                None if h is None or (self._long is not None and self._long.slot == s) else h
                for s, h in enumerate(self._occupant)
            )
        if not any(h is not None and not h.done for h in live):
            return False
        sampled = any(h is not None and h._sampling.temperature > 0 for h in live)
        extras = any(h is not None and h._extras for h in live)
        rows = self._rows_for(1 + max(s for s, h in enumerate(live) if h is not None))
        try:
            self._do(Op.DECODE, self._pages.table.copy(), sampled, extras, rows)
        except Exception as e:
            self._state_fault(e)
            return False
        with self._lock:
            for s in self._decoding():
                self._bound[s] = self._first_tokens(self._occupant[s], self._bound[s])
        owners = {s: (h, s) for s, h in enumerate(live) if h is not None}
        self._events.append(_Tokens(owners))
        self._decode_calls += 1
        return True

    def _drain(self, keep: int) -> None:
        """Reads back all but the `keep` newest device results, in order."""
        while len(self._events) > keep:
            event, arrays = self._events.popleft(), self._results.popleft()
            try:
                arrays = jax.tree.map(distributed.to_host, arrays)
            except Exception as e:  # the program failed on the device
                if self._across:  # no process recovers alone
                    raise
                if isinstance(event, _PromptScores):  # the request's own chunk
                    if self._long is not None and self._long.request is event.request:
                        self._long = None
                    if not event.request.done:
                        self._request_fault(event.request, event.slot, e)
                    continue
                self._state_fault(e)  # the state is lost
                return
            if isinstance(event, _PromptScores):
                self._prompt_scores(event, arrays)
            else:
                self._tokens(event, arrays)

    def _tokens(self, event: _Tokens, arrays) -> None:
        tokens, scores = arrays
        for h, row in event.owners.values():
            for j, t in enumerate(tokens[row]):
                if h.done or t < 0:
                    break
                self._generated += 1
                k = h._logprobs
                logprob = None if k is None else _logprob(scores, (row, j), int(t), k)
                reason = h._push(int(t), logprob)
                if reason is not None:
                    with self._lock:
                        self._end(h, reason)
                    self._release(h)

    def _prompt_scores(self, event: _PromptScores, scores: TokenLogprobs) -> None:
        """Row 0's scores of the chunk's positions: position p scores prompt token p + 1."""
        h = event.request
        if h.done:
            return
        prompt, k = h._prompt, h._logprobs
        for j in range(event.count):
            p = event.offset + j
            if p + 1 < len(prompt):
                h.prompt_logprobs.append(_logprob(scores, (0, j), int(prompt[p + 1]), k))
        if event.last:
            self._prompted += h.prompt_tokens
            with self._lock:
                self._end(h, "length")
            self._free(event.slot)

    def _request_fault(self, h: RequestHandle, slot: int, error: BaseException) -> None:
        """A fault in one request's own program (its prefill, a chunk, its insert): that
        request ends with it and its slot is free (its row was not written). A donated input
        the fault consumed (the state, the scratch) is allocated again; the state's loss ends
        the requests it held (_state_fault)."""
        with self._lock:
            self._end(h, "error", error)
            self._occupant[slot] = None
            self._pages.release(slot)
        if _lost(self._state) or _lost(self._pool):
            self._state_fault(error)
        elif _lost(self._scratch):
            self._scratch = None
            self._allocate_or_break()

    def _state_fault(self, error: BaseException) -> None:
        """The shared decode call failed (or its tokens could not be read): the requests the
        state holds end with `error`, its buffers are freed, then a new state is allocated (the
        two never held at once). A long prompt being prefilled (its own one-row state) and the
        queue go on."""
        with self._lock:
            for s, h in enumerate(self._occupant):
                if h is not None and not (self._long is not None and self._long.slot == s):
                    if not h.done:
                        self._end(h, "error", error)
                    self._occupant[s] = None
                    self._pages.release(s)
        kept = [(e, r) for e, r in zip(self._events, self._results, strict=True)
                if isinstance(e, _PromptScores)]  # fmt: skip
        self._events = collections.deque(e for e, _ in kept)
        self._results = collections.deque(r for _, r in kept)
        lost, self._state, self._pool = (self._state, self._pool), None, None
        for x in jax.tree.leaves(lost):
            if not x.is_deleted():
                x.delete()
        self._allocate_or_break()

    def _allocate_or_break(self) -> None:
        """_allocate(); if it fails the engine is broken (step's doc): `failure` is set, every
        request ends with it and the thread stops."""
        try:
            self._allocate()
        except Exception as e:
            self._break(e)

    def _break(self, error: BaseException) -> None:
        """The engine is broken (step's doc): `failure` is set, every request ends with it, the
        thread stops and submit() refuses."""
        with self._lock:
            self.failure, self._accepting, self._running = error, False, False
            for h in [*self._queue, *self._occupant, *(p.request for p in self._preempted)]:
                if h is not None and not h.done:
                    self._end(h, "error", error)
            self._queue.clear()
            self._preempted.clear()
            self._occupant = [None] * self.slots
            self._work.notify_all()
        self._long, self._events, self._results = None, collections.deque(), collections.deque()
        self._batch = self._long_row = self._long_logits = None
        self._saved.clear()

    # ------------------------------------------------------------------------- device operations

    def follow(self) -> None:
        """(A process other than 0 on a mesh across processes.) Carries out the plans of
        process 0's steps as they come, until its engine stops (then returns). A fault raises:
        the process should exit, which ends the others (kivi_jax.distributed)."""
        if not self._across or jax.process_index() == 0:
            raise RuntimeError("follow() is for the processes other than 0 of a mesh across them")
        while True:
            self._allocate()
            for op, *args in self._codec.decode(plan.receive()):
                if op == Op.STOP:
                    return
                self._run(op, *args)
            self._batch = None  # a plan inserts every row of its prefill batch

    def _do(self, op: Op, *args) -> None:
        """The device operation `op` (Engine._op_<name>): run now, or across processes kept
        for the step's plan."""
        if self._ops is None:
            self._run(op, *args)
        else:
            self._ops.append((op, *args))

    def _run(self, op: Op, *args) -> None:
        getattr(self, _OP_METHODS[op])(*args)

    def _send(self, reads: int) -> None:
        """(Process 0 across processes.) The step's plan to every process, then its operations
        run here too; `reads`: the device results the step reads back."""
        ops, self._ops = self._ops, []
        plan.send(self._codec.encode([*ops, (Op.READ, reads)]))
        for op, *args in ops:
            self._run(op, *args)
        self._batch = None  # a plan inserts every row of its prefill batch

    def _op_reset(self, slot: int) -> None:
        self._state = programs.reset(self.params, self._state, np.int32(slot), kv=self.kv,
                                     layout=self._layout)  # fmt: skip

    def _op_save(self, table: np.ndarray, slot: int, key: int) -> None:
        """Row `slot` (its pages gathered) to host memory, where restore finds it by `key`:
        with where save_row put it (so that restore_row runs the program warmup compiled)."""
        saved = programs.save_row(self._state, self._pool, table, np.int32(slot),
                                  layout=self._layout)  # fmt: skip
        self._saved[key] = distributed.to_host_copy(saved)

    def _op_restore(self, table: np.ndarray, slot: int, key: int) -> None:
        saved = distributed.from_host_copy(self._saved.pop(key))
        self._state, self._pool = programs.restore_row(
            self._state, self._pool, table, saved, np.int32(slot), mesh=self.mesh,
            layout=self._layout,
        )  # fmt: skip

    def _op_drop(self, key: int) -> None:
        self._saved.pop(key, None)

    def _op_prefill(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        self._batch = programs.prefill_batch(self.params, tokens, lengths, kv=self.kv,
                                             max_len=self.max_len)  # fmt: skip

    def _op_new_row(self) -> None:
        self._long_row = self._new_row()

    def _op_prefix_row(self, pages: np.ndarray, tokens: int) -> None:
        """The one-row state of a shared prefix (its first `tokens` tokens, in `pages`) and
        the scratch holding its keys and values (programs.shared_prefix)."""
        self._scratch, self._long_row = programs.shared_prefix(
            self.params, self._pool, pages, np.int32(tokens), self._scratch, kv=self.kv,
            max_len=self.max_len, layout=self._layout,
        )  # fmt: skip

    def _op_chunk(self, tokens, offset: int, count, following) -> None:
        """The long prompt's next chunk; with `following` (its prompt logprobs asked) its
        TokenLogprobs are a result to read."""
        args = (self.params, tokens, np.int32(offset), count, self._scratch, self._long_row)
        if following is None:
            self._long_logits, self._scratch, self._long_row = programs.prefill_chunk(*args)
            return
        self._long_logits, self._scratch, self._long_row, scores = programs.echo_chunk(
            *args, following
        )
        jax.tree.map(lambda x: x.copy_to_host_async(), scores)
        self._results.append(scores)

    def _op_insert(self, table, source: int, slot: int, prompt, limit, stops, sampled: int,
                   *rows) -> None:  # fmt: skip
        """Row `source` of the last batch (-1: the long prompt's row) into `slot`; its first
        token is a result to read."""
        if source < 0:
            row, logits = self._long_row, self._long_logits
            self._long_row = self._long_logits = None
        else:
            row, logits = self._batch[1][source], self._batch[0][source]
        prompted = np.zeros((1, self.params.config.vocab_size), bool)
        prompted[0, prompt] = True
        self._state, self._pool, first, scores = programs.insert_row(
            self._state, self._pool, table, row, logits, RowSampling(*rows), prompted, limit,
            stops, np.int32(slot), sampled=bool(sampled), mesh=self.mesh, layout=self._layout,
        )  # fmt: skip
        jax.tree.map(lambda x: x.copy_to_host_async(), (first, scores))
        self._results.append((first, scores))

    def _op_decode(self, table, sampled: int, extras: int, rows: int) -> None:
        self._state, self._pool, out, scores = programs.decode(
            self.params, self._state, self._pool, table, steps=self.decode_steps,
            sampled=bool(sampled), extras=bool(extras), layout=self._layout, rows=rows,
        )  # fmt: skip
        jax.tree.map(lambda x: x.copy_to_host_async(), (out, scores))
        self._results.append((out, scores))

    def _op_read(self, n: int) -> None:
        """(The processes other than 0.) The n oldest results read back as process 0 reads
        them (a global array's read is a program every process runs)."""
        for _ in range(n):
            jax.tree.map(distributed.to_host, self._results.popleft())

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self._running and not self._pending():
                    self._work.wait(0.1)
                if not self._running and not self._pending():
                    return
            if self.failure is not None:
                return
            try:
                self.step()
            except EngineError:  # the engine broke: failure is set, every request ended
                return
