"""The accuracy studies: perplexity, passkey retrieval, the paper's error analysis, G/R ablation.

Each study is a plain function of (params, tokenizer or tokens, sizes) returning a JSON-ready dict;
`kivi_jax.eval.report` writes the files and `kivi_jax.eval.cli` is the `kivi-eval` command.

- `perplexity`: one causal forward pass per window whose prompt attention is a view
  (kivi_jax.eval.views): `StreamingAttention` equals teacher-forced decoding through the streaming
  KIVI cache, `FakeQuantAttention` is the paper's Table 1, `FullAttention` the baseline.
- `passkey`: one full-precision prefill per batch of prompts (every layer's K/V collected once),
  then one cache per KV setting filled with `kivi_jax.prefill` and decoded greedily through the
  model's `decode_step` in a jitted loop.
- `error_analysis`: the measures of kivi_jax.analysis on the real model's q/k/v, per layer.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import analysis
from kivi_jax.analysis import Grouping
from kivi_jax.cache import init_cache
from kivi_jax.cache import prefill as cache_prefill
from kivi_jax.config import (
    KIVI2,
    KIVI2_LEAN,
    KIVI2_MIX,
    KIVI4,
    Format,
    KiviConfig,
    Range,
    Selection,
)
from kivi_jax.eval import data, views
from kivi_jax.models import llama

PT, PC = Grouping.PER_TOKEN, Grouping.PER_CHANNEL

PASSKEY_NEW_TOKENS = 8  # greedy answer tokens after a passkey prompt (a 5-digit key fits)

# The streaming cache settings compared everywhere (None: the full-precision cache).
KV_SETTINGS: dict[str, KiviConfig | None] = {
    "fp": None,
    "kivi4": KIVI4,
    "kivi2": KIVI2,
    "kivi2-mix": KIVI2_MIX,
}

# The paper's Table 1 (fake quantization, groups of 32, no residual), in its row order.
FAKE_QUANT_GRID: dict[str, views.FakeQuantAttention] = {
    "4bit K per-token, V per-token": views.FakeQuantAttention(PT, PT, bits=4),
    "2bit K per-token, V per-token": views.FakeQuantAttention(PT, PT, bits=2),
    "2bit K per-channel, V per-token": views.FakeQuantAttention(PC, PT, bits=2),
    "2bit K per-token, V per-channel": views.FakeQuantAttention(PT, PC, bits=2),
    "2bit K per-channel, V per-channel": views.FakeQuantAttention(PC, PC, bits=2),
}


# ----------------------------------------------------------------------------- perplexity


@functools.partial(jax.jit, static_argnames=("attention",))
def _window_nll(params, tokens, attention):
    """tokens [1, W] -> summed negative log-likelihood of tokens 1..W-1 given their prefix."""
    logits = llama.forward(params, tokens, attention=attention)[0, :-1]  # [W-1, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1).sum()


def windows(ids, window: int) -> np.ndarray:
    """The whole non-overlapping windows of `window` tokens: int32 [n, window] (tail dropped)."""
    n = len(ids) // window
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    return np.asarray(ids[: n * window], np.int32).reshape(n, window)


def perplexity(params, chunks: np.ndarray, attention) -> dict:
    """exp(mean NLL) over every window's tokens 1..W-1 (each window starts with no context)."""
    t0 = time.perf_counter()
    nll = sum(float(_window_nll(params, jnp.asarray(c)[None], attention)) for c in chunks)
    n = chunks.shape[0] * (chunks.shape[1] - 1)
    return {
        "ppl": float(np.exp(nll / n)),
        "nll": nll / n,
        "tokens": n,
        "seconds": time.perf_counter() - t0,
    }


