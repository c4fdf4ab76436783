"""Autoregressive generation with the KV state threaded through a jit-compiled decode loop.

    tokens -> prefill (full-precision attention over the prompt, then kivi_jax.prefill of every
    layer's K/V) -> first token -> a loop of decode steps (kivi_jax.append +
    kivi_jax.decode_attention in every layer) -> sampled tokens

`generate` runs two compiled programs, each with the KV state donated so that it is updated in
place: the prefill with the first token, and the whole decode loop (steps in chunks of
DECODE_CHUNK under one `lax.while_loop`, which stops after max_new_tokens or once every row has
produced its EOS). Sampling values and max_new_tokens are traced (the programs are compiled for
max_new_tokens rounded up to a multiple of DECODE_CHUNK), so a new value compiles nothing.
`TokenStream` runs the prefill and one decode step at a time from Python so a CLI can print
tokens as they come.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterator, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import distributed, sharding
from kivi_jax.cache import init_cache
from kivi_jax.config import KIVI2, KIVI2_LEAN, KIVI2_MIX, KIVI4, KiviConfig
from kivi_jax.memory import memory_report
from kivi_jax.models import llama
from kivi_jax.models.llama import LlamaParams

KV_PRESETS: dict[str, KiviConfig | None] = {
    "full": None,
    "kivi2": KIVI2,
    "kivi4": KIVI4,
    "kivi2-mix": KIVI2_MIX,
    "kivi2-lean": KIVI2_LEAN,
}
PROMPT_BUCKET = 64  # prompt widths are rounded up to a multiple of this (fewer recompilations)
# Decode steps between two checks of whether the loop is done, and max_new_tokens' bucket. On a
# GPU each check is a round trip to the host (the loop's condition is read back: gaps of over
# 2 ms on the H200, docs/performance.md), while steps of a fixed count are not; a loop runs at
# most DECODE_CHUNK - 1 steps past its end (appending nothing).
DECODE_CHUNK = 32
# With prefill_rows None, the prompt's working memory (activations and the states of the rows
# being prefilled) is held to this share of the device's memory, where the device reports it.
PREFILL_MEMORY_SHARE = 0.08


def auto_prefill_rows(params: LlamaParams, cache, width: int) -> int:
    """Rows prefilled at a time when `prefill_rows` is None: all of them, unless the device
    reports its memory (a GPU) and the prompt's working memory for all rows would exceed
    PREFILL_MEMORY_SHARE of it. A row's share: an upper bound on one block's live activations
    over `width` tokens (float32: the residual stream, its norm, q/k/v and the attention
    output, the MLP's three intermediates) plus the row's KV states."""
    batch = cache[0].batch
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    if not limit:
        return batch
    c = params.config
    activations = width * (8 * c.hidden_size + 3 * c.intermediate_size) * 4
    per_row = activations + memory_report(cache).total_bytes // batch
    return max(1, min(batch, int(PREFILL_MEMORY_SHARE * limit // per_row)))


def resolve_kv(kv: str | KiviConfig | None) -> KiviConfig | None:
    """'full' -> None (the unquantized cache), 'kivi2'/'kivi4'/'kivi2-mix'/'kivi2-lean' ->
    presets, a KiviConfig as is."""
    if isinstance(kv, KiviConfig):
        return kv
    if isinstance(kv, str) and kv in KV_PRESETS:
        return KV_PRESETS[kv]
    raise ValueError(f"unknown kv {kv!r}: use one of {sorted(KV_PRESETS)} or a KiviConfig")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """How one request's tokens are chosen. temperature 0 is greedy (argmax); otherwise its
    samples are a function of its logits, `seed` and the token's index among its generated
    tokens only (not of the batch it runs in). Under jit the values are traced per row
    (`RowSampling`): a new value compiles nothing."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    eos_id: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        real = lambda x: (
            isinstance(x, int | float | np.integer | np.floating)
            and not isinstance(x, bool | np.bool_)
        )
        if not real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        top_k = self.top_k
        if top_k is not None and (
            not isinstance(top_k, int | np.integer) or isinstance(top_k, bool) or top_k < 1
        ):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        if self.top_p is not None and (not real(self.top_p) or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        check_seed(self.seed)
        for name in ("frequency_penalty", "presence_penalty"):
            x = getattr(self, name)
            if not real(x) or not math.isfinite(x):
                raise ValueError(f"{name} must be a finite number, got {x!r}")
        r = self.repetition_penalty
        if not real(r) or not 0 < r < math.inf:
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {r!r}")

    @property
    def pad_id(self) -> int:
        return 0 if self.eos_id is None else self.eos_id

    @property
    def penalized(self) -> bool:
        """A penalty is set (its program counts the tokens: `penalize`)."""
        return (self.frequency_penalty, self.presence_penalty, self.repetition_penalty) != (0, 0, 1)


@flax.struct.dataclass
class RowSampling:
    """Sampling values per row, traced under jit (one program serves every value)."""

    temperature: jax.Array  # float32 [B], 0: greedy
    top_k: jax.Array  # int32 [B], 0: no top-k
    top_p: jax.Array  # float32 [B], 1: no top-p
    seed: jax.Array  # uint32 [B]
    frequency_penalty: jax.Array  # float32 [B], 0: none
    presence_penalty: jax.Array  # float32 [B], 0: none
    repetition_penalty: jax.Array  # float32 [B], 1: none

    @classmethod
    def of(cls, rows: Sequence[Sampling]) -> RowSampling:
        f32 = lambda name: np.array([getattr(s, name) for s in rows], np.float32)
        return cls(
            temperature=f32("temperature"),
            top_k=np.array([s.top_k or 0 for s in rows], np.int32),
            top_p=np.array([1.0 if s.top_p is None else s.top_p for s in rows], np.float32),
            seed=np.array([s.seed for s in rows], np.uint32),
            frequency_penalty=f32("frequency_penalty"),
            presence_penalty=f32("presence_penalty"),
            repetition_penalty=f32("repetition_penalty"),
        )


@flax.struct.dataclass
class TokenCounts:
    """What the penalties read of each row, over the vocabulary (4 + 1 bytes per id a row,
    whatever the sequence's length)."""

    generated: jax.Array  # int32 [B, V]: times each id has been generated
    prompted: jax.Array  # bool [B, V]: the id is in the prompt

    @classmethod
    def of_prompts(cls, tokens: jax.Array, lengths: jax.Array, vocab: int) -> TokenCounts:
        """tokens int32 [B, S] right-padded to lengths [B]: nothing generated yet."""
        B, S = tokens.shape
        ids = jnp.where(jnp.arange(S) < lengths[:, None], tokens, vocab)  # padding: dropped
        prompted = (
            jnp.zeros((B, vocab), bool).at[jnp.arange(B)[:, None], ids].set(True, mode="drop")
        )
        return cls(generated=jnp.zeros((B, vocab), jnp.int32), prompted=prompted)

    def add(self, tokens: jax.Array, live: jax.Array) -> TokenCounts:
        """tokens int32 [B] generated where live (bool [B])."""
        rows = jnp.arange(tokens.shape[0])
        generated = self.generated.at[rows, tokens].add(live.astype(jnp.int32), mode="drop")
        return dataclasses.replace(self, generated=generated)


def penalize(logits: jax.Array, rows: RowSampling, counts: TokenCounts) -> jax.Array:
    """logits float32 [B, V] with each row's penalties, in vLLM's order: the repetition
    penalty (transformers' and vLLM's: a logit of an id in the prompt or generated is divided
    by it where positive, multiplied where not), then OpenAI's frequency and presence
    penalties (minus frequency x the times the id was generated, minus presence if it was).
    Rows without penalties (0, 0, 1) keep their logits exactly."""
    n = counts.generated
    r = rows.repetition_penalty[:, None]
    seen = counts.prompted | (n > 0)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - rows.frequency_penalty[:, None] * n
    return logits - rows.presence_penalty[:, None] * (n > 0)


def sample(logits: jax.Array, rows: RowSampling, index: jax.Array, *, sampled: bool) -> jax.Array:
    """logits float32 [B, V] -> int32 [B]: argmax where a row's temperature is 0, else a sample
    after temperature, top-k and top-p, drawn with the key fold_in(key(seed), index) of the
    row (index int32 [B]: the token's index among the row's generated tokens). `sampled`
    (static) False: every row is greedy and the program holds neither sort nor draw."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampled:
        return greedy
    V = logits.shape[-1]
    t = rows.temperature[:, None]
    x = logits / jnp.where(t > 0, t, 1.0)
    desc = -jnp.sort(-x, axis=-1)  # [B, V] largest first
    k = jnp.where(rows.top_k > 0, jnp.minimum(rows.top_k, V), V)[:, None]  # [B, 1]
    kth = jnp.take_along_axis(desc, k - 1, axis=-1)
    x = jnp.where(x < kth, -jnp.inf, x)
    desc = jnp.where(jnp.arange(V) < k, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (always at least the top token)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < rows.top_p[:, None]
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where((rows.top_p[:, None] < 1) & (x < cutoff), -jnp.inf, x)

    def draw(seed, i, row):
        key = jax.random.fold_in(jax.random.key(seed), i)
        return jax.random.categorical(key, row)

    drawn = jax.vmap(draw)(rows.seed, index.astype(jnp.uint32), x).astype(jnp.int32)
    return jnp.where(rows.temperature > 0, drawn, greedy)


def new_tokens_width(max_new_tokens: int) -> int:
    """The width generate's programs are compiled for: max_new_tokens rounded up to a multiple
    of DECODE_CHUNK (nearby values share a program)."""
    return -(-int(max_new_tokens) // DECODE_CHUNK) * DECODE_CHUNK


@flax.struct.dataclass
class SamplingState:
    """The carry of the decode loop."""

    step: jax.Array  # int32 []: column of `generated` written next
    generated: jax.Array  # int32 [B, W], W = new_tokens_width; pad_id where nothing was generated
    positions: jax.Array  # int32 [B]: position of the last generated token (= tokens in cache)
    done: jax.Array  # bool [B]: the sequence has produced its EOS
    cache: tuple  # the KV state, one cache per layer
    rows: RowSampling  # the sampling values of each row
    counts: TokenCounts | None  # what the penalties read; None unless penalized


def _pad_id(eos_id: int | None) -> int:
    return 0 if eos_id is None else eos_id


def _start(
    params, tokens, lengths, cache, rows: RowSampling, *, width: int, sampled: bool,
    penalized: bool, eos_id: int | None, prefill_rows: int,
):  # fmt: skip
    """Prefill (`prefill_rows` rows at a time) + the first token: the state before the first
    decode step."""
    logits, cache = llama.prefill(params, tokens, lengths, cache, rows=prefill_rows)
    B = tokens.shape[0]
    counts = None
    if penalized:
        counts = TokenCounts.of_prompts(tokens, lengths, params.config.vocab_size)
        logits = penalize(logits, rows, counts)
    first = sample(logits, rows, jnp.zeros(B, jnp.int32), sampled=sampled)
    if penalized:
        counts = counts.add(first, jnp.ones(B, bool))
    generated = jnp.full((B, width), _pad_id(eos_id), jnp.int32).at[:, 0].set(first)
    done = first == eos_id if eos_id is not None else jnp.zeros(B, bool)
    return SamplingState(
        step=jnp.int32(1), generated=generated, positions=lengths, done=done, cache=cache,
        rows=rows, counts=counts,
    )  # fmt: skip


def _step(params, state: SamplingState, n, *, sampled: bool, penalized: bool, eos_id: int | None):
    """Feeds each live sequence its last token, samples the next; finished rows stay padded.
    A step at or past `n` (int32 []: the tokens wanted) appends nothing and writes nothing."""
    last = jax.lax.dynamic_index_in_dim(state.generated, state.step - 1, axis=1, keepdims=False)
    live = ~state.done & (state.step < n)
    logits, cache = llama.decode_step(params, last, state.positions, state.cache, active=live)
    counts = state.counts
    if penalized:
        logits = penalize(logits, state.rows, counts)
    index = jnp.broadcast_to(state.step, live.shape)
    nxt = jnp.where(live, sample(logits, state.rows, index, sampled=sampled), _pad_id(eos_id))
    if penalized:
        counts = counts.add(nxt, live)
    generated = state.generated.at[:, state.step].set(nxt, mode="drop")
    done = state.done | (nxt == eos_id) if eos_id is not None else state.done
    return dataclasses.replace(
        state,
        step=state.step + 1,
        generated=generated,
        positions=state.positions + live.astype(jnp.int32),
        done=done,
        cache=cache,
        counts=counts,
    )


def _decode(params, state: SamplingState, n, *, sampled: bool, penalized: bool, eos_id: int | None):
    """The decode steps after the first token, `n` (int32 []) tokens in all: chunks of
    DECODE_CHUNK steps under one while loop, run while a token is wanted and (with an EOS) a
    row is live. The width being a multiple of DECODE_CHUNK, a chunk runs at most
    DECODE_CHUNK - 1 steps past n, which append nothing."""
    step = functools.partial(_step, params, n=n, sampled=sampled, penalized=penalized,
                             eos_id=eos_id)  # fmt: skip

    def chunk(s):
        return jax.lax.fori_loop(0, DECODE_CHUNK, lambda _, s: step(s), s)

    def live(s: SamplingState):
        more = s.step < n
        return more & ~jnp.all(s.done) if eos_id is not None else more

    # Returning the whole state lets XLA alias it to the donated input: the loop updates the
    # cache in place.
    return jax.lax.while_loop(live, chunk, state)


_start_jit = jax.jit(
    _start, static_argnames=("width", "sampled", "penalized", "eos_id", "prefill_rows"),
    donate_argnames=("cache",),
)  # fmt: skip
_loop_static = ("sampled", "penalized", "eos_id")
_decode_jit = jax.jit(_decode, static_argnames=_loop_static, donate_argnames=("state",))
_step_jit = jax.jit(_step, static_argnames=_loop_static, donate_argnames=("state",))


def _program_args(sampling: Sampling, batch: int, max_new_tokens: int, mesh=None):
    """(the per-row values of `batch` rows, row b seeded with seed + b mod 2**32, placed on
    `mesh` if given; the start's static arguments; the decode's) for generate's programs."""
    seeds = (sampling.seed + np.arange(batch, dtype=np.uint64)) % 2**32
    rows = RowSampling.of([dataclasses.replace(sampling, seed=int(s)) for s in seeds])
    if mesh is not None:
        spec = sharding.rows_spec(mesh)
        rows = jax.tree.map(lambda x: distributed.to_global(x, mesh, spec), rows)
    static = dict(
        sampled=sampling.temperature > 0, penalized=sampling.penalized, eos_id=sampling.eos_id
    )
    return rows, dict(width=new_tokens_width(max_new_tokens), **static), static


# jax.random.key keeps 32 bits of the seed here (64-bit ints off): a seed outside [0, 2^32)
# would give another seed's stream, or an OverflowError past 2^63.
SEED_RANGE = (0, 2**32)


def check_seed(seed) -> int:
    """The seed as an int, or ValueError/TypeError naming it."""
    if not isinstance(seed, int | np.integer) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ValueError(f"seed must lie in [0, 2**32), got {seed}")
    return int(seed)


def _token_array(tokens) -> np.ndarray:
    """Prompts as one array; a ragged list of prompts is an error that says how to batch it."""
    if isinstance(tokens, list | tuple):
        widths = [len(row) for row in tokens if hasattr(row, "__len__")]
        if len(set(widths)) > 1:
            raise ValueError(
                f"tokens is a ragged list of prompts of {widths} tokens: right-pad them to one "
                f"width (any token id) and pass lengths={widths}"
            )
    try:
        return np.asarray(tokens)
    except ValueError as e:  # e.g. prompts mixed with bare token ids
        raise ValueError(f"tokens must be an integer array [batch, seq]: {e}") from None


def _prepare(
    params: LlamaParams,
    tokens,
    lengths,
    *,
    kv,
    max_new_tokens: int,
    sampling: Sampling,
    prefill_rows: int | None = None,
    mesh=None,
):
    """Checks every input before anything runs; returns (tokens, lengths, empty cache, rows
    prefilled at a time). With a mesh the cache is made in its shards on it."""
    if not isinstance(params, LlamaParams):
        raise TypeError(f"params must be LlamaParams (model.params), got {type(params).__name__}")
    c = params.config
    kv_config = resolve_kv(kv)
    if not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    tokens = _token_array(tokens)
    if tokens.ndim != 2 or tokens.shape[1] == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"tokens must be a non-empty integer array [batch, seq], got {tokens.dtype} "
            f"{list(tokens.shape)}"
        )
    B, S = tokens.shape
    if mesh is not None:
        sharding.check_mesh(mesh, c, B)
    if lengths is None:
        lengths = np.full((B,), S, np.int32)
    else:
        lengths = np.asarray(lengths)
        if lengths.shape != (B,) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(
                f"lengths must be {B} integers, got {lengths.dtype}{list(lengths.shape)}"
            )
        if np.any((lengths < 1) | (lengths > S)):
            raise ValueError(f"lengths must lie in [1, {S}] (the padded width), got {lengths}")
    real = np.arange(S)[None] < lengths[:, None]  # [B, S], padding excluded from the vocab check
    bad = real & ((tokens < 0) | (tokens >= c.vocab_size))
    if bad.any():
        b, t = np.argwhere(bad)[0]
        raise ValueError(
            f"token id {tokens[b, t]} at [{b}, {t}] is outside the vocabulary [0, {c.vocab_size})"
        )
    if prefill_rows is not None and (
        not isinstance(prefill_rows, int | np.integer) or prefill_rows < 1
    ):
        raise ValueError(f"prefill_rows must be a positive int or None, got {prefill_rows!r}")
    if sampling.eos_id is not None and not 0 <= sampling.eos_id < c.vocab_size:
        raise ValueError(f"eos_id {sampling.eos_id} is outside the vocabulary [0, {c.vocab_size})")
    longest = int(lengths.max())
    if longest + max_new_tokens > c.max_context:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{longest + max_new_tokens} exceeds the model's context of {c.max_context} tokens"
        )
    # Prompts are right-padded to a multiple of PROMPT_BUCKET so that prompts of similar lengths
    # share one compiled program (padding is masked and never enters the cache).
    width = -(-S // PROMPT_BUCKET) * PROMPT_BUCKET
    tokens = np.pad(np.where(real, tokens, 0), ((0, 0), (0, width - S))).astype(np.int32)
    # The cache can hold the padded prompt and every generated token (of the bucketed width).
    cache = (init_cache if mesh is None else functools.partial(sharding.init_cache, mesh=mesh))(
        kv_config,
        batch=B,
        max_len=width + new_tokens_width(max_new_tokens),
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=params.dtype,
        num_layers=c.num_layers,
    )
    rows = auto_prefill_rows(params, cache, width) if prefill_rows is None else prefill_rows
    lengths = lengths.astype(np.int32)
    if mesh is None:
        return jnp.asarray(tokens), jnp.asarray(lengths), cache, min(int(rows), B)
    spec = sharding.rows_spec(mesh)
    tokens, lengths = (distributed.to_global(x, mesh, spec) for x in (tokens, lengths))
    return tokens, lengths, cache, min(int(rows), B)


def generate(
    params: LlamaParams,
    tokens,
    *,
    kv: str | KiviConfig = "kivi2",
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_id: int | None = None,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    lengths=None,
    prefill_rows: int | None = None,
    mesh=None,
) -> jax.Array:
    """Generates `max_new_tokens` tokens after each prompt.

    Args:
      params: model weights (their static config gives shapes, context and vocabulary).
      tokens: int [batch, seq] prompts; with `lengths`, right-padded.
      kv: "full" (unquantized cache in the params dtype), "kivi2", "kivi4", "kivi2-mix" (KIVI-2
        with mixed precision, kivi_jax.KIVI2_MIX), "kivi2-lean" (kivi_jax.KIVI2_LEAN) or a
        KiviConfig.
      max_new_tokens: N, tokens generated per sequence (prompt + N must fit the context).
      temperature, top_k, top_p: sampling (temperature 0: greedy); traced, so a new value
        compiles nothing.
      seed: PRNG seed for sampling, an int in [0, 2**32): row b samples as
        `Sampling(seed=(seed + b) % 2**32)` does alone (its tokens do not depend on the other
        rows).
      eos_id: a sequence stops after producing it; its later positions are eos_id.
      frequency_penalty, presence_penalty: OpenAI's penalties on the tokens generated so far
        (a logit minus frequency x the times its id was generated, minus presence if it was);
        repetition_penalty: transformers' and vLLM's, on the prompt's and the generated
        tokens' ids (a positive logit divided by it, a negative one multiplied). Traced; a
        call with any set counts each row's tokens over the vocabulary (`penalize`).
      lengths: int [batch] real prompt lengths (default: all `seq`).
      prefill_rows: rows whose prompts are run at a time (the prompt's working memory grows
        with it, not with the batch); None: all of them, or on a device that reports its
        memory as many as keep that memory within PREFILL_MEMORY_SHARE of it.
      mesh: a jax.sharding.Mesh with a "model" axis and optionally "data" (kivi_jax.sharding):
        heads, MLP width and the KV state split over "model", the batch over "data". Params
        not yet on it are placed there (kivi_jax.sharding.shard_params; place them once to
        save the copy per call). Default: the mesh the params carry, else one device.

    Returns:
      int32 [batch, max_new_tokens]; on a mesh spanning processes (kivi_jax.distributed:
      every process passes the same arguments) whole on every device, so that every process
      reads all of it.

    Raises:
      ValueError: unknown kv, a ragged list of prompts (pad them and pass lengths), tokens
        outside the vocabulary, prompt + max_new_tokens beyond the model's context, malformed
        lengths, a temperature that is not a finite number >= 0, top_k that is not a positive
        int (a bool is not), top_p outside (0, 1], a seed outside [0, 2**32), a penalty that
        is not finite (repetition_penalty also <= 0), a mesh that does not fit
        (sharding.check_mesh); all before anything is compiled or run.
      TypeError: params that are not LlamaParams, a seed that is not an int.
    """
    seed = check_seed(seed)
    sampling = Sampling(
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_id=eos_id,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty,
    )  # fmt: skip
    mesh = _mesh_for(params, mesh)
    tokens, lengths, cache, rows = _prepare(
        params, tokens, lengths, kv=kv, max_new_tokens=max_new_tokens, sampling=sampling,
        prefill_rows=prefill_rows, mesh=mesh,
    )  # fmt: skip
    if mesh is not None:
        params = sharding.shard_params(params, mesh)
    n = int(max_new_tokens)
    per_row, start_kw, decode_kw = _program_args(sampling, tokens.shape[0], n, mesh)
    state = _start_jit(params, tokens, lengths, cache, per_row, **start_kw, prefill_rows=rows)
    generated = _decode_jit(params, state, jnp.int32(n), **decode_kw).generated
    # the programs' width is n rounded up to a multiple of DECODE_CHUNK
    if generated.shape[1] != n:
        generated = jax.lax.slice_in_dim(generated, 0, n, axis=1)
    return generated if mesh is None else distributed.replicated(generated)


def _mesh_for(params, mesh):
    """sharding.mesh_for once params are known to be LlamaParams (else _prepare says so)."""
    return sharding.mesh_for(params, mesh) if isinstance(params, LlamaParams) else mesh


@dataclasses.dataclass
class StreamStats:
    """Timings of a TokenStream (seconds; compile time kept apart from run time)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    compile_s: float = 0.0
    prefill_s: float = 0.0  # prefill + the first token
    decode_s: float = 0.0  # every later token
    kv_bytes: int = 0  # allocated by the cache (memory_report(cache).total_bytes)
    kv_full_bytes: int = 0  # a full-precision cache of the same capacity (full_precision_bytes)
    kv_capacity: int = 0  # tokens per sequence the cache can hold (max_len)
    held_tokens: int = 0  # tokens in the cache now, longest row (not the token just sampled)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if self.decode_s and steps > 0 else float("nan")


class TokenStream:
    """Generation driven from Python, one jitted decode step at a time, for streaming output.

    Runs the same prefill and decode-step functions as `generate` (which fuses them in one
    while_loop). Iterating yields int32 numpy [batch] per step; finished rows yield eos_id.
    Single-prompt use: `for tok in TokenStream(params, [ids], kv="kivi2", eos_id=eos): ...`
    The penalties and `mesh` as in `generate`.
    """

    def __init__(
        self,
        params: LlamaParams,
        tokens,
        *,
        kv: str | KiviConfig = "kivi2",
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        eos_id: int | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        lengths=None,
        mesh=None,
    ):
        mesh = _mesh_for(params, mesh)
        seed = check_seed(seed)
        self.sampling = Sampling(
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_id=eos_id,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            repetition_penalty=repetition_penalty,
        )  # fmt: skip
        self.max_new_tokens = int(max_new_tokens)
        self.tokens, self.lengths, cache, rows = _prepare(
            params, tokens, lengths, kv=kv, max_new_tokens=max_new_tokens, sampling=self.sampling,
            mesh=mesh,
        )  # fmt: skip
        if mesh is not None:
            params = sharding.shard_params(params, mesh)
        self.params = params
        report = memory_report(cache)
        self.stats = StreamStats(
            prompt_tokens=int(distributed.to_host(self.lengths).sum()),
            kv_bytes=report.total_bytes,
            kv_full_bytes=report.full_precision_bytes,
            kv_capacity=cache[0].max_len,
        )
        t0 = time.perf_counter()
        per_row, start_kw, step_kw = _program_args(
            self.sampling, self.tokens.shape[0], self.max_new_tokens, mesh
        )
        args = (params, self.tokens, self.lengths, cache, per_row)
        self._start = _start_jit.lower(*args, **start_kw, prefill_rows=rows).compile()
        start = functools.partial(_start, **start_kw, prefill_rows=rows)
        state_shape = jax.eval_shape(start, *args)
        if mesh is not None:  # the step takes the state as the prefill places it
            state_shape = jax.tree.map(
                lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
                state_shape,
                self._start.output_shardings,
            )
        self._n = jnp.int32(self.max_new_tokens)
        self._step = _step_jit.lower(params, state_shape, self._n, **step_kw).compile()
        self.stats.compile_s = time.perf_counter() - t0
        self._cache, self._per_row = cache, per_row

    def __iter__(self) -> Iterator[np.ndarray]:
        t0 = time.perf_counter()
        state = self._start(self.params, self.tokens, self.lengths, self._cache, self._per_row)
        self._cache = None  # donated
        first = distributed.to_host(state.generated[:, 0])
        self.stats.prefill_s = time.perf_counter() - t0
        self.stats.generated_tokens = 1
        self.stats.held_tokens = int(np.max(distributed.to_host(state.positions)))
        yield first
        t0 = time.perf_counter()
        done = distributed.to_host(state.done)
        for _ in range(1, self.max_new_tokens):
            if done.all():
                break
            state = self._step(self.params, state, self._n)
            step = int(state.step) - 1
            out = distributed.to_host(state.generated[:, step])
            done = distributed.to_host(state.done)
            self.stats.generated_tokens += 1
            self.stats.held_tokens = int(np.max(distributed.to_host(state.positions)))
            self.stats.decode_s = time.perf_counter() - t0
            yield out


def check_prompt(prompt: str) -> None:
    """Raises unless `prompt` is a str with some text (a chat template would wrap an empty one)."""
    if not isinstance(prompt, str):
        raise TypeError(f"the prompt must be a str, got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError(f"the prompt is empty: {prompt!r}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # e.g. undecodable command-line bytes, kept as lone surrogates
        raise ValueError(f"the prompt is not valid UTF-8 text: {prompt!r:.80}") from None


def encode_prompt(tokenizer, prompt: str, *, chat: bool = True) -> list[int]:
    """Prompt text -> ids, through the model's chat template when `chat` and it has one."""
    check_prompt(prompt)
    if chat and tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return ids


def truncate_at_eos(ids: Sequence[int], eos_id: int | None) -> list[int]:
    ids = [int(i) for i in ids]
    return ids[: ids.index(eos_id)] if eos_id is not None and eos_id in ids else ids


def generate_text(
    model,
    prompt: str,
    *,
    kv: str | KiviConfig = "kivi2",
    max_new_tokens: int = 256,
    chat: bool = True,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
) -> str:
    """The model's answer to one prompt, as text (chat template applied when `chat`)."""
    if not hasattr(model, "tokenizer"):
        raise TypeError(
            f"generate_text takes the Model (load_model's result), got {type(model).__name__}: "
            f"pass the model itself, not model.params"
        )
    ids = encode_prompt(model.tokenizer, prompt, chat=chat)
    eos = model.tokenizer.eos_id
    out = generate(
        model.params,
        [ids],
        kv=kv,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_id=eos,
    )
    return model.tokenizer.decode(truncate_at_eos(np.asarray(out[0]), eos))
