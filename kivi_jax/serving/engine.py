"""A continuous-batching engine: requests arrive and finish at any time, each in a slot (a row)
of one fixed-shape KV state, decoded together.

The device side is a few pure jitted functions over `SlotState` (the KV state of `slots` rows
and each row's sampling values, counters, stop ids and token counts), each donating the state so
that it is updated in place:

    _prefill_batch  waiting prompts of at most prefill_chunk tokens each, as the rows of one
                    padded batch [N, W] (W a prompt bucket, N * W <= prefill_chunk per "data"
                    shard, or one prompt alone) -> each prompt's logits and one-row KV state
                    (llama.prefill)
    _prefill_chunk  a longer prompt, one chunk per call: full-precision attention over the
                    prompt so far (a full-precision K/V scratch), K/V added to a one-row state
    _echo_chunk     _prefill_chunk that also returns the logprobs of the chunk's prompt tokens
                    (every position's logits: any prompt whose own logprobs are asked)
    _insert_row     the one-row state and the first token into a slot (its whole row written,
                    other rows untouched)
    _reset          a slot back to the empty state of init_cache (inactive)
    _decode         `decode_steps` decode steps of every slot in one call (inactive slots append
                    nothing), returning their tokens [slots, decode_steps]

_decode comes in four programs, two static flags: `sampled` (some row samples: the sort and
the draw) and `extras` (some row has a penalty or asks for logprobs: the penalties applied, the
generated tokens counted, each token's logprobs and the MAX_LOGPROBS most likely computed). A
decode program whose rows are all greedy without either holds none of it. _insert_row (one row,
once a request) always applies its penalties and computes its logprobs, greedy or sampled.

Rows are written with tree_map over the state's arrays on kivi_jax.cache.BATCH_AXIS (the
layout's invariant: every per-row array holds its rows on axis 0). The host side (`Engine`)
is the scheduler: a bounded FIFO queue, slot bookkeeping, and the tokens read back one decode
call late (the next call is dispatched before the previous one's tokens are read), so the
device never waits for the host between calls.

On a mesh (kivi_jax.sharding) the params carry it and the model's calls run under shard_map:
every state array holds its KV heads split over "model" and its slots over "data" (if the mesh
has it), the prefill scratch likewise, and each program above returns the state in those
shardings. The one-row programs (a prompt's prefill, its chunks, its one-row state) run on one
row per "data" shard, each the same prompt, so that each device holds a row's share of KV heads
and none waits for another; the insert takes the first. A batch of short prompts runs as rows
split over "data" (a multiple of its size): each device prefills its share of the prompts, and
each prompt's one-row state is then that row on every "data" shard.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from kivi_jax import paged, sharding
from kivi_jax.cache import BATCH_AXIS, init_cache
from kivi_jax.config import KiviConfig
from kivi_jax.generate import (
    PROMPT_BUCKET,
    RowSampling,
    Sampling,
    TokenCounts,
    penalize,
    resolve_kv,
    sample,
)
from kivi_jax.memory import memory_report
from kivi_jax.models import llama
from kivi_jax.models.llama import LlamaParams
from kivi_jax.paged import PagedCache
from kivi_jax.serving import sizing
from kivi_jax.serving.pool import PagePool
from kivi_jax.serving.sizing import MemoryPlan

MAX_STOP_IDS = 16  # stop ids per request, the engine's eos_id and the request's eos_id included
MAX_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's chat top_logprobs limit)


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


class QueueFullError(RuntimeError):
    """submit() while max_queue requests already wait."""


class EngineError(RuntimeError):
    """An exception inside the engine ended the request (raised when its tokens are read)."""


@flax.struct.dataclass
class SlotState:
    """The engine's device state: every array holds one row per slot on axis 0."""

    caches: tuple  # per layer the per-slot part of the paged state (PagedCache.rows), batch = slots
    last: jax.Array  # int32 [S]: the token fed at the next step
    active: jax.Array  # bool [S]: the slot decodes
    count: jax.Array  # int32 [S]: tokens generated (the index of the next one)
    limit: jax.Array  # int32 [S]: max_new_tokens
    stops: jax.Array  # int32 [S, MAX_STOP_IDS]: tokens that end the request, -1 unused
    rows: RowSampling  # sampling values [S]
    counts: TokenCounts  # [S, V]: the prompt's ids and the generated ones (the penalties')