def ppl_study(params, ids, *, source: str, window: int, log=print) -> dict:
    """fp / KIVI-4 / KIVI-2 through the streaming view, and the fake-quantization grid."""
    chunks = windows(ids, window)
    rows = {}
    settings = {"fp": views.FullAttention()}
    for name, cfg in KV_SETTINGS.items():
        if cfg is not None:
            settings[name] = views.StreamingAttention(cfg, cache_dtype=params.dtype)
    for name, attention in settings.items():
        rows[name] = perplexity(params, chunks, attention)
        log(f"ppl {name}: {rows[name]['ppl']:.3f} ({rows[name]['seconds']:.0f} s)")
    grid = {}
    for name, attention in FAKE_QUANT_GRID.items():
        grid[name] = perplexity(params, chunks, attention)
        log(f"ppl fake-quant {name}: {grid[name]['ppl']:.3f} ({grid[name]['seconds']:.0f} s)")
    return {
        "source": source,
        "window": window,
        "windows": int(chunks.shape[0]),
        "scored_tokens": int(chunks.shape[0] * (window - 1)),
        "cache_dtype": str(jnp.dtype(params.dtype)),
        "streaming": rows,
        "fake_quant": grid,
    }


# ----------------------------------------------------------------------------- passkey


@functools.partial(jax.jit, static_argnames=("kv_configs", "max_len", "new_tokens"))
def _greedy_answers(params, tokens, lengths, *, kv_configs, max_len: int, new_tokens: int):
    """One full-precision prefill, then a greedy decode per KV setting: int32 [C, B, new_tokens]."""
    c = params.config
    B = tokens.shape[0]
    logits, q, k, v = llama.forward_with_qkv(params, tokens, lengths, logits_at=lengths - 1)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # identical for every setting
    answers = []
    for cfg in kv_configs:
        cache = init_cache(
            cfg,
            batch=B,
            max_len=max_len,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            dtype=params.dtype,
            num_layers=c.num_layers,
        )
        cache = tuple(cache_prefill(s, k[i], v[i], lengths, q=q[i]) for i, s in enumerate(cache))
        generated = jnp.zeros((B, new_tokens), jnp.int32).at[:, 0].set(first)

        def step(t, carry):
            generated, cache = carry
            fed = jax.lax.dynamic_index_in_dim(generated, t - 1, axis=1, keepdims=False)
            logits, cache = llama.decode_step(params, fed, lengths + t - 1, cache)
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return jax.lax.dynamic_update_index_in_dim(generated, nxt, t, axis=1), cache

        generated, _ = jax.lax.fori_loop(1, new_tokens, step, (generated, cache))
        answers.append(generated)
    return jnp.stack(answers)


def passkey_answers(
    params, tokenizer, prompts, kv_configs, *, width: int, new_tokens: int = PASSKEY_NEW_TOKENS
):
    """Greedy answers of each KV setting to a batch of prompts, right-padded to `width` tokens.

    Returns a list (per setting) of lists (per prompt) of decoded answer strings.
    """
    B = len(prompts)
    tokens = np.zeros((B, width), np.int32)
    for b, p in enumerate(prompts):
        if len(p.tokens) > width:
            raise ValueError(f"prompt of {len(p.tokens)} tokens exceeds the width {width}")
        tokens[b, : len(p.tokens)] = p.tokens
    lengths = np.array([len(p.tokens) for p in prompts], np.int32)
    out = _greedy_answers(
        params,
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        kv_configs=tuple(kv_configs),
        max_len=width + new_tokens,
        new_tokens=new_tokens,
    )
    out = np.asarray(out)
    return [[tokenizer.decode(out[c, b].tolist()) for b in range(B)] for c in range(len(out))]


def check_passkey_lengths(lengths, *, max_context: int, new_tokens: int) -> None:
    """Raises ValueError naming the first length that is not a positive int or whose prompt and
    `new_tokens` answer tokens would not fit the model's context of `max_context` tokens."""
    longest = max_context - new_tokens
    for length in lengths:
        if not isinstance(length, int | np.integer) or isinstance(length, bool) or length < 1:
            raise ValueError(f"passkey lengths must be positive integers, got {length!r}")
        if length > longest:
            raise ValueError(
                f"passkey length {length} is beyond the model's context: a prompt and its "
                f"{new_tokens} answer tokens fit {max_context} tokens for lengths up to {longest}"
            )


