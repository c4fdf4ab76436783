"""The fused append kernel (pallas_kernels/append/gpu.py; interpreted on the CPU, compiled on a
GPU) writes the same state as the XLA append (the reference), bit for bit, on fresh random
inputs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from kivi_jax import cache as kc

CONFIGS = [
    (2, 2, 32, 128, 128, jnp.bfloat16),
    (4, 4, 32, 128, 64, jnp.bfloat16),
    (2, 4, 16, 64, 64, jnp.float16),
    (4, 2, 32, 64, 128, jnp.float32),
]
ARGS = ("k_bits", "v_bits", "group_size", "residual", "head_dim", "dtype")
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
MAX_LEN = 320  # every test state's capacity


def _use_xla_append(m):
    m.setattr(kc, "_append_kernel_applies", lambda cache: False)


def _use_kernel(m, *, interpret: bool, traced: list):
    """The kernel wherever it supports the cache (interpreted: on any backend)."""
    m.setattr(kc, "_append_kernel_applies", kc._append_kernel_supports)
    kernel = kc._append_with_kernel

    def counted(*args, **kwargs):
        traced.append(1)
        return kernel(*args, **kwargs, interpret=interpret)

    m.setattr(kc, "_append_with_kernel", counted)


def _both_ways(monkeypatch, run, *, interpret: bool):
    """run() with the XLA append, then with the kernel; the jit caches cleared around each, as
    the path is chosen when a function is traced."""
    out, traced = [], []
    for use in (_use_xla_append, lambda m: _use_kernel(m, interpret=interpret, traced=traced)):
        with monkeypatch.context() as m:
            use(m)
            jax.clear_caches()
            out.append(run())
    jax.clear_caches()
    assert traced, "the kernel was not used"
    return out


def _state(cfg, lengths, H, D, max_len, dtype, rng):
    B, seq = len(lengths), max(int(lengths.max()), 1)
    k = jnp.asarray(rng.standard_normal((B, seq, H, D)) * 3, dtype)
    v = jnp.asarray(rng.standard_normal((B, seq, H, D)), dtype)
    cache = kivi_jax.init_cache(
        cfg, batch=B, max_len=max_len, num_kv_heads=H, head_dim=D, dtype=dtype
    )
    return kivi_jax.prefill(cache, k, v, lengths=jnp.asarray(lengths, jnp.int32))


def _assert_same_state(got, want):
    bytes_of = lambda x: np.asarray(x).view(np.uint8)
    paths = jax.tree_util.tree_flatten_with_path(got)[0]
    differing = {
        jax.tree_util.keystr(path): int(np.sum(bytes_of(a) != bytes_of(b)))
        for (path, a), b in zip(paths, jax.tree.leaves(want), strict=True)
    }
    assert not any(differing.values()), {k: n for k, n in differing.items() if n}


def _check(monkeypatch, k_bits, v_bits, G, R, D, dtype, *, lengths, active, H, interpret):
    rng = np.random.default_rng(k_bits * 100 + v_bits * 10 + G)
    cfg = kivi_jax.KiviConfig(k_bits=k_bits, v_bits=v_bits, group_size=G, residual_length=R)
    _check_config(monkeypatch, cfg, D, dtype, rng, lengths=lengths, active=active, H=H,
                  interpret=interpret)  # fmt: skip


def _check_config(monkeypatch, cfg, D, dtype, rng, *, lengths, active, H, interpret):
    cache = _state(cfg, lengths, H, D, MAX_LEN, dtype, rng)
    k_new = jnp.asarray(rng.standard_normal((len(lengths), H, D)) * 3, dtype)
    v_new = jnp.asarray(rng.standard_normal((len(lengths), H, D)), dtype)
    # under jit, as in a decode loop (a full row's token is then dropped and flagged)
    append = jax.jit(lambda c, k, v, a: kivi_jax.append(c, k, v, active=a))
    run = lambda: append(cache, k_new, v_new, jnp.asarray(active))
    want, got = _both_ways(monkeypatch, run, interpret=interpret)
    _assert_same_state(got, want)


def _edge_rows(G, R):
    # empty, mid-group, completing a group, completing the first R, a value leaving with a
    # group completing, inactive, the last slot of the capacity, full (the token overflows)
    lengths = np.array([0, 5, 2 * G - 1, R - 1, R + 3 * G - 1, R + 3, MAX_LEN - 1, MAX_LEN])
    return lengths, np.array([True, True, True, True, True, False, True, True])


@pytest.mark.parametrize(
    "interpret",
    [
        pytest.param(True, id="interpreted"),
        pytest.param(False, id="gpu", marks=[pytest.mark.gpu, needs_gpu]),
    ],
)
@pytest.mark.parametrize(ARGS, CONFIGS)
def test_the_kernel_appends_what_the_xla_append_does(
    monkeypatch, k_bits, v_bits, group_size, residual, head_dim, dtype, interpret
):
    lengths, active = _edge_rows(group_size, residual)
    _check(monkeypatch, k_bits, v_bits, group_size, residual, head_dim, dtype,
           lengths=lengths, active=active, H=2, interpret=interpret)  # fmt: skip


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(ARGS, CONFIGS)
def test_on_the_gpu_the_kernel_quantizes_millions_of_codes_as_xla_does(
    monkeypatch, k_bits, v_bits, group_size, residual, head_dim, dtype
):
    # every row completes a key group and has a value leaving the window: 256 rows x 8 heads
    # quantize 256 * 8 * G * D key codes and 256 * 8 * D value codes (1-2 M and 0.1-0.3 M)
    G, R = group_size, residual
    groups = np.random.default_rng(1).integers(0, (MAX_LEN - R) // G, 256)
    lengths = R + groups * G + G - 1
    _check(monkeypatch, k_bits, v_bits, G, R, head_dim, dtype,
           lengths=lengths, active=np.ones(256, bool), H=8, interpret=False)  # fmt: skip


# kivi2-mix's parts with R = 64 and 4 heavy slots, so that the slots fill within MAX_LEN
MIXED = dataclasses.replace(kivi_jax.KIVI2_MIX, residual_length=64, heavy_tokens=4)


@pytest.mark.parametrize(
    "interpret",
    [
        pytest.param(True, id="interpreted"),
        pytest.param(False, id="gpu", marks=[pytest.mark.gpu, needs_gpu]),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_kernel_appends_to_a_mixed_state_what_the_xla_append_does(
    monkeypatch, dtype, interpret
):
    # 4 sinks, 16 fine key channels, heavy tokens by ERROR, G = 32, R = 64. Rows: empty, a
    # sink arriving, the first key group completing (its sinks read as token 4), the first
    # value leaving (a sink: no candidate), the first candidate, a group completing as a
    # value leaves, the heavy slots full (inactive, active), the last slot, full
    G, R = MIXED.group_size, MIXED.residual_length
    lengths = np.array([0, 3, G - 1, R, R + 4, R + 3 * G - 1, 200, 201, MAX_LEN - 1, MAX_LEN])
    active = np.array([True] * 6 + [False] + [True] * 3)
    cache = kivi_jax.init_cache(MIXED, batch=1, max_len=64, num_kv_heads=1, head_dim=64)
    assert kc._append_kernel_supports(cache)
    _check_config(monkeypatch, MIXED, 64, dtype, np.random.default_rng(7), lengths=lengths,
                  active=active, H=2, interpret=interpret)  # fmt: skip


def test_the_kernel_takes_the_shipped_heavy_slots_and_no_more():
    init = lambda cfg: kivi_jax.init_cache(cfg, batch=1, max_len=256, num_kv_heads=1, head_dim=64)
    assert kc._append_kernel_supports(init(kivi_jax.KIVI2_MIX))  # 32 heavy tokens
    assert not kc._append_kernel_supports(
        init(dataclasses.replace(kivi_jax.KIVI2_MIX, heavy_tokens=64))
    )


def test_the_kernel_is_used_only_on_a_gpu():
    cache = kivi_jax.init_cache(
        kivi_jax.KIVI2, batch=1, max_len=64, num_kv_heads=1, head_dim=64, dtype=jnp.float32
    )
    assert kc._append_kernel_supports(cache)
    assert kc._append_kernel_applies(cache) == (jax.default_backend() == "gpu")


def test_generate_with_the_kernel_gives_the_tokens_of_the_xla_append(monkeypatch):
    # ragged prompts across the residual length, 40 steps: values leave the window and key
    # groups complete under the kernel (interpreted), in the model's jitted decode loop
    from tiny_model import tiny_config

    params = kivi_jax.init_params(tiny_config(max_context=512), jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, params.config.vocab_size, (3, 150)).astype(np.int32)
    lengths = np.array([150, 97, 120])
    run = lambda: kivi_jax.generate(params, tokens, lengths=lengths, max_new_tokens=40)
    want, got = _both_ways(monkeypatch, run, interpret=True)
    np.testing.assert_array_equal(got, want)


def _crafted_heavy_slots(cache, scores, rng):
    """`cache` (a MIXED state) with random heavy slots: each row's filled to a random count
    (even rows full) with sorted positions in [S, p) (p = l - R, the token leaving next),
    random keys and values, and scores drawn from {0, 1, 2, +inf} and the row's `scores` [B, H]
    (ties with the candidate); rows 0 and 4 only from {+inf, its score} (no slot below the
    candidate: it stays out), row 2 only from {0, 1, 2} (every slot finite)."""
    side = cache.side
    B, H, N = side.heavy_pos.shape
    S, R = side.sinks, cache.config.residual_length
    pos = np.full((B, H, N), -1, np.int32)
    score = np.full((B, H, N), -np.inf, np.float32)
    extra_k, extra_v = np.array(side.extra_k, np.float32), np.array(side.extra_v, np.float32)
    for b in range(B):
        p = int(cache.lengths[b]) - R
        for h in range(H):
            c = N if b % 2 == 0 else int(rng.integers(0, N + 1))
            pos[b, h, :c] = np.sort(rng.choice(np.arange(S, p), c, replace=False))
            draw = {0: [np.inf, float(scores[b, h])], 2: [0.0, 1.0, 2.0]}.get(
                b % 4 if b % 4 == 0 else b, [0.0, 1.0, 2.0, np.inf, float(scores[b, h])]
            )
            score[b, h, :c] = rng.choice(draw, c)
            extra_k[b, h, S + c :] = extra_v[b, h, S + c :] = 0
            extra_k[b, h, S : S + c], extra_v[b, h, S : S + c] = rng.normal(size=(2, c, 64))
    dt = side.extra_k.dtype
    side = dataclasses.replace(
        side, heavy_pos=jnp.asarray(pos), heavy_score=jnp.asarray(score),
        extra_k=jnp.asarray(extra_k, dt), extra_v=jnp.asarray(extra_v, dt),
    )  # fmt: skip
    return dataclasses.replace(cache, side=side)


@pytest.mark.parametrize(
    "interpret",
    [
        pytest.param(True, id="interpreted"),
        pytest.param(False, id="gpu", marks=[pytest.mark.gpu, needs_gpu]),
    ],
)
def test_the_kernel_scores_and_merges_the_leaving_token_as_the_xla_append_does(
    monkeypatch, interpret
):
    # every row's token t - R leaves the window (a candidate) into heavy slots full (even rows)
    # or not, whose scores tie with the candidate's, lie above or below it (rows 0 and 4: none
    # below, so it stays out); a NaN in the key of row 2's candidate, whose full slots are all
    # finite (scored +inf, it enters); one row inactive
    rng = np.random.default_rng(11)
    R, S = MIXED.residual_length, MIXED.sinks
    lengths = R + S + 20 + rng.choice(MAX_LEN - R - S - 21, 8, replace=False)
    cache = _state(MIXED, lengths, 2, 64, MAX_LEN, jnp.bfloat16, rng)
    k_new = jnp.asarray(rng.standard_normal((8, 2, 64)) * 3, jnp.bfloat16)
    v_new = jnp.asarray(rng.standard_normal((8, 2, 64)), jnp.bfloat16)
    active = jnp.asarray(np.arange(8) != 5)
    step = jax.jit(lambda c: kivi_jax.append(c, k_new, v_new, active=active))
    # the candidates' scores: what the XLA append writes into empty slots
    empty = dataclasses.replace(
        cache.side,
        heavy_pos=jnp.full_like(cache.side.heavy_pos, -1),
        heavy_score=jnp.full_like(cache.side.heavy_score, -jnp.inf),
    )  # fmt: skip
    with monkeypatch.context() as m:
        _use_xla_append(m)
        jax.clear_caches()
        scores = step(dataclasses.replace(cache, side=empty)).side.heavy_score[:, :, 0]
    cache = _crafted_heavy_slots(cache, np.asarray(scores), rng)
    leaving = (lengths[2] - R) % R
    cache = dataclasses.replace(cache, k_residual=cache.k_residual.at[2, 1, leaving, 7].set(np.nan))
    want, got = _both_ways(monkeypatch, lambda: step(cache), interpret=interpret)
    _assert_same_state(got, want)
    entered = np.any(np.asarray(want.side.heavy_pos) != np.asarray(cache.side.heavy_pos), axis=2)
    live = np.asarray(active)
    assert entered[live].any() and not entered[live].all()  # candidates entered and stayed out
    assert not entered[[0, 4]].any() and not entered[5].any()
    taken = np.asarray(want.side.heavy_pos)[2, 1] == lengths[2] - R  # the NaN one, kept as +inf
    assert taken.sum() == 1 and np.asarray(want.side.heavy_score)[2, 1][taken][0] == np.inf
