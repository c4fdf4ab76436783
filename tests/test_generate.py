"""generate(): the jitted decode loop over the full-precision and KIVI caches, on a tiny model.

The tiny model has untied embeddings: with random tied embeddings greedy decoding just repeats a
token, which would make token-equality checks vacuous.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import tiny_config, tiny_params, write_gguf

import kivi_jax
from kivi_jax.config import KiviConfig
from kivi_jax.generate import (
    DECODE_CHUNK,
    TokenStream,
    _decode_jit,
    _start_jit,
    generate,
    generate_text,
)

N = 12  # new tokens per test


@pytest.fixture(scope="module")
def params():
    return tiny_params(seed=0, tie_embeddings=False)  # context 256, vocab 264


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, 260, size=n).astype(np.int32)


def greedy_by_forward(params, ids, n):
    """The no-cache reference: re-run the whole sequence through forward() for every token (in a
    fixed-width buffer, so forward compiles once; causality makes the trailing zeros harmless)."""
    seq = np.zeros((1, len(ids) + n), np.int32)
    seq[0, : len(ids)] = ids
    for t in range(len(ids), len(ids) + n):
        seq[0, t] = int(np.asarray(kivi_jax.forward(params, jnp.asarray(seq)))[0, t - 1].argmax())
    return seq[0, len(ids) :].tolist()


def test_full_cache_greedy_equals_recomputing_the_sequence(params):
    ids = prompt(21)
    out = generate(params, ids[None], kv="full", max_new_tokens=N)
    assert out.shape == (1, N) and out.dtype == jnp.int32
    assert np.asarray(out[0]).tolist() == greedy_by_forward(params, ids, N)
    assert len(set(np.asarray(out[0]).tolist())) > 3  # the check is not vacuous


def test_kivi_cache_whose_residual_covers_everything_equals_full(params):
    """With R >= prompt + new tokens nothing is ever quantized: KIVI must give the same tokens."""
    ids = prompt(40, seed=1)
    full = generate(params, ids[None], kv="full", max_new_tokens=N)
    kivi = generate(
        params, ids[None], kv=KiviConfig(group_size=32, residual_length=64), max_new_tokens=N
    )
    np.testing.assert_array_equal(kivi, full)


@pytest.mark.parametrize(
    "kv", ["kivi2", "kivi4", "kivi2-mix", KiviConfig(k_bits=2, v_bits=4, residual_length=32)]
)
def test_quantized_caches_run_past_the_residual(params, kv):
    """A 150-token prompt with R = 128 (or 32) quantizes keys and values during prefill and decode.
    The first token comes from full-precision prefill attention, so it matches the full cache."""
    ids = prompt(150, seed=2)
    full = np.asarray(generate(params, ids[None], kv="full", max_new_tokens=N))
    out = np.asarray(generate(params, ids[None], kv=kv, max_new_tokens=N))
    assert out.shape == (1, N) and ((0 <= out) & (out < params.config.vocab_size)).all()
    assert out[0, 0] == full[0, 0]


@pytest.mark.parametrize("kv", ["full", "kivi2", "kivi2-mix"])
def test_prompt_in_a_ragged_batch_yields_the_same_tokens_as_alone(params, kv):
    long, short = prompt(150, seed=3), prompt(37, seed=4)
    batch = np.zeros((2, 150), np.int32)
    batch[0], batch[1, :37] = long, short
    batch[1, 37:] = 999_999  # padding is never read (not even checked against the vocabulary)
    out = generate(params, batch, kv=kv, max_new_tokens=N, lengths=[150, 37])
    np.testing.assert_array_equal(out[0], generate(params, long[None], kv=kv, max_new_tokens=N)[0])
    np.testing.assert_array_equal(out[1], generate(params, short[None], kv=kv, max_new_tokens=N)[0])


@pytest.mark.parametrize("kv", ["full", "kivi2"])
def test_prefill_in_chunks_of_rows_gives_the_tokens_of_one_pass(params, kv):
    # 5 ragged rows prefilled 2 at a time (the last chunk, rows 3-4, after rows 0-1 and 2-3:
    # row 3 is prefilled twice, from empty states, to the same state).
    rows = [prompt(n, seed=n) for n in (40, 17, 63, 5, 28)]
    batch = np.zeros((5, 63), np.int32)
    for b, r in enumerate(rows):
        batch[b, : len(r)] = r
    lengths = [len(r) for r in rows]
    whole = generate(params, batch, kv=kv, max_new_tokens=N, lengths=lengths)
    chunked = generate(params, batch, kv=kv, max_new_tokens=N, lengths=lengths, prefill_rows=2)
    np.testing.assert_array_equal(chunked, whole)


def test_prefill_in_chunks_of_rows_starts_each_chunk_from_empty_states(params):
    # A mixed state's empty heavy-token slots are -1 (not 0, a valid position): a chunk's
    # rows start from init_cache's empty state, as a prefill of them alone does.
    from kivi_jax.models import llama

    cfg = dataclasses.replace(kivi_jax.KIVI2_MIX, heavy_tokens=32)
    prompts = np.stack([prompt(70, seed=b) for b in range(3)])
    lengths = jnp.asarray([70, 40, 55], jnp.int32)
    empty = lambda batch: kivi_jax.init_cache(
        cfg, batch=batch, max_len=128, num_kv_heads=params.config.num_kv_heads,
        head_dim=params.config.head_dim, dtype=params.dtype, num_layers=params.config.num_layers,
    )  # fmt: skip
    prefill = jax.jit(llama.prefill, static_argnames="rows")
    _, chunked = prefill(params, prompts, lengths, empty(3), rows=2)
    for b in range(3):
        _, alone = prefill(params, prompts[b : b + 1], lengths[b : b + 1], empty(1))
        heavy = lambda states, row: np.asarray(states[0].side.heavy_pos[row])
        np.testing.assert_array_equal(heavy(chunked, b), heavy(alone, 0))


@pytest.mark.parametrize("kv", ["full", "kivi2"])
def test_the_prefill_working_memory_follows_the_rows_not_the_batch(kv):
    from kivi_jax.generate import Sampling, _prepare, _program_args

    config = tiny_config(hidden_size=256, intermediate_size=512, max_context=1024)
    params = kivi_jax.init_params(config, jax.random.key(0))

    def scratch(batch, rows):
        s = Sampling()
        toks, lens, cache, r = _prepare(
            params, np.ones((batch, 500), np.int32), None, kv=kv, max_new_tokens=8, sampling=s,
            prefill_rows=rows,
        )  # fmt: skip
        per_row, kw, _ = _program_args(s, batch, 8)
        lowered = _start_jit.lower(params, toks, lens, cache, per_row, **kw, prefill_rows=r)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    assert scratch(16, 2) < 1.01 * scratch(4, 2)  # the [batch, vocab] logits aside
    assert scratch(16, None) > 3 * scratch(4, None)  # all rows at once: 4x the rows


@pytest.mark.parametrize("rows", [None, 2])
def test_each_prompt_block_writes_its_state_before_the_next_block_starts(rows):
    # One optimization barrier per layer on (residual stream, that layer's state): without
    # it XLA on a GPU wrote every layer's state at the end of the prompt and kept every
    # layer's K/V alive until then (H200, Llama-2-7B, 10 rows of 2048 tokens: 25.0 GB of
    # prefill scratch against 2.6 GB). The CPU's buffer assignment does not show it, so the
    # program's structure is checked.
    from kivi_jax.generate import Sampling, _prepare, _program_args

    config = tiny_config(num_layers=3)
    params = kivi_jax.init_params(config, jax.random.key(0))
    s = Sampling()
    toks, lens, cache, r = _prepare(
        params, np.ones((4, 40), np.int32), None, kv="kivi2", max_new_tokens=4, sampling=s,
        prefill_rows=rows,
    )  # fmt: skip
    per_row, kw, _ = _program_args(s, 4, 4)
    hlo = _start_jit.lower(params, toks, lens, cache, per_row, **kw, prefill_rows=r).as_text()
    assert hlo.count("stablehlo.optimization_barrier") == config.num_layers


def test_prefill_rows_must_be_positive(params):
    with pytest.raises(ValueError, match="prefill_rows must be a positive int"):
        generate(params, prompt(10)[None], max_new_tokens=N, prefill_rows=0)


@pytest.mark.parametrize("n", [N, 2 * DECODE_CHUNK + 5])  # the loop's chunks and remainder
def test_each_sequence_stops_at_its_eos_and_is_padded_with_it(params, n):
    a, b = prompt(30, seed=5), prompt(30, seed=6)
    free = np.asarray(generate(params, np.stack([a, b]), kv="kivi2", max_new_tokens=n))
    # row 0 produces this token first at step s (s >= 2)
    s = next(t for t in range(2, n - 1) if free[0, t] not in free[0, :t])
    eos = int(free[0, s])
    out = np.asarray(generate(params, np.stack([a, b]), kv="kivi2", max_new_tokens=n, eos_id=eos))
    np.testing.assert_array_equal(out[0, : s + 1], free[0, : s + 1])
    assert (out[0, s + 1 :] == eos).all()
    stop = list(free[1]).index(eos) + 1 if eos in free[1] else n
    np.testing.assert_array_equal(out[1, :stop], free[1, :stop])  # row 1 unaffected by row 0
    assert (out[1, stop:] == eos).all()


def test_sampling_is_seeded_and_top_k_1_or_tiny_top_p_is_greedy(params):
    ids = prompt(20, seed=7)[None]
    greedy = generate(params, ids, kv="full", max_new_tokens=N)
    hot = dict(kv="full", max_new_tokens=N, temperature=1.5)
    s1, s1_again, s2 = (generate(params, ids, **hot, seed=s) for s in (1, 1, 2))
    np.testing.assert_array_equal(s1, s1_again)
    assert not np.array_equal(s1, s2)
    np.testing.assert_array_equal(generate(params, ids, **hot, top_k=1, seed=3), greedy)
    np.testing.assert_array_equal(generate(params, ids, **hot, top_p=1e-6, seed=3), greedy)


def penalized_greedy_by_forward(params, ids, n, *, frequency, presence, repetition):
    """greedy_by_forward with the penalties applied in numpy to each step's logits: the
    repetition penalty over the prompt's and the generated ids (divide a positive logit,
    multiply a negative one), then frequency x count and presence for the generated ids."""
    seq = np.zeros((1, len(ids) + n), np.int32)
    seq[0, : len(ids)] = ids
    for t in range(len(ids), len(ids) + n):
        logits = np.asarray(kivi_jax.forward(params, jnp.asarray(seq)))[0, t - 1]
        count = np.bincount(seq[0, len(ids) : t], minlength=logits.size)
        seen = (count > 0) | np.isin(np.arange(logits.size), ids)
        logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition),
                          logits)  # fmt: skip
        logits = logits - frequency * count - presence * (count > 0)
        seq[0, t] = int(logits.argmax())
    return seq[0, len(ids) :].tolist()


def test_greedy_tokens_with_penalties_equal_penalizing_each_steps_logits(params):
    """OpenAI's frequency and presence penalties and transformers' repetition penalty, as
    traced per-row values: the tokens equal a numpy loop over forward's logits, and differ
    from the unpenalized ones (the tiny model repeats itself)."""
    ids = prompt(21, seed=13)
    n, pen = 24, dict(frequency=0.7, presence=0.4, repetition=1.6)
    out = generate(params, ids[None], kv="full", max_new_tokens=n, frequency_penalty=0.7,
                   presence_penalty=0.4, repetition_penalty=1.6)  # fmt: skip
    expected = penalized_greedy_by_forward(params, ids, n, **pen)
    assert np.asarray(out[0]).tolist() == expected
    assert expected != greedy_by_forward(params, ids, n)
    for one in [dict(frequency=0.0, presence=0.0, repetition=1.6),
                dict(frequency=1.5, presence=0.0, repetition=1.0),
                dict(frequency=0.0, presence=-1.0, repetition=1.0)]:  # fmt: skip
        out = generate(params, ids[None], kv="full", max_new_tokens=n,
                       frequency_penalty=one["frequency"], presence_penalty=one["presence"],
                       repetition_penalty=one["repetition"])  # fmt: skip
        assert np.asarray(out[0]).tolist() == penalized_greedy_by_forward(params, ids, n, **one)


def test_a_new_penalty_value_compiles_nothing(params):
    ids = prompt(20, seed=9)[None]
    generate(params, ids, kv="full", max_new_tokens=N, repetition_penalty=1.2)
    before = _start_jit._cache_size(), _decode_jit._cache_size()
    for kw in [dict(frequency_penalty=0.5), dict(presence_penalty=-0.3, repetition_penalty=0.8)]:
        generate(params, ids, kv="full", max_new_tokens=N, **kw)
    assert (_start_jit._cache_size(), _decode_jit._cache_size()) == before


def test_bfloat16_params_generate_with_a_bfloat16_cache(params):
    ids = prompt(20, seed=8)[None]
    out = generate(params.astype(jnp.bfloat16), ids, kv="kivi2", max_new_tokens=N)
    assert out.shape == (1, N)


def _decode_program(params, kv, *, batch=1, prompt_len=20, new_tokens=N, eos_id=None):
    """generate's compiled decode loop for these shapes (its prefill program's output as input)."""
    from kivi_jax.generate import Sampling, _prepare, _program_args, _start

    sampling = Sampling(eos_id=eos_id)
    ids = np.stack([prompt(prompt_len, seed=b) for b in range(batch)])
    tokens, lengths, cache, rows = _prepare(
        params, ids, None, kv=kv, max_new_tokens=new_tokens, sampling=sampling
    )
    per_row, start_kw, decode_kw = _program_args(sampling, batch, new_tokens)
    start = functools.partial(_start, **start_kw, prefill_rows=rows)
    state = jax.eval_shape(start, params, tokens, lengths, cache, per_row)
    return _decode_jit.lower(params, state, jnp.int32(new_tokens), **decode_kw)


def test_the_decode_loop_is_one_program_that_updates_the_state_in_place(params):
    lowered = _decode_program(params, "kivi2")
    hlo = lowered.as_text()
    assert hlo.count("stablehlo.while") >= 1
    # the donated state is aliased to an output, so the loop updates it in place
    assert "tf.aliasing_output" in hlo


@pytest.mark.parametrize("eos_id", [None, 0])
def test_the_decode_program_is_one_loop_of_chunks_of_steps(params, eos_id):
    # chunks of DECODE_CHUNK steps (a fixed-count loop) under a while loop: one copy of the
    # step, whatever max_new_tokens
    hlo = _decode_program(params, "kivi2", new_tokens=2 * DECODE_CHUNK + 5, eos_id=eos_id)
    assert hlo.as_text().count("stablehlo.while") == 2


def test_a_decode_step_runs_four_matmuls_per_layer(monkeypatch):
    # q, k and v come out of one matmul, and the MLP's gate and up out of another (fewer,
    # larger matmuls read the weights closer to the memory bandwidth: H200, 7B widths, batch
    # 16, 6% faster, batch 96 15%); with the output and down projections, 4 per layer and the
    # output head. The attention is left out (the CPU's reference attention has einsums).
    from kivi_jax.models import llama

    monkeypatch.setattr(llama, "decode_attention", lambda q, cache, window=None: q)
    config = tiny_config(num_layers=3)
    params = kivi_jax.init_params(config, jax.random.key(0))
    hlo = _decode_program(params, "kivi2").as_text()
    assert hlo.count("stablehlo.dot_general") == 4 * config.num_layers + 1


def test_a_decode_step_rotates_q_and_k_in_one_operation_per_layer(monkeypatch):
    # RoPE runs once over all heads of the q/k/v matmul's output (the value heads at angle 0),
    # so that XLA makes q, k and v in one fusion: on the H200, 7B widths, batch 16, a KIVI-2
    # step ran 2 kernels a layer fewer than with q and k rotated apart. One concatenate of
    # the rotation's two halves per layer, over all N + 2H heads.
    from kivi_jax.models import llama

    monkeypatch.setattr(llama, "decode_attention", lambda q, cache, window=None: q)
    config = tiny_config(num_layers=3)
    params = kivi_jax.init_params(config, jax.random.key(0))
    heads, half = config.num_heads + 2 * config.num_kv_heads, config.head_dim // 2
    for kv in ("full", "kivi2"):
        hlo = _decode_program(params, kv).as_text()
        halves = f"(tensor<1x{heads}x{half}xf32>, tensor<1x{heads}x{half}xf32>)"
        rotations = [ln for ln in hlo.splitlines() if "stablehlo.concatenate" in ln]
        assert sum(halves in ln for ln in rotations) == config.num_layers
        assert not any(f"x{half}xf32>, tensor<" in ln for ln in rotations if halves not in ln)


@pytest.mark.parametrize("kv", ["full", "kivi2"])
def test_a_decode_step_copies_neither_weights_nor_cache(monkeypatch, kv):
    # Each layer's weights and KV state are buffers of their own, read and written where they
    # lie, so the decode loop's scratch memory is below one layer's smallest weight matrix and
    # does not grow with the cache's capacity (a layer scan over stacked weights copies every
    # matrix per step; a layer's cache read out of a stacked cache is a copy that grows with
    # it; test_cache checks that an append copies no ring). The attention is left out: on the
    # CPU it is the reference, which dequantizes the cache into float32 by design (on a GPU
    # the kernels and cuDNN read the buffers as they are).
    from kivi_jax.models import llama

    monkeypatch.setattr(llama, "decode_attention", lambda q, cache, window=None: q)
    config = tiny_config(hidden_size=512, intermediate_size=1024, num_layers=3, max_context=4096)
    params = kivi_jax.init_params(config, jax.random.key(0))
    lw = params.layers[0]
    projections = (lw.wq, lw.wk, lw.wv, lw.wo, lw.w_gate, lw.w_up, lw.w_down)
    smallest_weight = min(x.nbytes for x in projections)

    def scratch(new_tokens):
        lowered = _decode_program(params, kv, batch=2, prompt_len=100, new_tokens=new_tokens)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    small = scratch(400)
    assert small < smallest_weight
    assert scratch(3000) == small


def test_token_stream_yields_what_generate_returns(params):
    ids = prompt(25, seed=9)
    stream = TokenStream(params, ids[None], kv="kivi2", max_new_tokens=N)
    streamed = [int(t[0]) for t in stream]
    np.testing.assert_array_equal(
        streamed, generate(params, ids[None], kv="kivi2", max_new_tokens=N)[0]
    )
    s = stream.stats
    assert (s.prompt_tokens, s.generated_tokens) == (25, N)
    assert s.held_tokens == 25 + N - 1  # the last token sampled is never fed
    assert s.prefill_s > 0 and s.decode_s > 0 and s.compile_s > 0
    # 36 tokens in a cache with a 128-token full-precision residual: KIVI allocates more than an
    # unquantized cache of this capacity (the residual is a fixed cost that long contexts repay)
    # capacity: the prompt's and max_new_tokens' buckets
    assert s.kv_capacity == 64 + DECODE_CHUNK and s.kv_bytes > s.kv_full_bytes > 0


def test_generate_text_applies_the_chat_template_and_stops_at_eos(tmp_path, params):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, params)
    model = kivi_jax.load_model(path, dtype=jnp.float32)
    text = generate_text(model, "the theme", kv="kivi2", max_new_tokens=8)
    assert isinstance(text, str)
    raw = generate_text(model, "the theme", kv="kivi2", max_new_tokens=8, chat=False)
    assert isinstance(raw, str)
    for chat in (True, False):
        with pytest.raises(ValueError, match="the prompt is empty: ''"):
            generate_text(model, "", chat=chat)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=250), r"prompt \(10 tokens\) \+ max_new_tokens \(250\) = 260 exceeds"),
        (dict(kv="kivi3"), "unknown kv 'kivi3'"),
        (dict(kv=None), "unknown kv None"),
        (dict(max_new_tokens=0), "max_new_tokens must be a positive int"),
        (dict(lengths=[11]), r"lengths must lie in \[1, 10\]"),
        (dict(lengths=[0]), r"lengths must lie in \[1, 10\]"),
        (dict(lengths=[3, 4]), "lengths must be 1 integers"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(top_k=0), "top_k must be a positive int"),
        (dict(eos_id=10_000), "eos_id 10000 is outside the vocabulary"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0 and finite"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number"),
    ],
)
def test_bad_arguments_fail_before_anything_runs(params, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(params, prompt(10)[None], **{"max_new_tokens": N, **kwargs})


@pytest.mark.parametrize("bad", [-1, 264, 10**6])
def test_tokens_outside_the_vocabulary(params, bad):
    ids = prompt(10)
    ids[4] = bad
    with pytest.raises(ValueError, match=rf"token id {bad} at \[0, 4\] is outside the vocabulary"):
        generate(params, ids[None], max_new_tokens=N)


def test_tokens_must_be_a_2d_integer_array(params):
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        generate(params, prompt(10), max_new_tokens=N)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        generate(params, np.zeros((1, 5), np.float32), max_new_tokens=N)


def test_a_ragged_list_of_prompts_says_to_pad_and_pass_lengths(params):
    with pytest.raises(ValueError, match=r"right-pad them to one width .* lengths=\[3, 2\]"):
        generate(params, [[1, 2, 3], [4, 5]], max_new_tokens=N)
    with pytest.raises(ValueError, match=r"integer array \[batch, seq\]"):
        generate(params, [[1, 2, 3], 4], max_new_tokens=N)


def test_prompts_and_new_tokens_of_similar_length_share_one_compiled_loop(params):
    """Prompt widths are padded up to a multiple of 64, max_new_tokens to one of DECODE_CHUNK:
    33 and 50 tokens, 5 and 9 new ones run the same programs."""
    a = generate(params, prompt(33)[None], kv="kivi4", max_new_tokens=5)
    before = _start_jit._cache_size(), _decode_jit._cache_size()
    b = generate(params, prompt(50)[None], kv="kivi4", max_new_tokens=9)
    assert (_start_jit._cache_size(), _decode_jit._cache_size()) == before
    assert a.shape == (1, 5) and b.shape == (1, 9)


def test_a_new_temperature_top_k_top_p_or_seed_compiles_nothing(params):
    ids = prompt(20, seed=9)[None]
    generate(params, ids, kv="full", max_new_tokens=N, temperature=0.7, seed=1)
    before = _start_jit._cache_size(), _decode_jit._cache_size()
    for kw in [dict(temperature=1.3, seed=2), dict(temperature=0.5, top_k=5, top_p=0.9, seed=3)]:
        generate(params, ids, kv="full", max_new_tokens=N, **kw)
    assert (_start_jit._cache_size(), _decode_jit._cache_size()) == before


def test_a_rows_samples_depend_on_its_seed_not_on_its_neighbours(params):
    """Row b samples as `seed + b` alone: the same tokens beside other prompts or alone."""
    a, b = prompt(20, seed=10), prompt(20, seed=11)
    hot = dict(kv="full", max_new_tokens=N, temperature=1.0, top_p=0.95)
    pair = np.asarray(generate(params, np.stack([a, b]), **hot, seed=4))
    other = np.asarray(generate(params, np.stack([prompt(20, seed=12), b]), **hot, seed=4))
    np.testing.assert_array_equal(pair[1], other[1])
    np.testing.assert_array_equal(pair[1], np.asarray(generate(params, b[None], **hot, seed=5))[0])
    np.testing.assert_array_equal(pair[0], np.asarray(generate(params, a[None], **hot, seed=4))[0])


_SECOND_CALL = """
import json, sys
import jax, jax.numpy as jnp
from jax._src import config
import kivi_jax
from kivi_jax.models.config import LlamaConfig