@flax.struct.dataclass
class TokenLogprobs:
    """Log-probabilities under the model: the float32 log-softmax of its logits, before
    penalties and temperature (vLLM's default), of a token and of the most likely ones."""

    logprob: jax.Array  # float32 [...]: the token's
    top_ids: jax.Array  # int32 [..., MAX_LOGPROBS]: the most likely ids, most likely first
    top_logprobs: jax.Array  # float32 [..., MAX_LOGPROBS]


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """logits float32 [..., V], tokens int32 [...] -> their TokenLogprobs (top-k on the
    device: MAX_LOGPROBS per position leave it)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(lp, MAX_LOGPROBS)
    chosen = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
    return TokenLogprobs(logprob=chosen, top_ids=ids.astype(jnp.int32), top_logprobs=top)


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A token's log-probability (TokenLogprobs) read back: `top` holds the request's
    `logprobs` most likely (id, logprob), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _kv_heads(params: LlamaParams) -> int:
    """KV heads the state holds: the model's, or on a mesh sharding.kv_heads_on_mesh."""
    h, mesh = params.config.num_kv_heads, params.mesh
    return h if mesh is None else sharding.kv_heads_on_mesh(h, mesh)


def _prompt_rows(params: LlamaParams) -> int:
    """Rows of the one-row programs: one per "data" shard of the mesh (module doc), else 1."""
    mesh = params.mesh
    return 1 if mesh is None else dict(mesh.shape).get(sharding.DATA_AXIS, 1)


