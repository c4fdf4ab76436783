"""The engine's device programs: pure jitted functions over `SlotState` (per slot the KV state's
per-slot part, each row's sampling values, counters, stop ids and token counts) and the page
pool (kivi_jax.paged), each donating what it updates so that it is updated in place:

    prefill_batch   waiting prompts of at most prefill_chunk tokens each, as the rows of one
                    padded batch [N, W] (W a prompt bucket, N * W <= prefill_chunk per "data"
                    shard, or one prompt alone) -> each prompt's logits and one-row KV state
                    (llama.prefill)
    prefill_chunk   a longer prompt, one chunk per call: full-precision attention over the
                    prompt so far (a full-precision K/V scratch), K/V added to a one-row state
    echo_chunk      prefill_chunk that also returns the logprobs of the chunk's prompt tokens
                    (every position's logits: any prompt whose own logprobs are asked)
    shared_prefix   a prompt's shared prefix read from its pages: the scratch and one-row state
                    the chunks of the rest start from
    insert_row      the one-row state and the first token into a slot (its row written, its
                    quantized tokens scattered to its pages, other rows untouched)
    save_row        a slot's row with its pages gathered (a preempted request's), and
    restore_row     that row written back into a slot and its pages
    reset           a slot back to the empty state of init_cache (inactive)
    decode          `decode_steps` decode steps of every slot in one call (inactive slots append
                    nothing), or of the first `rows` slots, reading and writing the pool
                    through the page table, returning their tokens [slots, decode_steps]

decode comes in four programs for each `rows` the engine compiles, two static flags:
`sampled` (some row samples: the sort and the draw) and `extras` (some row has a penalty or
asks for logprobs: the penalties applied, the generated tokens counted, each token's logprobs
and the MAX_LOGPROBS most likely computed). A
decode program whose rows are all greedy without either holds none of it. insert_row (one row,
once a request) always applies its penalties and computes its logprobs, greedy or sampled.
Rows are written with tree_map over the state's arrays on kivi_jax.cache.BATCH_AXIS (the
layout's invariant: every per-row array holds its rows on axis 0).

On a mesh (kivi_jax.sharding) the params carry it and the model's calls run under shard_map:
every state array holds its KV heads split over "model" and its slots over "data" (if the mesh
has it), the pool its KV heads over "model" and its pages over "data", the prefill scratch
likewise, and each program above returns them in those shardings. The one-row programs (a
prompt's prefill, its chunks, its one-row state) run on one row per "data" shard, each the
same prompt, so that each device holds a row's share of KV heads and none waits for another;
the insert takes the first. A batch of short prompts runs as rows split over "data" (a multiple
of its size): each device prefills its share of the prompts, and each prompt's one-row state is
then that row on every "data" shard.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from kivi_jax import cache as cache_lib
from kivi_jax import paged, sharding
from kivi_jax.cache import BATCH_AXIS, init_cache
from kivi_jax.config import KiviConfig
from kivi_jax.generate import RowSampling, Sampling, TokenCounts, penalize, sample
from kivi_jax.models import llama
from kivi_jax.models.llama import LlamaParams
from kivi_jax.paged import PagedCache

MAX_STOP_IDS = 16  # stop ids per request, the engine's eos_id and the request's eos_id included
MAX_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's chat top_logprobs limit)


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


def kv_heads(params: LlamaParams) -> int:
    """KV heads the state holds: the model's, or on a mesh sharding.kv_heads_on_mesh."""
    h, mesh = params.config.num_kv_heads, params.mesh
    return h if mesh is None else sharding.kv_heads_on_mesh(h, mesh)


def prompt_rows(params: LlamaParams) -> int:
    """Rows of the one-row programs: one per "data" shard of the mesh (module doc), else 1."""
    mesh = params.mesh
    return 1 if mesh is None else dict(mesh.shape).get(sharding.DATA_AXIS, 1)