context = list(config.trace_context_names())
compiled = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, fun_name="?", **_: compiled.append(fun_name)
    if name == "/jax/core/compile/backend_compile_duration" else None
)
cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32, max_context=256)
params = kivi_jax.init_params(cfg, jax.random.key(0))
tokens = jnp.ones((2, 40), jnp.int32)
kivi_jax.generate(params, tokens, kv=sys.argv[1], max_new_tokens=3).block_until_ready()
# Every kernel module a GPU or TPU run would load, as the first call there does.
import kivi_jax.pallas_kernels.append.gpu, kivi_jax.pallas_kernels.decode_attention  # noqa
first = len(compiled)
kivi_jax.generate(params, tokens, kv=sys.argv[1], max_new_tokens=3).block_until_ready()
print(json.dumps(dict(context_changed=list(config.trace_context_names()) != context,
                      first=first, second=compiled[first:])))
"""


@pytest.mark.parametrize("kv", ["full", "kivi2"])
def test_a_second_generate_call_compiles_nothing(kv):
    """In a fresh process (Pallas not yet imported), the first call leaves jax's cache keys as
    they were, and a second call of the same shapes reuses every program."""
    import json
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _SECOND_CALL, kv], capture_output=True, text=True, check=True
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["first"] > 0
    assert not result["context_changed"]
    assert result["second"] == []
