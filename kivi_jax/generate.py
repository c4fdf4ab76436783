"""Autoregressive generation with the KV state threaded through a jit-compiled decode loop.

    tokens -> prefill (full-precision attention over the prompt, then kivi_jax.prefill of every
    layer's K/V) -> first token -> a loop of decode steps (kivi_jax.append +
    kivi_jax.decode_attention in every layer) -> sampled tokens

`generate` runs two compiled programs, each with the KV state donated so that it is updated in
place: the prefill with the first token, and the whole decode loop (with an EOS, steps in chunks
of DECODE_CHUNK under one `lax.while_loop`, which stops once every row has produced it).
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

from kivi_jax.cache import init_cache
from kivi_jax.config import KIVI2, KIVI2_MIX, KIVI4, KiviConfig
from kivi_jax.memory import memory_report
from kivi_jax.models import llama
from kivi_jax.models.llama import LlamaParams

KV_PRESETS: dict[str, KiviConfig | None] = {
    "full": None,
    "kivi2": KIVI2,
    "kivi4": KIVI4,
    "kivi2-mix": KIVI2_MIX,
}
PROMPT_BUCKET = 64  # prompt widths are rounded up to a multiple of this (fewer recompilations)
# Decode steps between two checks of whether every row is done (with an EOS). On a GPU each
# check is a round trip to the host (the loop's condition is read back: gaps of over 2 ms on
# the H200, docs/performance.md), while steps of a fixed count are not; rows done early stay
# padded for at most DECODE_CHUNK - 1 steps.
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
    """'full' -> None (the unquantized cache), 'kivi2'/'kivi4'/'kivi2-mix' -> presets, a
    KiviConfig as is."""
    if isinstance(kv, KiviConfig):
        return kv
    if isinstance(kv, str) and kv in KV_PRESETS:
        return KV_PRESETS[kv]
    raise ValueError(f"unknown kv {kv!r}: use one of {sorted(KV_PRESETS)} or a KiviConfig")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen (static under jit). temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    eos_id: int | None = None

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

    @property
    def pad_id(self) -> int:
        return 0 if self.eos_id is None else self.eos_id


def sample(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """logits float32 [B, V] -> int32 [B]: argmax, or temperature / top-k / top-p sampling."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / s.temperature
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p is not None and s.top_p < 1:
        desc = -jnp.sort(-logits, axis=-1)  # [B, V] largest first
        probs = jax.nn.softmax(desc, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        keep = (jnp.cumsum(probs, axis=-1) - probs) < s.top_p
        cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@flax.struct.dataclass
class SamplingState:
    """The carry of the decode loop."""

    step: jax.Array  # int32 []: column of `generated` written next
    generated: jax.Array  # int32 [B, N], pad_id where nothing was generated
    positions: jax.Array  # int32 [B]: position of the last generated token (= tokens in cache)
    done: jax.Array  # bool [B]: the sequence has produced its EOS
    cache: tuple  # the KV state, one cache per layer
    key: jax.Array  # PRNG key


def _start(
    params, tokens, lengths, cache, key, *, max_new_tokens: int, sampling: Sampling, rows: int
):
    """Prefill (`rows` rows at a time) + the first token: the state before the first decode
    step."""
    logits, cache = llama.prefill(params, tokens, lengths, cache, rows=rows)
    key, sub = jax.random.split(key)
    first = sample(logits, sub, sampling)
    B = tokens.shape[0]
    generated = jnp.full((B, max_new_tokens), sampling.pad_id, jnp.int32).at[:, 0].set(first)
    done = first == sampling.eos_id if sampling.eos_id is not None else jnp.zeros(B, bool)
    return SamplingState(
        step=jnp.int32(1), generated=generated, positions=lengths, done=done, cache=cache, key=key
    )


def _step(params, state: SamplingState, *, sampling: Sampling) -> SamplingState:
    """Feeds each live sequence its last token, samples the next; finished rows stay padded."""
    last = jax.lax.dynamic_index_in_dim(state.generated, state.step - 1, axis=1, keepdims=False)
    live = ~state.done
    logits, cache = llama.decode_step(params, last, state.positions, state.cache, active=live)
    key, sub = jax.random.split(state.key)
    nxt = jnp.where(live, sample(logits, sub, sampling), sampling.pad_id)
    generated = jax.lax.dynamic_update_index_in_dim(state.generated, nxt, state.step, axis=1)
    done = state.done | (nxt == sampling.eos_id) if sampling.eos_id is not None else state.done
    return SamplingState(
        step=state.step + 1,
        generated=generated,
        positions=state.positions + live.astype(jnp.int32),
        done=done,
        cache=cache,
        key=key,
    )


def _decode(params, state: SamplingState, *, max_new_tokens: int, sampling: Sampling):
    """The decode steps after the first token. Without an EOS every step runs, in one loop of
    a fixed count; with one, in chunks of DECODE_CHUNK steps while a row is live, then the
    remainder (rows done by then stay padded)."""
    step = functools.partial(_step, params, sampling=sampling)

    def run(n, s):
        return jax.lax.fori_loop(0, n, lambda _, s: step(s), s)

    if sampling.eos_id is None:
        return run(max_new_tokens - 1, state)
    chunks, tail = divmod(max_new_tokens - 1, DECODE_CHUNK)

    def live(s: SamplingState):
        return (s.step < 1 + chunks * DECODE_CHUNK) & ~jnp.all(s.done)

    # Without a chunk the while loop is left out: it would compile a copy of the step of its own
    # (on the CPU most of a short generate's compile time).
    if chunks:
        state = jax.lax.while_loop(live, functools.partial(run, DECODE_CHUNK), state)
    # Returning the whole state lets XLA alias it to the donated input: the loop updates the
    # cache in place.
    return run(tail, state)


_start_jit = jax.jit(
    _start, static_argnames=("max_new_tokens", "sampling", "rows"), donate_argnames=("cache",)
)
_decode_jit = jax.jit(
    _decode, static_argnames=("max_new_tokens", "sampling"), donate_argnames=("state",)
)
_step_jit = jax.jit(_step, static_argnames=("sampling",), donate_argnames=("state",))


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
):
    """Checks every input before anything runs; returns (tokens, lengths, empty cache, rows
    prefilled at a time)."""
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
    # The cache can hold the padded prompt and every generated token.
    cache = init_cache(
        kv_config,
        batch=B,
        max_len=width + max_new_tokens,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=params.dtype,
        num_layers=c.num_layers,
    )
    rows = auto_prefill_rows(params, cache, width) if prefill_rows is None else prefill_rows
    return jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32), cache, min(int(rows), B)


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
    lengths=None,
    prefill_rows: int | None = None,
) -> jax.Array:
    """Generates `max_new_tokens` tokens after each prompt.

    Args:
      params: model weights (their static config gives shapes, context and vocabulary).
      tokens: int [batch, seq] prompts; with `lengths`, right-padded.
      kv: "full" (unquantized cache in the params dtype), "kivi2", "kivi4", "kivi2-mix" (KIVI-2
        with mixed precision, kivi_jax.KIVI2_MIX) or a KiviConfig.
      max_new_tokens: N, tokens generated per sequence (prompt + N must fit the context).
      temperature, top_k, top_p: sampling (temperature 0: greedy).
      seed: PRNG seed for sampling, an int in [0, 2**32) (jax keeps 32 bits of it here).
      eos_id: a sequence stops after producing it; its later positions are eos_id.
      lengths: int [batch] real prompt lengths (default: all `seq`).
      prefill_rows: rows whose prompts are run at a time (the prompt's working memory grows
        with it, not with the batch); None: all of them, or on a device that reports its
        memory as many as keep that memory within PREFILL_MEMORY_SHARE of it.

    Returns:
      int32 [batch, max_new_tokens].

    Raises:
      ValueError: unknown kv, a ragged list of prompts (pad them and pass lengths), tokens
        outside the vocabulary, prompt + max_new_tokens beyond the model's context, malformed
        lengths, a temperature that is not a finite number >= 0, top_k that is not a positive
        int (a bool is not), top_p outside (0, 1], a seed outside [0, 2**32); all before
        anything is compiled or run.
      TypeError: params that are not LlamaParams, a seed that is not an int.
    """
    seed = check_seed(seed)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id)
    tokens, lengths, cache, rows = _prepare(
        params, tokens, lengths, kv=kv, max_new_tokens=max_new_tokens, sampling=sampling,
        prefill_rows=prefill_rows,
    )  # fmt: skip
    n = int(max_new_tokens)
    kw = dict(max_new_tokens=n, sampling=sampling)
    state = _start_jit(params, tokens, lengths, cache, jax.random.key(seed), **kw, rows=rows)
    return _decode_jit(params, state, **kw).generated


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
        lengths=None,
    ):
        self.params = params
        seed = check_seed(seed)
        self.sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id)
        self.max_new_tokens = int(max_new_tokens)
        self.tokens, self.lengths, cache, rows = _prepare(
            params, tokens, lengths, kv=kv, max_new_tokens=max_new_tokens, sampling=self.sampling
        )
        report = memory_report(cache)
        self.stats = StreamStats(
            prompt_tokens=int(np.asarray(self.lengths).sum()),
            kv_bytes=report.total_bytes,
            kv_full_bytes=report.full_precision_bytes,
            kv_capacity=cache[0].max_len,
        )
        t0 = time.perf_counter()
        key = jax.random.key(seed)
        self._start = _start_jit.lower(
            params,
            self.tokens,
            self.lengths,
            cache,
            key,
            max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
            rows=rows,
        ).compile()
        state_shape = jax.eval_shape(
            functools.partial(
                _start, max_new_tokens=self.max_new_tokens, sampling=self.sampling, rows=rows
            ),
            params,
            self.tokens,
            self.lengths,
            cache,
            key,
        )
        self._step = _step_jit.lower(params, state_shape, sampling=self.sampling).compile()
        self.stats.compile_s = time.perf_counter() - t0
        self._cache, self._key = cache, key

    def __iter__(self) -> Iterator[np.ndarray]:
        t0 = time.perf_counter()
        state = self._start(self.params, self.tokens, self.lengths, self._cache, self._key)
        self._cache = None  # donated
        first = np.asarray(state.generated[:, 0])
        self.stats.prefill_s = time.perf_counter() - t0
        self.stats.generated_tokens = 1
        self.stats.held_tokens = int(np.max(state.positions))
        yield first
        t0 = time.perf_counter()
        done = np.asarray(state.done)
        for _ in range(1, self.max_new_tokens):
            if done.all():
                break
            state = self._step(self.params, state)
            step = int(state.step) - 1
            out = np.asarray(state.generated[:, step])
            done = np.asarray(state.done)
            self.stats.generated_tokens += 1
            self.stats.held_tokens = int(np.max(state.positions))
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