def empty_caches(params: LlamaParams, kv: KiviConfig | None, batch: int, max_len: int):
    c = params.config
    return init_cache(
        kv, batch=batch, max_len=max_len, num_kv_heads=kv_heads(params), head_dim=c.head_dim,
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


def empty_paged(params: LlamaParams, kv, slots: int, pages: int, max_len: int, layout):
    """(the per-slot parts of `slots` empty rows, `pages` pages) per layer."""
    c = params.config
    layers = paged.init_paged(
        kv, batch=slots, pages=pages, page_size=layout.page_size, max_len=max_len,
        num_kv_heads=kv_heads(params), head_dim=c.head_dim, dtype=params.dtype,
        num_layers=c.num_layers,
    )  # fmt: skip
    return tuple(x.rows for x in layers), tuple(x.pages for x in layers)


def empty_state(caches, batch: int, vocab: int) -> SlotState:
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


def state_sharding(state: SlotState, mesh: Mesh) -> SlotState:
    """The NamedSharding of each state array on `mesh`: the caches as sharding.cache_sharding
    (KV heads over "model", slots over "data"), every other array's slots over "data"."""
    rows = NamedSharding(mesh, sharding.rows_spec(mesh))
    return dataclasses.replace(
        jax.tree.map(lambda _: rows, state), caches=sharding.cache_sharding(state.caches, mesh)
    )


def _keep_sharding(state: SlotState, mesh: Mesh | None) -> SlotState:
    """Inside jit: the state returned in its shardings (state_sharding), so that every program
    gives back the state as it took it (and its donation is used)."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_sharding(state, mesh))


def _put_row(state, row, slot):
    """`row` (the same pytree with one row) written over row `slot` of `state`."""
    put = lambda big, small: jax.lax.dynamic_update_slice_in_dim(
        big, small.astype(big.dtype), slot, axis=BATCH_AXIS
    )
    return jax.tree.map(put, state, row)


@functools.partial(jax.jit, static_argnames=("kv", "max_len"))
def prefill_batch(params, tokens, lengths, *, kv, max_len):
    """tokens int32 [N, W] (one prompt a row, right-padded; rows past the real prompts are
    padding), lengths int32 [N] -> (per row its logits [R, V], per row its state of R rows:
    the one-row format of the chunk program and insert_row, R = prompt_rows, the row
    repeated)."""
    N, R = tokens.shape[0], prompt_rows(params)
    caches = _sharded_rows(params, empty_caches(params, kv, N, max_len))
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
def empty_row(params, *, kv, max_len):
    """The empty state of a prompt's rows; on a mesh in the shardings the chunk program
    returns (sharding.cache_sharding), so that every chunk of a prompt runs one program."""
    return _sharded_rows(params, empty_caches(params, kv, prompt_rows(params), max_len))


prefill_chunk = jax.jit(llama.prefill_chunk, donate_argnames=("scratch", "caches"))


@functools.partial(
    jax.jit, static_argnames=("kv", "max_len", "layout"), donate_argnames=("scratch",)
)
def shared_prefix(params, pool, pages, tokens, scratch, *, kv, max_len, layout):
    """A prompt whose first `tokens` tokens (int32 []) are in shared pages (pages int32
    [1, M]: theirs, then NO_PAGE) -> (the scratch holding their keys and values as the pages
    hold them, dequantized, at [0, tokens); the one-row state holding them): the chunk
    program's starting point for the rest of the prompt, at offset `tokens`."""
    R = prompt_rows(params)
    r = 0 if kv is None else kv.residual_length
    axes = dict(layout.token_axes)
    table = jnp.repeat(pages, R, axis=0)
    kept, rows = [], []
    for c, part, (sk, sv) in zip(empty_caches(params, kv, R, max_len), pool, scratch,
                                 strict=True):  # fmt: skip
        empty, shapes = paged.split(c, layout.token_axes)
        # read as a sequence R tokens longer, every value of [0, tokens) comes from its codes
        longer = dataclasses.replace(empty, lengths=jnp.full(R, tokens + r, jnp.int32))
        whole = paged.view(layout.layers([longer], [part], table)[0])
        held = jnp.arange(sk.shape[1])[None, :, None, None] < tokens
        k, v = (jnp.pad(x, ((0, 0), (0, sk.shape[1] - max_len), (0, 0), (0, 0)))
                for x in cache_lib.dequantize(whole))  # fmt: skip
        kept.append((jnp.where(held, k, sk), jnp.where(held, v, sv)))

        def crop(path, x, ref):  # the view's capacity cut to the one-row state's
            a = axes[jax.tree_util.keystr(path)]
            return jax.lax.slice_in_dim(x, 0, ref.shape[a], axis=a)

        _, tokens_part = paged.split(whole, layout.token_axes)
        cropped = jax.tree_util.tree_map_with_path(crop, tokens_part, shapes)
        start = dataclasses.replace(empty, lengths=jnp.full(R, tokens, jnp.int32))
        rows.append(paged.merge(start, cropped))
    scratch = tuple(kept)
    if params.mesh is not None:
        where = NamedSharding(params.mesh, sharding.scratch_spec(params.mesh))
        scratch = jax.lax.with_sharding_constraint(scratch, jax.tree.map(lambda _: where, scratch))
    return scratch, _sharded_rows(params, tuple(rows))


@functools.partial(jax.jit, donate_argnames=("scratch", "caches"))
def echo_chunk(params, tokens, offset, count, scratch, caches, following):
    """prefill_chunk that also scores the chunk's prompt tokens: following int32 [R, C] is the
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
def insert_row(
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
def save_row(state: SlotState, pool, table, slot, *, layout):
    """Row `slot` as a one-row SlotState whose caches are its contiguous state (its pages
    gathered through table[slot]): a preempted request's, read back to the host."""
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=BATCH_AXIS)
    layers = layout.layers(state.caches, pool, table)
    return dataclasses.replace(
        jax.tree.map(take, dataclasses.replace(state, caches=())),
        caches=tuple(paged.sequence(x, slot) for x in layers),
    )