def passkey_study(
    params,
    tokenizer,
    *,
    lengths,
    depths,
    keys_per_cell: int = 2,
    settings=None,
    new_tokens: int = PASSKEY_NEW_TOKENS,
    seed: int = 0,
    log=print,
) -> dict:
    """Accuracy of each KV setting on an L x depth grid, `keys_per_cell` random keys per cell.

    settings: {name: KiviConfig | None}; default fp / KIVI-4 / KIVI-2. All settings of a cell share
    one full-precision prefill (the keys of a cell form one batch).
    """
    check_passkey_lengths(lengths, max_context=params.config.max_context, new_tokens=new_tokens)
    settings = dict(KV_SETTINGS if settings is None else settings)
    rng = np.random.default_rng(seed)
    # Every prompt is made (and checked) before anything runs: rows [length][depth][key].
    rows = [
        [
            [
                data.passkey_prompt(tokenizer, length=length, depth=d, rng=rng)
                for _ in range(keys_per_cell)
            ]
            for d in depths
        ]
        for length in lengths
    ]
    grid = {name: np.zeros((len(lengths), len(depths))) for name in settings}
    records = []
    t0 = time.perf_counter()
    for i, (length, cells) in enumerate(zip(lengths, rows, strict=True)):
        # One padded width per length, so the whole row shares one compiled program.
        width = -(-max(len(p.tokens) for cell in cells for p in cell) // 64) * 64
        for j, cell in enumerate(cells):
            answers = passkey_answers(
                params, tokenizer, cell, settings.values(), width=width, new_tokens=new_tokens
            )
            for name, got in zip(settings, answers, strict=True):
                ok = [data.passkey_correct(a, p.key) for a, p in zip(got, cell, strict=True)]
                grid[name][i, j] = float(np.mean(ok))
                records += [
                    {
                        "setting": name,
                        "length": length,
                        "depth": depths[j],
                        "key": p.key,
                        "prompt_tokens": len(p.tokens),
                        "answer": a,
                        "correct": c,
                    }
                    for a, p, c in zip(got, cell, ok, strict=True)
                ]
            log(
                f"passkey L={length} depth={depths[j]}: "
                + ", ".join(f"{n} {grid[n][i, j]:.1f}" for n in settings)
                + f" ({time.perf_counter() - t0:.0f} s)"
            )
    return {
        "lengths": list(lengths),
        "depths": list(depths),
        "keys_per_cell": keys_per_cell,
        "new_tokens": new_tokens,
        "settings": {n: _describe(c) for n, c in settings.items()},
        "accuracy": {n: g.tolist() for n, g in grid.items()},
        "accuracy_by_length": {n: g.mean(axis=1).tolist() for n, g in grid.items()},
        "records": records,
        "seconds": time.perf_counter() - t0,
    }


def _describe(cfg: KiviConfig | None) -> str:
    if cfg is None:
        return "full precision"
    s = f"K{cfg.k_bits}/V{cfg.v_bits} bits, G={cfg.group_size}, R={cfg.residual_length}"
    for name in ("k_scale_format", "v_scale_format", "residual_format"):
        if getattr(cfg, name) is not Format.CACHE:
            s += f", {name}={getattr(cfg, name).value}"
    for name in ("k_range", "v_range"):
        if getattr(cfg, name) is not Range.MINMAX:
            s += f", {name}={getattr(cfg, name).value}"
    if cfg.mixed:
        s += (
            f", sinks={cfg.sinks}, sliding_keys={cfg.sliding_keys}, "
            f"fine_key_channels={cfg.fine_key_channels}, heavy_tokens={cfg.heavy_tokens}"
        )
        s += f" by {cfg.selection.value}" if cfg.heavy_tokens else ""
    return s


# ----------------------------------------------------------------------------- error analysis


def _head_errors(q, k, v, bits: int, group_size: int):
    """One query head: q [Q, D] over k, v [T, D] -> the paper's measures for both groupings."""
    a = analysis.attention_scores(q, k)
    out = {}
    for g in (PT, PC):
        k_hat = analysis.quantize_dequantize(k, bits, group_size, g)
        v_hat = analysis.quantize_dequantize(v, bits, group_size, g)
        out[g.value] = {
            "key": analysis.key_reconstruction_error(k, k_hat),
            "score": analysis.attention_score_error(q, k, k_hat),
            "value": analysis.value_reconstruction_error(v, v_hat),
            "output": analysis.attention_output_error(a, v, v_hat),
        }
    return out


@functools.partial(jax.jit, static_argnames=("num_queries", "bits", "group_size"))
def _layer_errors(params, tokens, *, num_queries: int, bits: int, group_size: int):
    """Every layer and query head's measures, and the per-channel mean |key| [L, H, D]."""
    c = params.config
    _, q, k, v = llama.forward_with_qkv(params, tokens, logits_at=jnp.zeros((1,), jnp.int32))
    q, k, v = (x[:, 0].astype(jnp.float32) for x in (q, k, v))  # [L, S, heads, D]
    S = q.shape[1]
    split = S - num_queries
    rep = c.num_heads // c.num_kv_heads
    qs = q[:, split:]  # [L, Q, N, D]: the last queries ...
    ks = jnp.repeat(k[:, :split], rep, axis=2)  # [L, T, N, D]: ... over the keys all before them
    vs = jnp.repeat(v[:, :split], rep, axis=2)
    per_head = jax.vmap(jax.vmap(_head_errors, (1, 1, 1, None, None)), (0, 0, 0, None, None))
    errors = per_head(qs, ks, vs, bits, group_size)  # leaves [L, N]
    magnitude = jnp.abs(k).mean(axis=1)  # [L, H, D]
    return errors, magnitude


@functools.partial(jax.jit, static_argnames=("num_queries", "configs"))
def _cache_output_errors(params, tokens, *, num_queries: int, configs):
    """Per KV setting and layer: ||O' - O||_F / ||O||_F of the last `num_queries` queries'
    attention output through the streaming cache (O', views.StreamingAttention) against full
    precision (O), both over the layer's real q/k/v: float32 [len(configs), L]."""
    _, q, k, v = llama.forward_with_qkv(params, tokens, logits_at=jnp.zeros((1,), jnp.int32))
    lengths = jnp.full((1,), tokens.shape[1], jnp.int32)
    full = views.FullAttention()

    def layer(qkv, view):
        ql, kl, vl = qkv  # [1, S, N or H, D]
        o = full(ql, kl, vl, lengths)[:, -num_queries:].astype(jnp.float32)
        o_hat = view(ql, kl, vl, lengths)[:, -num_queries:].astype(jnp.float32)
        return jnp.linalg.norm(o_hat - o) / jnp.linalg.norm(o)

    return jnp.stack(
        [
            jax.lax.map(
                functools.partial(layer, view=views.StreamingAttention(cfg, params.dtype)),
                (q, k, v),
            )
            for cfg in configs
        ]
    )


def error_study(
    params, ids, *, source: str, num_queries: int = 64, bits: int = 2, group_size: int = 32
) -> dict:
    """The paper's Tables 2 and 3 per layer on the real model (module doc, docs/accuracy.md).

    The last `num_queries` tokens' queries attend over all tokens before them (T = len - Q keys,
    T a multiple of G), so A is the true (unmasked) attention of those queries over that prefix.
    Per layer: key/value reconstruction errors are per KV head (a query head's copy counted once),
    score/output errors per query head; both averaged over heads.
    """
    t0 = time.perf_counter()
    keys = (len(ids) - num_queries) // group_size * group_size
    tokens = jnp.asarray(ids[: keys + num_queries], jnp.int32)[None]
    errors, magnitude = _layer_errors(
        params, tokens, num_queries=num_queries, bits=bits, group_size=group_size
    )
    rep = params.config.num_heads // params.config.num_kv_heads
    per_layer = {}
    for g, measures in errors.items():
        per_layer[g] = {}
        for name, x in measures.items():
            x = np.asarray(x)  # [L, N]
            if name in ("key", "value"):
                x = x[:, ::rep]  # one entry per KV head
            per_layer[g][name] = x.mean(axis=1).tolist()
    magnitude = np.asarray(magnitude)  # [L, H, D]
    ratio = magnitude.max(axis=2) / np.median(magnitude, axis=2)  # [L, H]
    outliers = {
        str(layer): [
            np.argsort(magnitude[layer, h])[::-1][:4].tolist() for h in range(ratio.shape[1])
        ]
        for layer in range(magnitude.shape[0])
    }
    summary = {
        g: {
            name: {"mean": float(np.mean(v)), "median": float(np.median(v))}
            for name, v in per_layer[g].items()
        }
        for g in per_layer
    }
    caches = {n: c for n, c in KV_SETTINGS.items() if c is not None}
    cache_errors = np.asarray(
        _cache_output_errors(
            params, tokens, num_queries=num_queries, configs=tuple(caches.values())
        )
    )  # [settings, L]
    return {
        "source": source,
        "keys": keys,
        "queries": num_queries,
        "bits": bits,
        "group_size": group_size,
        "per_layer": per_layer,
        "summary": summary,
        "layers_where_per_channel_key_wins": int(
            np.sum(np.array(per_layer["per-channel"]["key"]) < per_layer["per-token"]["key"])
        ),
        "layers_where_per_token_value_output_wins": int(
            np.sum(np.array(per_layer["per-token"]["output"]) < per_layer["per-channel"]["output"])
        ),
        "key_channel_magnitude": magnitude.tolist(),
        "key_outlier_ratio_max_over_median": ratio.tolist(),
        "top_key_channels": outliers,
        # The attention output through each streaming cache (all of the G/R layout, residual
        # window and side storage) against full precision, relative Frobenius error per layer.
        "cache_output_error": {n: cache_errors[i].tolist() for i, n in enumerate(caches)},
        "seconds": time.perf_counter() - t0,
    }


# ----------------------------------------------------------------------------- ablation


def ablation_study(
    params,
    tokenizer,
    ids,
    *,
    source: str,
    window: int,
    group_sizes=(16, 32, 64),
    residuals=(64, 128, 256),
    bits: int = 2,
    passkey_length: int = 2048,
    depths=(0.1, 0.3, 0.5, 0.7, 0.9),
    keys_per_cell: int = 2,
    log=print,
) -> dict:
    """KIVI-`bits` over G x R: perplexity (streaming view) and passkey at one length."""
    chunks = windows(ids, window)
    configs = {
        f"G{g}_R{r}": KiviConfig(k_bits=bits, v_bits=bits, group_size=g, residual_length=r)
        for g in group_sizes
        for r in residuals
    }
    ppl = {"fp": perplexity(params, chunks, views.FullAttention())}
    for name, cfg in configs.items():
        ppl[name] = perplexity(params, chunks, views.StreamingAttention(cfg, params.dtype))
        log(f"ablate ppl {name}: {ppl[name]['ppl']:.3f}")
    settings = {"fp": None, **configs}
    pk = passkey_study(
        params,
        tokenizer,
        lengths=[passkey_length],
        depths=list(depths),
        keys_per_cell=keys_per_cell,
        settings=settings,
        seed=1,
        log=log,
    )
    return {
        "source": source,
        "window": window,
        "windows": int(chunks.shape[0]),
        "bits": bits,
        "group_sizes": list(group_sizes),
        "residuals": list(residuals),
        "ppl": ppl,
        "passkey_length": passkey_length,
        "passkey_depths": list(depths),
        "passkey_keys_per_cell": keys_per_cell,
        "passkey": {n: pk["accuracy_by_length"][n][0] for n in settings},
        "passkey_records": pk["records"],
    }


# ----------------------------------------------------------------------------- mixed precision


def mix_candidates(budgets=(8, 16, 32, 64)) -> dict[str, KiviConfig | None]:
    """The settings of the mixed-precision study, by name: fp, KIVI-4, KIVI-2, then KIVI-2 with
    one part added at a time (4 sinks; sliding keys; 16 fine key channels), then heavy-token
    budgets N on top of those three, one curve per Selection."""
    base = dict(k_bits=2, v_bits=2)
    out: dict[str, KiviConfig | None] = {"fp": None, "kivi4": KIVI4, "kivi2": KIVI2}
    out["sinks"] = KiviConfig(**base, sinks=4)
    out["sinks+sliding"] = KiviConfig(**base, sinks=4, sliding_keys=True)
    out["sinks+sliding+F16"] = KiviConfig(**base, sinks=4, sliding_keys=True, fine_key_channels=16)
    for sel in Selection:
        for n in budgets:
            out[f"{sel.value} N{n}"] = KiviConfig(
                **base,
                sinks=4,
                sliding_keys=True,
                fine_key_channels=16,
                heavy_tokens=n,
                selection=sel,
            )
    return out


def cache_bytes(cfg: KiviConfig | None, model_config, *, max_len: int, dtype) -> int:
    """memory_report's total_bytes of one sequence's cache of `max_len` tokens, every layer."""
    from kivi_jax.memory import memory_report

    cache = init_cache(
        cfg,
        batch=1,
        max_len=max_len,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        dtype=dtype,
        num_layers=model_config.num_layers,
    )
    return memory_report(cache).total_bytes


def _mix_rows(params, chunks, settings, kivi2_bytes: int, bytes_at: int, what: str, log):
    rows = {}
    for name, cfg in settings.items():
        view = (
            views.FullAttention()
            if cfg is None
            else views.StreamingAttention(cfg, cache_dtype=params.dtype)
        )
        row = perplexity(params, chunks, view)
        row["bytes"] = cache_bytes(cfg, params.config, max_len=bytes_at, dtype=params.dtype)
        row["bytes_vs_kivi2"] = row["bytes"] / kivi2_bytes
        row["config"] = _describe(cfg)
        rows[name] = row
        log(
            f"mix {what} {name}: ppl {row['ppl']:.3f}, {row['bytes_vs_kivi2']:.3f}x KIVI-2's "
            f"bytes ({row['seconds']:.0f} s)"
        )
    return rows


def mix_study(
    params,
    ids,
    *,
    source: str,
    window: int,
    check=(),
    check_window: int = 2048,
    settings=None,
    bytes_at: int = 2048,
    log=print,
) -> dict:
    """The mixed-precision study: perplexity through the streaming view of each candidate
    (mix_candidates) on `ids` (the text the defaults are chosen on) and the bytes its cache
    allocates for one sequence of `bytes_at` tokens (memory_report, everything counted), as a
    ratio to KIVI-2's; then fp / KIVI-4 / KIVI-2 / kivi2-mix (the defaults) on each text of
    `check`, ((ids, source), ...), prose the settings were not chosen on."""
    settings = mix_candidates() if settings is None else settings
    kivi2_bytes = cache_bytes(KIVI2, params.config, max_len=bytes_at, dtype=params.dtype)
    chunks = windows(ids, window)
    rows = _mix_rows(params, chunks, settings, kivi2_bytes, bytes_at, "sweep", log)
    held_out = []
    for check_ids, check_source in check:
        check_chunks = windows(check_ids, check_window)
        check_rows = _mix_rows(
            params, check_chunks, KV_SETTINGS, kivi2_bytes, bytes_at, "check", log
        )
        held_out.append(
            {
                "source": check_source,
                "window": check_window,
                "windows": int(check_chunks.shape[0]),
                "scored_tokens": int(check_chunks.shape[0] * (check_window - 1)),
                "settings": check_rows,
            }
        )
    return {
        "source": source,
        "window": window,
        "windows": int(chunks.shape[0]),
        "scored_tokens": int(chunks.shape[0] * (window - 1)),
        "bytes_at": bytes_at,
        "kivi2_bytes": kivi2_bytes,
        "default": _describe(KIVI2_MIX),
        "settings": rows,
        "held_out": held_out,
    }


# ----------------------------------------------------------------------------- fewer bits


# Passkey runs these rows of `lean_candidates` only (a passkey cell per setting costs minutes
# on 2 cores); KIVI-2's and kivi2-mix's rows are the ppl and passkey studies'.
LEAN_PASSKEY = (
    "fp",
    "kivi2-lean",
    "kivi2-lean, R 160, no heavy",
    "kivi2-lean, key search",
    "kivi2-lean, R 160, no heavy, key search",
)


# kivi2-lean before its ring of 160 and key search (R 128, 16 heavy tokens, min/max): the rows named
# "kivi2-lean, ..." are this with one change each.
LEAN_R128 = dataclasses.replace(
    KIVI2_LEAN, residual_length=128, heavy_tokens=16, k_range=Range.MINMAX
)


def lean_candidates() -> dict[str, KiviConfig | None]:
    """The rows of the fewer-bits study (issue 61): fp, kivi2-lean (and LEAN_R128, the preset
    before the range search), KIVI-2 with each storage
    option alone (float8 scales and zeros, e4m3 scales with int8 zeros, an e4m3 or int8
    residual), kivi2-mix with its side storage trimmed (16 heavy tokens, not 32),
    kivi2-lean with an e4m3 residual (and e4m3 zeros: the earlier presets), and kivi2-lean
    with its 16 heavy tokens' bits spent on a longer ring (R 160) or on 2 more fine key
    channels (reallocations within 3.0 bits); kivi2-lean and its R 160 row with the keys'
    ranges searched (Range.SEARCH: no bits), the R 160 row and KIVI-2 with the values'."""
    k_search, v_search = dict(k_range=Range.SEARCH), dict(v_range=Range.SEARCH)
    r160 = dict(residual_length=160, heavy_tokens=0)
    e4m3 = dict(k_scale_format=Format.E4M3, v_scale_format=Format.E4M3)
    int8 = dict(k_scale_format=Format.E4M3_INT8, v_scale_format=Format.E4M3_INT8)
    e4m3_ring = dict(residual_format=Format.E4M3)
    return {
        "fp": None,
        "kivi2-lean": KIVI2_LEAN,
        "kivi2-lean, R 128, 16 heavy": LEAN_R128,
        "kivi2 + e4m3 scales": dataclasses.replace(KIVI2, **e4m3),
        "kivi2 + e4m3-int8 scales": dataclasses.replace(KIVI2, **int8),
        "kivi2 + e4m3 residual": dataclasses.replace(KIVI2, **e4m3_ring),
        "kivi2 + int8 residual": dataclasses.replace(KIVI2, residual_format=Format.INT8),
        "kivi2-mix, 16 heavy": dataclasses.replace(KIVI2_MIX, heavy_tokens=16),
        "kivi2-lean, e4m3 residual": dataclasses.replace(LEAN_R128, **e4m3_ring),
        "kivi2-lean, e4m3 residual and zeros": dataclasses.replace(LEAN_R128, **e4m3_ring, **e4m3),
        "kivi2-lean, R 160, no heavy": dataclasses.replace(LEAN_R128, **r160),
        "kivi2-lean, 18 fine, no heavy": dataclasses.replace(
            LEAN_R128, fine_key_channels=18, heavy_tokens=0
        ),
        "kivi2-lean, key search": dataclasses.replace(LEAN_R128, **k_search),
        "kivi2-lean, R 160, no heavy, key search": dataclasses.replace(
            LEAN_R128, **r160, **k_search
        ),
        "kivi2-lean, R 160, no heavy, value search": dataclasses.replace(
            LEAN_R128, **r160, **v_search
        ),
        "kivi2, value search": dataclasses.replace(KIVI2, **v_search),
    }


def format_candidates() -> dict[str, KiviConfig]:
    """KIVI-2 with each 8-bit format for the scales and zeros (e4m3 or e4m3 scales with int8
    zeros), and for the residual (e4m3, or int8 with a power-of-two scale per token): the
    configurations whose attention-output error picks the formats (e5m2 lost to e4m3 for
    both: docs/accuracy.md)."""
    out = {"kivi2": KIVI2}
    for f in (Format.E4M3, Format.E4M3_INT8):
        out[f"{f.value} scales"] = dataclasses.replace(KIVI2, k_scale_format=f, v_scale_format=f)
    for f in (Format.E4M3, Format.INT8):
        out[f"{f.value} residual"] = dataclasses.replace(KIVI2, residual_format=f)
    return out


def bits_rows(settings, *, head_dims=(64, 128), lengths=(1024, 4096, 32768)) -> dict:
    """held_bits per value (bfloat16 cache) of each setting: at each length and head_dim, and
    the maximum over the lengths 4096 ... 4096 + R (where the residual is fullest)."""
    from kivi_jax.memory import held_bits

    rows = {}
    for name, cfg in settings.items():
        row = {}
        for d in head_dims:
            for n in lengths:
                row[f"d{d}_{n}"] = held_bits(cfg, length=n, head_dim=d).bits_per_value
            r = 0 if cfg is None else cfg.residual_length
            row[f"d{d}_4k_max"] = max(
                held_bits(cfg, length=n, head_dim=d).bits_per_value for n in range(4096, 4097 + r)
            )
        rows[name] = row
    return rows


def lean_study(
    params,
    tokenizer,
    ids,
    *,
    source: str,
    window: int,
    error_ids,
    error_queries: int,
    passkey_lengths,
    depths,
    keys_per_cell: int,
    rows=None,
    format_errors: bool = True,
    log=print,
) -> dict:
    """Fewer bits per value (issue 61): for each `lean_candidates` row its held bits per value
    (bits_rows) and perplexity through the streaming view on `ids` in windows of `window`,
    passkey retrieval at `passkey_lengths` of the LEAN_PASSKEY rows; and the attention-output
    error of each 8-bit format (`format_candidates`, the errors study's measure on
    `error_ids`) that picked them. `rows`: only these rows of `lean_candidates` (fp always);
    `format_errors` False: no format errors (an empty table)."""
    t0 = time.perf_counter()
    settings = lean_candidates()
    unknown = sorted(set(rows or ()) - set(settings))
    if unknown:
        raise ValueError(f"lean: unknown rows {unknown}; the rows are {list(settings)}")
    if rows is not None:
        settings = {n: c for n, c in settings.items() if n == "fp" or n in rows}
    formats = format_candidates() if format_errors else {}
    keys = (len(error_ids) - error_queries) // 32 * 32
    tokens = jnp.asarray(error_ids[: keys + error_queries], jnp.int32)[None]
    errors = (
        np.zeros((0, 1))
        if not formats
        else np.asarray(
            _cache_output_errors(
                params, tokens, num_queries=error_queries, configs=tuple(formats.values())
            )
        )
    )  # [formats, L]
    format_errors = {
        n: {"mean": float(errors[i].mean()), "max": float(errors[i].max())}
        for i, n in enumerate(formats)
    }
    log(f"lean format errors: {format_errors}")
    chunks = windows(ids, window)
    ppl = {}
    for name, cfg in settings.items():
        view = views.FullAttention() if cfg is None else views.StreamingAttention(cfg, params.dtype)
        ppl[name] = perplexity(params, chunks, view)
        log(f"lean ppl {name}: {ppl[name]['ppl']:.3f} ({ppl[name]['seconds']:.0f} s)")
    pk = passkey_study(
        params,
        tokenizer,
        lengths=list(passkey_lengths),
        depths=list(depths),
        keys_per_cell=keys_per_cell,
        settings={n: settings[n] for n in LEAN_PASSKEY if n in settings},
        seed=2,
        log=log,
    )
    return {
        "source": source,
        "window": window,
        "windows": int(chunks.shape[0]),
        "scored_tokens": int(chunks.shape[0] * (window - 1)),
        "cache_dtype": str(jnp.dtype(params.dtype)),
        "settings": {n: _describe(c) for n, c in settings.items()},
        "bits": bits_rows({"kivi2": KIVI2, "kivi2-mix": KIVI2_MIX, **settings}),
        "ppl": ppl,
        "passkey_lengths": list(passkey_lengths),
        "passkey_depths": list(depths),
        "passkey_keys_per_cell": keys_per_cell,
        "passkey": pk["accuracy_by_length"],
        "passkey_records": pk["records"],
        "format_error_keys": keys,
        "format_error_queries": error_queries,
        "format_settings": {n: _describe(c) for n, c in formats.items()},
        "format_errors": format_errors,
        "format_bits": bits_rows(formats),
        "seconds": time.perf_counter() - t0,
    }