def _empty_caches(params: LlamaParams, kv: KiviConfig | None, batch: int, max_len: int):
    c = params.config
    return init_cache(
        kv, batch=batch, max_len=max_len, num_kv_heads=_kv_heads(params), head_dim=c.head_dim,
        dtype=params.dtype, num_layers=c.num_layers,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """The pool's static layout: page_size tokens a page, and the state's arrays with a token
    axis (kivi_jax.paged.token_axes), which the pool holds."""

    page_size: int
    token_axes: tuple[tuple[str, int], ...]

    def layers(self, caches, pool, table) -> tuple[PagedCache, ...]:
        """Each layer's PagedCache: its per-slot part, its pages, the table [S, M]."""
        kw = dict(table=table, page_size=self.page_size, token_axes=self.token_axes)
        return tuple(PagedCache(rows=c, pages=p, **kw) for c, p in zip(caches, pool, strict=True))


def _empty_paged(params: LlamaParams, kv, slots: int, pages: int, max_len: int, layout):
    """(the per-slot parts of `slots` empty rows, `pages` pages) per layer."""
    c = params.config
    layers = paged.init_paged(
        kv, batch=slots, pages=pages, page_size=layout.page_size, max_len=max_len,
        num_kv_heads=_kv_heads(params), head_dim=c.head_dim, dtype=params.dtype,
        num_layers=c.num_layers,
    )  # fmt: skip
    return tuple(x.rows for x in layers), tuple(x.pages for x in layers)


def _empty_state(caches, batch: int, vocab: int) -> SlotState:
    """init_cache's empty state `caches` (a mixed state's empty heavy slots -1 / -inf), every
    row inactive."""
    return SlotState(
        caches=caches,
        last=jnp.zeros(batch, jnp.int32),
        active=jnp.zeros(batch, bool),
        count=jnp.zeros(batch, jnp.int32),
        limit=jnp.zeros(batch, jnp.int32),
        stops=jnp.full((batch, MAX_STOP_IDS), -1, jnp.int32),
        rows=jax.tree.map(jnp.asarray, RowSampling.of([Sampling()] * batch)),
        counts=TokenCounts(
            generated=jnp.zeros((batch, vocab), jnp.int32), prompted=jnp.zeros((batch, vocab), bool)
        ),
    )


def _keep_pool(pool, mesh: Mesh | None):
    """Inside jit: the pool in its shardings (pages over "data", KV heads over "model")."""
    if mesh is None:
        return pool
    return jax.lax.with_sharding_constraint(pool, sharding.cache_sharding(pool, mesh))


def _state_sharding(state: SlotState, mesh: Mesh) -> SlotState:
    """The NamedSharding of each state array on `mesh`: the caches as sharding.cache_sharding
    (KV heads over "model", slots over "data"), every other array's slots over "data"."""
    rows = NamedSharding(mesh, sharding.rows_spec(mesh))
    return dataclasses.replace(
        jax.tree.map(lambda _: rows, state), caches=sharding.cache_sharding(state.caches, mesh)
    )


def _keep_sharding(state: SlotState, mesh: Mesh | None) -> SlotState:
    """Inside jit: the state returned in its shardings (_state_sharding), so that every program
    gives back the state as it took it (and its donation is used)."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, _state_sharding(state, mesh))


def _bytes(tree) -> int:
    """Bytes of `tree`'s arrays (concrete or abstract), whole."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _lost(tree) -> bool:
    """Some array of `tree` was deleted (donated to a program that failed)."""
    return any(x.is_deleted() for x in jax.tree.leaves(tree))


def _put_row(state, row, slot):
    """`row` (the same pytree with one row) written over row `slot` of `state`."""
    put = lambda big, small: jax.lax.dynamic_update_slice_in_dim(
        big, small.astype(big.dtype), slot, axis=BATCH_AXIS
    )
    return jax.tree.map(put, state, row)


@functools.partial(jax.jit, static_argnames=("kv", "max_len"))
def _prefill_batch(params, tokens, lengths, *, kv, max_len):
    """tokens int32 [N, W] (one prompt a row, right-padded; rows past the real prompts are
    padding), lengths int32 [N] -> (per row its logits [R, V], per row its state of R rows:
    the one-row format of the chunk program and _insert_row, R = _prompt_rows, the row
    repeated)."""
    N, R = tokens.shape[0], _prompt_rows(params)
    caches = _sharded_rows(params, _empty_caches(params, kv, N, max_len))
    logits, caches = llama.prefill(params, tokens, lengths, caches)

    def row(tree, i):
        take = lambda x: jnp.repeat(jax.lax.slice_in_dim(x, i, i + 1, axis=BATCH_AXIS), R, axis=0)
        return jax.tree.map(take, tree)

    states = tuple(_sharded_rows(params, row(caches, i)) for i in range(N))
    logits = tuple(row(logits, i) for i in range(N))
    if params.mesh is not None:  # as the chunk program returns them
        rows = NamedSharding(params.mesh, sharding.rows_spec(params.mesh))
        logits = jax.lax.with_sharding_constraint(logits, (rows,) * N)
    return logits, states


def _sharded_rows(params, caches):
    """Inside jit: on a mesh, `caches` in sharding.cache_sharding (rows over "data")."""
    if params.mesh is None:
        return caches
    return jax.lax.with_sharding_constraint(caches, sharding.cache_sharding(caches, params.mesh))


@functools.partial(jax.jit, static_argnames=("kv", "max_len"))
def _empty_row(params, *, kv, max_len):
    """The empty state of a prompt's rows; on a mesh in the shardings the chunk program
    returns (sharding.cache_sharding), so that every chunk of a prompt runs one program."""
    return _sharded_rows(params, _empty_caches(params, kv, _prompt_rows(params), max_len))


_prefill_chunk = jax.jit(llama.prefill_chunk, donate_argnames=("scratch", "caches"))


@functools.partial(jax.jit, donate_argnames=("scratch", "caches"))
def _echo_chunk(params, tokens, offset, count, scratch, caches, following):
    """_prefill_chunk that also scores the chunk's prompt tokens: following int32 [R, C] is the
    prompt's token after each of the chunk's positions -> (logits of the last real token
    [R, V], the scratch, the states, TokenLogprobs [R, C] of `following`)."""
    logits, scratch, caches = llama.prefill_chunk(
        params, tokens, offset, count, scratch, caches, every_position=True
    )  # logits [R, C, V]
    last = jnp.take_along_axis(logits, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
    return last, scratch, caches, token_logprobs(logits, following)


def _put_sequence(state: SlotState, pool, table, caches, row: SlotState, slot, layout):
    """Inside jit: a request's contiguous one-row state `caches` into row `slot` (its pages
    through table[slot]) and `row`'s other arrays -> (state, pool)."""
    layers = [
        paged.put_sequence(x, c, slot)
        for x, c in zip(layout.layers(state.caches, pool, table), caches, strict=True)
    ]
    others = _put_row(dataclasses.replace(state, caches=()), row, slot)
    return (
        dataclasses.replace(others, caches=tuple(x.rows for x in layers)),
        tuple(x.pages for x in layers),
    )


@functools.partial(
    jax.jit, static_argnames=("sampled", "mesh", "layout"), donate_argnames=("state", "pool")
)
def _insert_row(
    state: SlotState, pool, table, caches, logits, rows: RowSampling, prompted, limit, stops,
    slot, *, sampled, mesh, layout,
):  # fmt: skip
    """A prefilled request (its state, last logits [R, V] of R equal rows, sampling values,
    its prompt's ids prompted bool [1, V], limit [1], stops [1, MAX_STOP_IDS]) into row
    `slot`, its pages through table[slot]; returns (state, pool, its first token [1, 1], its
    TokenLogprobs [1, 1]). The penalties and the logprobs of this one row are always computed
    (a few operations over [1, V])."""
    first_row = lambda x: jax.lax.slice_in_dim(x, 0, 1, axis=BATCH_AXIS)
    caches, logits = jax.tree.map(first_row, caches), logits[:1]
    counts = TokenCounts(generated=jnp.zeros(prompted.shape, jnp.int32), prompted=prompted)
    first = sample(penalize(logits, rows, counts), rows, jnp.zeros(1, jnp.int32), sampled=sampled)
    ends = jnp.any(first[:, None] == stops, axis=1) | (limit <= 1)
    row = SlotState(
        caches=(), last=first, active=~ends, count=jnp.ones(1, jnp.int32), limit=limit,
        stops=stops, rows=rows, counts=counts.add(first, jnp.ones(1, bool)),
    )  # fmt: skip
    scores = token_logprobs(logits[:, None], first[:, None])
    state, pool = _put_sequence(state, pool, table, caches, row, slot, layout)
    return _keep_sharding(state, mesh), _keep_pool(pool, mesh), first[:, None], scores


@functools.partial(jax.jit, static_argnames=("layout",))
def _save_row(state: SlotState, pool, table, slot, *, layout):
    """Row `slot` as a one-row SlotState whose caches are its contiguous state (its pages
    gathered through table[slot]): a preempted request's, read back to the host."""
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=BATCH_AXIS)
    layers = layout.layers(state.caches, pool, table)
    return dataclasses.replace(
        jax.tree.map(take, dataclasses.replace(state, caches=())),
        caches=tuple(paged.sequence(x, slot) for x in layers),
    )


@functools.partial(jax.jit, static_argnames=("mesh", "layout"), donate_argnames=("state", "pool"))
def _restore_row(state: SlotState, pool, table, saved: SlotState, slot, *, mesh, layout):
    """A preempted request's saved row (_save_row's) back into row `slot`, its pages through
    table[slot] -> (state, pool)."""
    row = dataclasses.replace(saved, caches=())
    state, pool = _put_sequence(state, pool, table, saved.caches, row, slot, layout)
    return _keep_sharding(state, mesh), _keep_pool(pool, mesh)


@functools.partial(jax.jit, static_argnames=("kv", "layout"), donate_argnames=("state",))
def _reset(params, state: SlotState, slot, *, kv, layout):
    """Row `slot` back to init_cache's empty state, inactive (its pages are the host's to
    free: the row's table entries are no longer passed)."""
    caches, _ = _empty_paged(params, kv, 1, 1, state.caches[0].max_len, layout)
    empty = _empty_state(caches, 1, params.config.vocab_size)
    return _keep_sharding(_put_row(state, empty, slot), params.mesh)


@functools.partial(
    jax.jit, static_argnames=("steps", "sampled", "extras", "layout"),
    donate_argnames=("state", "pool"),
)  # fmt: skip
def _decode(
    params, state: SlotState, pool, table, *, steps: int, sampled: bool, extras: bool, layout
):
    """`steps` decode steps of every active slot, the pages read and written through `table`
    [S, M] (the host's: every live slot's pages for the call's tokens) -> (state, pool,
    tokens int32 [S, steps], -1 where the slot was inactive, and with `extras` (static: the
    penalties applied, the tokens counted, the logprobs computed) their TokenLogprobs
    [S, steps], else None). A slot stops after a stop id or its limit."""
    S = state.last.shape[0]

    def step(i, carry):
        s, pool, out, scores = carry
        logits, layers = llama.decode_step(
            params, s.last, s.caches[0].lengths, layout.layers(s.caches, pool, table),
            active=s.active,
        )  # fmt: skip
        caches, pool = tuple(x.rows for x in layers), tuple(x.pages for x in layers)
        chosen = penalize(logits, s.rows, s.counts) if extras else logits
        tok = jnp.where(s.active, sample(chosen, s.rows, s.count, sampled=sampled), -1)
        count = s.count + s.active.astype(jnp.int32)
        ends = jnp.any(tok[:, None] == s.stops, axis=1) | (count >= s.limit)
        s = dataclasses.replace(
            s, caches=caches, last=jnp.where(s.active, tok, s.last), count=count,
            active=s.active & ~ends, counts=s.counts.add(tok, s.active) if extras else s.counts,
        )  # fmt: skip
        if extras:
            new = token_logprobs(logits, tok)
            scores = jax.tree.map(lambda all, x: all.at[:, i].set(x), scores, new)
        return s, pool, out.at[:, i].set(tok), scores

    out = jnp.full((S, steps), -1, jnp.int32)
    scores = None
    if extras:
        scores = TokenLogprobs(
            logprob=jnp.zeros((S, steps)), top_ids=jnp.zeros((S, steps, MAX_LOGPROBS), jnp.int32),
            top_logprobs=jnp.zeros((S, steps, MAX_LOGPROBS)),
        )  # fmt: skip
    state, pool, out, scores = jax.lax.fori_loop(0, steps, step, (state, pool, out, scores))
    return _keep_sharding(state, params.mesh), _keep_pool(pool, params.mesh), out, scores


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
    prefill_scratch_bytes: int  # the full-precision K/V of a chunked prompt (+ its one-row state)
    requests_finished: dict[str, int]  # by finish_reason
    generated_tokens: int
    prompt_tokens: int  # prefilled (of the requests submitted)
    prompt_tokens_computed: int  # real prompt tokens run through the model (padding not counted)
    prefill_calls: int  # jitted prefill calls: batches of short prompts and chunks
    decode_calls: int  # jitted calls of decode_steps steps


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


@dataclasses.dataclass
class _LongPrompt:
    """A prompt being prefilled chunk by chunk into a reserved slot."""

    request: RequestHandle
    slot: int
    offset: int
    caches: tuple  # its one-row KV state so far


@dataclasses.dataclass
class _Preempted:
    """A preempted request: its row as _save_row returns it (its caches contiguous), in host
    memory, and the tokens the row holds at most."""

    request: RequestHandle
    saved: SlotState
    held: int


@dataclasses.dataclass
class _Tokens:
    """Tokens on the device, not yet read: (tokens int32 [rows, n], their TokenLogprobs or
    None), and whose they are: {slot: (its request, its row)}."""

    arrays: tuple
    owners: dict[int, tuple[RequestHandle, int]]


@dataclasses.dataclass
class _PromptScores:
    """TokenLogprobs [R, C] of a prompt chunk's `count` positions from `offset`, not yet read
    (row 0 read); `last`: the request ends with them (max_new_tokens 0)."""

    arrays: TokenLogprobs
    request: RequestHandle
    slot: int
    offset: int
    count: int
    last: bool


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
      prefill_chunk: prompt tokens prefilled per scheduler step (per "data" shard of a mesh):
        prompts up to this long are prefilled whole, several waiting ones as the rows of one
        call (rows x their bucket's width <= prefill_chunk); longer ones in chunks of this many
        tokens, one chunk per scheduler step between decode calls.
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

    The state is allocated by warmup() (after it has compiled every program, so that XLA's
    autotuner measures in free memory) or by the first step.

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
        page_size: int = 128,
        prefill_chunk: int = 256,
        max_queue: int = 64,
        eos_id: int | None = None,
        decode_steps: int = 8,
        mesh: Mesh | None = None,
        memory_budget: int | None = None,
    ):
        if not isinstance(params, LlamaParams):
            raise TypeError(f"params must be LlamaParams, got {type(params).__name__}")
        c = params.config
        optional = {"slots": slots, "memory_budget": memory_budget, "kv_bytes": kv_bytes}
        for name, value in [("max_len", max_len), ("prefill_chunk", prefill_chunk),
                            ("max_queue", max_queue), ("decode_steps", decode_steps),
                            ("page_size", page_size),
                            *((k, v) for k, v in optional.items() if v is not None)]:  # fmt: skip
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_len > c.max_context:
            raise ValueError(f"max_len {max_len} exceeds the model's context of {c.max_context}")
        if eos_id is not None and not 0 <= eos_id < c.vocab_size:
            raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {c.vocab_size})")
        if slots is None and kv_bytes is not None:
            raise ValueError("kv_bytes needs slots (slots=None sizes both to the device)")
        mesh = sharding.mesh_for(params, mesh)
        if mesh is not None:
            sharding.check_mesh(mesh, c, batch=None if slots is None else int(slots))
            params = sharding.shard_params(params, mesh)
            self._devices = list(mesh.devices.flat)
        else:  # committed, so that every program's outputs are (one signature each)
            self._devices = [jax.tree.leaves(params)[0].device]
            params = jax.device_put(params, self._devices[0])
        self.params, self.kv, self.mesh = params, resolve_kv(kv), mesh
        self.max_len, self.prefill_chunk = int(max_len), int(prefill_chunk)
        self.max_queue, self.eos_id, self.decode_steps = int(max_queue), eos_id, int(decode_steps)
        self._rows_per_device = 1 if mesh is None else dict(mesh.shape).get(sharding.DATA_AXIS, 1)
        self._scratch_spec = self._abstract_scratch()
        row = jax.eval_shape(
            functools.partial(_empty_row, kv=self.kv, max_len=self.max_len), params
        )
        d = self._rows_per_device
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
        # device results not yet read, in order: _Tokens and _PromptScores
        self._events: collections.deque = collections.deque()
        self._ids = itertools.count()
        self._finished: collections.Counter = collections.Counter()
        self._generated = self._prompted = self._decode_calls = 0
        self._computed = self._prefill_calls = self._preemptions = 0
        self._bound = [0] * self.slots  # tokens each slot's row holds at most after the calls made
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
        """One scheduler iteration: free cancelled slots, admit (prefill up to prefill_chunk
        prompt tokens, or one chunk of a long prompt), one decode call, read back the previous
        call's tokens. Returns True while work remains.

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
            try:
                self._cancelled()
                self._admit()
                dispatched = self._decode_call()
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
        waits for the background thread."""
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
        state = jax.eval_shape(lambda: self._empty_state(slots))
        if self.mesh is None:
            shardings = jax.tree.map(lambda _: SingleDeviceSharding(self._devices[0]), state)
        else:
            shardings = jax.tree.map(_trimmed, _state_sharding(state, self.mesh))
        return jax.tree.map(_spec, state, shardings)

    def _abstract_pool(self, pages: int) -> tuple:
        """The shapes, dtypes and shardings of a pool of `pages` pages (nothing allocated)."""
        pool = jax.eval_shape(lambda: self._empty_pool(pages))
        if self.mesh is None:
            shardings = jax.tree.map(lambda _: SingleDeviceSharding(self._devices[0]), pool)
        else:
            shardings = jax.tree.map(_trimmed, sharding.cache_sharding(pool, self.mesh))
        return jax.tree.map(_spec, pool, shardings)

    def _empty_state(self, slots: int) -> SlotState:
        p = self.params
        caches, _ = _empty_paged(p, self.kv, slots, 1, self.max_len, self._layout)
        return _empty_state(caches, slots, p.config.vocab_size)

    def _empty_pool(self, pages: int) -> tuple:
        return _empty_paged(self.params, self.kv, 1, pages, self.max_len, self._layout)[1]

    def _abstract_scratch(self) -> tuple:
        """The chunked prompt's full-precision K/V per layer: (k, v) [R, P, H, D], P the
        multiple of prefill_chunk that covers max_len (R = _prompt_rows); on a mesh in its
        shards (sharding.scratch_spec)."""
        p, C = self.params, self.prefill_chunk
        shape = (_prompt_rows(p), -(-self.max_len // C) * C, _kv_heads(p), p.config.head_dim)
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
        r = _prompt_rows(p)
        empty = self._compile("empty_row", _empty_row, p, kv=kv, max_len=L)
        for w in self._buckets():
            for n in sorted({self._batch_rows(w, 1), self._batch_rows(w, 2 * r)}):
                logits, rows = self._compile(f"prefill_batch[{n}x{w}]", _prefill_batch, p,
                                             _i32(n, w), _i32(n), kv=kv, max_len=L)  # fmt: skip
        chunk = (p, _i32(r, C), _i32(), _i32(r), self._scratch_spec, empty)
        if L > C:  # a prompt may need chunks
            self._compile(f"prefill_chunk[{C}]", _prefill_chunk, *chunk)
        self._compile(f"echo_chunk[{C}]", _echo_chunk, *chunk, _i32(r, C))
        return rows[0], logits[0]

    def _compile_slot_programs(self, slots: int, pages: int, row, logits) -> None:
        """insert (greedy, sampled), decode (each with or without extras), reset, and a
        preemption's save and restore for a state of `slots` rows and `pages` pages."""
        p, state, pool = self.params, self._abstract_state(slots), self._abstract_pool(pages)
        table = _i32(slots, self._max_pages)
        rows = jax.tree.map(_spec, RowSampling.of([Sampling()]))
        prompted = jax.ShapeDtypeStruct((1, p.config.vocab_size), bool)
        stops = _i32(1, MAX_STOP_IDS)
        kw = dict(mesh=self.mesh, layout=self._layout)
        for sampled in (False, True):
            kind = "sampled" if sampled else "greedy"
            self._compile(f"insert_row[{kind}]", _insert_row, state, pool, table, row, logits,
                          rows, prompted, _i32(1), stops, _i32(), sampled=sampled,
                          **kw)  # fmt: skip
            for extras in (False, True):
                self._compile(f"decode[{kind}{', extras' if extras else ''}, "
                              f"{self.decode_steps} steps]", _decode, p, state, pool, table,
                              steps=self.decode_steps, sampled=sampled, extras=extras,
                              layout=self._layout)  # fmt: skip
        self._compile("reset", _reset, p, state, _i32(), kv=self.kv, layout=self._layout)
        saved = self._compile("save_row", _save_row, state, pool, table, _i32(),
                              layout=self._layout)  # fmt: skip
        self._compile("restore_row", _restore_row, state, pool, table, saved, _i32(), **kw)

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
        row = _empty_row(self.params, kv=self.kv, max_len=self.max_len)
        return row if self.mesh is not None else jax.device_put(row, self._devices[0])

    def _bucket(self, n: int) -> int:
        return next(w for w in self._buckets() if w >= n)

    def _batch_rows(self, width: int, prompts: int) -> int:
        """Rows of the batched prefill of `prompts` prompts at `width`: one per "data" shard
        while they fit (one prompt alone computes only its width), else as many per shard as
        fit prefill_chunk (two programs a width)."""
        d = _prompt_rows(self.params)
        return d if prompts <= d else d * max(1, self.prefill_chunk // width)

    def _is_long(self, h: RequestHandle) -> bool:
        """Prefilled in chunks: longer than prefill_chunk, or its prompt's logprobs asked."""
        return len(h._prompt) > self.prefill_chunk or h._prompt_logprobs

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
            self._state = _reset(self.params, self._state, np.int32(slot), kv=self.kv,
                                 layout=self._layout)  # fmt: skip
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
            self._preempted = collections.deque(p for p in self._preempted if p.request is not h)

    def _cancelled(self) -> None:
        with self._lock:
            for h in [*self._occupant, *(p.request for p in self._preempted)]:
                if h is not None and h._cancel and not h.done:
                    self._end(h, "cancelled")
            self._preempted = collections.deque(p for p in self._preempted if not p.request.done)
            done = [s for s, h in enumerate(self._occupant) if h is not None and h.done]
        for slot in done:
            if self._long is not None and self._long.slot == slot:
                self._long = None
            self._free(slot)

    def _first_tokens(self, h: RequestHandle, held: int) -> int:
        """Tokens the request's row holds after one more decode call, from `held` (a row
        appends one token a step, the last token it generates not appended)."""
        return min(held + self.decode_steps, len(h._prompt) + max(h._max_new - 1, 0))

    def _place(self, h: RequestHandle, held: int, free: list[int]) -> int | None:
        """(Under the lock.) The first of the `free` slots whose pool part holds the request's
        `held` tokens and its next decode call's: its pages taken, the request its occupant
        (the slot removed from `free`); None if no slot's pool has the pages."""
        want = self._first_tokens(h, held)
        for slot in free:
            if self._pages.missing(slot, want) <= self._pages.free(self._pages.shard(slot)):
                self._pages.grow(slot, want)
                free.remove(slot)
                self._occupant[slot], self._bound[slot] = h, held
                self._order.setdefault(h, next(self._admissions))
                return slot
        return None

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
            saved = _save_row(self._state, self._pool, self._pages.table.copy(), np.int32(slot),
                              layout=self._layout)  # fmt: skip
            saved = jax.device_get(saved)
        except Exception as e:  # a call before it failed: the state is not trusted
            self._state_fault(e)
            return False
        with self._lock:
            self._preempted.append(_Preempted(h, saved, self._bound[slot]))
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
                slot = self._place(p.request, p.held, free)
                if slot is None:
                    return False
                self._preempted.popleft()
            try:
                self._state, self._pool = _restore_row(
                    self._state, self._pool, self._pages.table.copy(), p.saved, np.int32(slot),
                    mesh=self.mesh, layout=self._layout,
                )  # fmt: skip
            except Exception as e:
                self._request_fault(p.request, slot, e)
        return True

    def _admit(self) -> None:
        """Prefills up to prefill_chunk prompt tokens (per "data" shard): the waiting short
        prompts in FIFO order as one batched call while they fit, or one chunk of a long one."""
        budget = self.prefill_chunk
        while budget > 0:
            if self._long is not None:
                self._chunk()
                return
            if not self._restore():  # preempted requests come back before new ones
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
                    batch = self._take_batch(free, budget)
                    if not batch:
                        return
            if batch is not None:
                budget -= self._prefill(batch)
                continue
            try:
                row = self._new_row()
            except Exception as e:
                self._request_fault(h, slot, e)
                continue
            self._long = _LongPrompt(request=h, slot=slot, offset=0, caches=row)

    def _take_batch(self, free: list[int], budget: int) -> list[tuple[RequestHandle, int]]:
        """(Under the lock.) The short prompts at the queue's head that one batched call of at
        most `budget` tokens per "data" shard holds, each given a free slot whose pool holds
        it (none if the first does not fit)."""
        d, batch, longest = _prompt_rows(self.params), [], 0
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
        """One _prefill_batch call of the batch's prompts, then each inserted into its slot.
        A fault in the call ends the batch's requests; in an insert, that request's. Returns
        the call's tokens per "data" shard."""
        width = self._bucket(max(len(h._prompt) for h, _ in batch))
        rows = self._batch_rows(width, len(batch))
        tokens, lengths = np.zeros((rows, width), np.int32), np.ones(rows, np.int32)
        for i, (h, _) in enumerate(batch):
            tokens[i, : len(h._prompt)], lengths[i] = h._prompt, len(h._prompt)
        cost = rows // _prompt_rows(self.params) * width
        try:
            logits, states = _prefill_batch(self.params, tokens, lengths, kv=self.kv,
                                            max_len=self.max_len)  # fmt: skip
        except Exception as e:
            for h, slot in batch:
                self._request_fault(h, slot, e)
            return cost
        self._prefill_calls += 1
        self._computed += int(lengths[: len(batch)].sum())
        for (h, slot), row_logits, row in zip(batch, logits, states, strict=False):
            if h.done:  # ended by a fault of the state in an earlier insert
                continue
            try:
                self._insert(h, slot, row, row_logits)
            except Exception as e:
                self._request_fault(h, slot, e)
        return cost

    def _chunk(self) -> None:
        lp, C = self._long, self.prefill_chunk
        h = lp.request
        part = h._prompt[lp.offset : lp.offset + C]
        r = _prompt_rows(self.params)
        tokens = np.zeros((r, C), np.int32)
        tokens[:, : len(part)] = part
        args = (self.params, tokens, np.int32(lp.offset), np.full(r, len(part), np.int32),
                self._scratch, lp.caches)  # fmt: skip
        try:
            if h._prompt_logprobs:
                following = np.zeros((r, C), np.int32)
                after = h._prompt[lp.offset + 1 : lp.offset + C + 1]
                following[:, : len(after)] = after
                logits, self._scratch, lp.caches, scores = _echo_chunk(*args, following)
                jax.tree.map(lambda x: x.copy_to_host_async(), scores)
            else:
                logits, self._scratch, lp.caches = _prefill_chunk(*args)
            self._prefill_calls += 1
            self._computed += len(part)
            offset, lp.offset = lp.offset, lp.offset + len(part)
            last = lp.offset == len(h._prompt)
            if h._prompt_logprobs:
                ends = last and h._max_new == 0
                self._events.append(_PromptScores(scores, h, lp.slot, offset, len(part), ends))
            if last:
                self._long = None
                if h._max_new > 0:
                    self._insert(h, lp.slot, lp.caches, logits)
        except Exception as e:
            self._long = None
            self._request_fault(h, lp.slot, e)

    def _insert(self, h: RequestHandle, slot: int, row, logits) -> None:
        s = h._sampling
        stops = np.full((1, MAX_STOP_IDS), -1, np.int32)
        stops[0, : len(h._stops)] = h._stops
        prompted = np.zeros((1, self.params.config.vocab_size), bool)
        prompted[0, h._prompt] = True
        self._state, self._pool, first, scores = _insert_row(
            self._state, self._pool, self._pages.table.copy(), row, logits, RowSampling.of([s]),
            prompted, np.array([h._max_new], np.int32), stops, np.int32(slot),
            sampled=s.temperature > 0, mesh=self.mesh, layout=self._layout,
        )  # fmt: skip
        jax.tree.map(lambda x: x.copy_to_host_async(), (first, scores))
        self._events.append(_Tokens((first, scores), {slot: (h, 0)}))
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
        try:
            self._state, self._pool, out, scores = _decode(
                self.params, self._state, self._pool, self._pages.table.copy(),
                steps=self.decode_steps, sampled=sampled, extras=extras, layout=self._layout,
            )  # fmt: skip
            jax.tree.map(lambda x: x.copy_to_host_async(), (out, scores))
        except Exception as e:
            self._state_fault(e)
            return False
        with self._lock:
            for s in self._decoding():
                self._bound[s] = self._first_tokens(self._occupant[s], self._bound[s])
        owners = {s: (h, s) for s, h in enumerate(live) if h is not None}
        self._events.append(_Tokens((out, scores), owners))
        self._decode_calls += 1
        return True

    def _drain(self, keep: int) -> None:
        """Reads back all but the `keep` newest device results, in order."""
        while len(self._events) > keep:
            event = self._events.popleft()
            try:
                arrays = jax.tree.map(np.asarray, event.arrays)
            except Exception as e:  # the program failed on the device
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
        self._events = collections.deque(e for e in self._events if isinstance(e, _PromptScores))
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
        self._long, self._events = None, collections.deque()

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