@functools.partial(jax.jit, static_argnames=("mesh", "layout"), donate_argnames=("state", "pool"))
def restore_row(state: SlotState, pool, table, saved: SlotState, slot, *, mesh, layout):
    """A preempted request's saved row (save_row's) back into row `slot`, its pages through
    table[slot] -> (state, pool)."""
    row = dataclasses.replace(saved, caches=())
    state, pool = _put_sequence(state, pool, table, saved.caches, row, slot, layout)
    return _keep_sharding(state, mesh), _keep_pool(pool, mesh)


@functools.partial(jax.jit, static_argnames=("kv", "layout"), donate_argnames=("state",))
def reset(params, state: SlotState, slot, *, kv, layout):
    """Row `slot` back to init_cache's empty state, inactive (its pages are the host's to
    free: the row's table entries are no longer passed)."""
    caches, _ = empty_paged(params, kv, 1, 1, state.caches[0].max_len, layout)
    empty = empty_state(caches, 1, params.config.vocab_size)
    return _keep_sharding(_put_row(state, empty, slot), params.mesh)


@functools.partial(
    jax.jit, static_argnames=("steps", "sampled", "extras", "layout", "rows"),
    donate_argnames=("state", "pool"),
)  # fmt: skip
def decode(
    params, state: SlotState, pool, table, *, steps: int, sampled: bool, extras: bool, layout,
    rows: int | None = None,
):  # fmt: skip
    """`steps` decode steps of every active slot, the pages read and written through `table`
    [S, M] (the host's: every live slot's pages for the call's tokens) -> (state, pool,
    tokens int32 [S, steps], -1 where the slot was inactive, and with `extras` (static: the
    penalties applied, the tokens counted, the logprobs computed) their TokenLogprobs
    [S, steps], else None). A slot stops after a stop id or its limit.

    rows (static, off a mesh): the steps run over slots [0, rows) only, taken out of the
    state and written back (the others untouched: tokens -1, logprobs 0), so that a call
    whose live slots all lie below `rows` costs the attention, matmuls and page writes of
    `rows` rows, not of every slot; None: every slot."""
    S = state.last.shape[0]
    run = functools.partial(_decode_steps, params, steps=steps, sampled=sampled, extras=extras,
                            layout=layout)  # fmt: skip
    if rows is None or rows == S:
        state, pool, out, scores = run(state, pool, table)
        return _keep_sharding(state, params.mesh), _keep_pool(pool, params.mesh), out, scores
    if params.mesh is not None or not 0 < rows < S:
        raise ValueError(f"decode: rows={rows} takes 0 < rows < {S} slots, off a mesh")
    first = lambda x: jax.lax.slice_in_dim(x, 0, rows, axis=BATCH_AXIS)
    some, pool, out, scores = run(jax.tree.map(first, state), pool, table[:rows])
    state = _put_row(state, some, 0)  # rows [0, rows) written back in place
    widen = lambda x, fill: jnp.full((S, *x.shape[1:]), fill, x.dtype).at[:rows].set(x)
    out = widen(out, -1)
    if scores is not None:
        scores = jax.tree.map(lambda x: widen(x, 0), scores)
    return state, pool, out, scores


def _decode_steps(params, state: SlotState, pool, table, *, steps, sampled, extras, layout):
    """decode's steps over every row of `state` (its slots, or the first `rows` of them)."""
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
    return jax.lax.fori_loop(0, steps, step, (state, pool, out, scores))
