"""kivi_jax.sharding: the column order on one device here; everything that needs several devices
runs in tests/sharding_cases.py, in a process with 4 host devices (the rest of the suite keeps
one device)."""

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from tiny_model import tiny_config, tiny_params

from kivi_jax import sharding
from kivi_jax.generate import TokenStream

TESTS = Path(__file__).parent


def run_cases(markexpr: str) -> None:
    """tests/sharding_cases.py under pytest with 4 host devices; fails with its output."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", markexpr]
    cmd.append(str(TESTS / "sharding_cases.py"))
    done = subprocess.run(
        cmd, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=1200
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and "passed" in summary and "skipped" not in summary, (
        done.stdout[-6000:] + done.stderr[-3000:]
    )


def test_multi_device_cases():
    """Sharded generate equals unsharded for each cache kind and each mesh once (pairwise),
    the state's shardings, the decode step's collectives, restore into shards, bad meshes."""
    run_cases("not slow")


@pytest.mark.slow
def test_multi_device_cases_full_product(request):
    if "slow" not in request.config.getoption("markexpr"):
        pytest.skip("every cache kind on every mesh: run with `pytest -m slow`")
    run_cases("slow")


def test_qkv_columns_are_per_shard_contiguous():
    # 4 query heads, 2 KV heads of width 1 on 2 devices: ordinary columns q0 q1 q2 q3 k0 k1 v0 v1
    # (0..7); shard 0 takes q0 q1 k0 v0, shard 1 q2 q3 k1 v1.
    c = tiny_config(num_heads=4, num_kv_heads=2, head_dim=2)
    cols = sharding._qkv_columns(c, 2).reshape(-1, 2)[:, 0] // 2  # one entry per head
    np.testing.assert_array_equal(cols, [0, 1, 4, 6, 2, 3, 5, 7])
    # On 4 devices each KV head is read by 2 devices: k0 v0, k0 v0, k1 v1, k1 v1.
    cols = sharding._qkv_columns(c, 4).reshape(-1, 2)[:, 0] // 2
    np.testing.assert_array_equal(cols, [0, 4, 6, 1, 4, 6, 2, 5, 7, 3, 5, 7])
    # One device: the ordinary order.
    np.testing.assert_array_equal(sharding._qkv_columns(c, 1), np.arange(16))


def test_gate_up_columns_are_per_shard_contiguous():
    c = tiny_config(intermediate_size=4)  # gate 0..3, up 4..7
    np.testing.assert_array_equal(sharding._gate_up_columns(c, 2), [0, 1, 4, 5, 2, 3, 6, 7])


def test_one_device_mesh_keeps_every_weight_in_place():
    params = tiny_params()
    placed = sharding.shard_params(params, Mesh(np.asarray(jax.devices()[:1]), ("model",)))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(placed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert sharding.shard_config(params.config, placed.mesh) == params.config


def test_one_device_mesh_compiles_the_one_device_decode_step():
    """Same operations (no all-reduce of one device), so the same speed."""
    params, mesh = tiny_params(), Mesh(np.asarray(jax.devices()[:1]), ("model",))
    prompts = np.random.default_rng(0).integers(3, 200, (2, 40))

    def ops(mesh):
        stream = TokenStream(params, prompts, kv="kivi2", max_new_tokens=4, mesh=mesh)
        return collections.Counter(re.findall(r"= \S+ ([a-z\-]+)\(", stream._step.as_text()))

    assert ops(mesh) == ops(None)


def test_scaling_table_follows_from_the_memory_accounting():
    sys.path.insert(0, str(TESTS.parent / "benchmarks"))
    import scaling_table as st

    c = st.MODELS["Llama-3-70B"]
    d, f, v, layers = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_layers
    whole = 2 * (2 * v * d + d + layers * 2 * d)  # bf16 embedding, output, norms
    split = 2 * layers * (d * (64 + 2 * 8) * 128 + 64 * 128 * d + 3 * d * f)  # q/k/v, wo, MLP
    for n in st.DEVICES:
        assert st.weight_bytes_per_device(c, n) == whole + split // n
    # bf16 cache: 1024 tokens x 2 (k, v) x 128 channels x 2 bytes per KV head and layer; the
    # 8 KV heads split over the devices.
    assert st.cache_bytes_per_1k_tokens(c, "full", 4) == 1024 * 2 * 128 * 2 * layers * 2
    # A row's bf16 state for 4096 tokens, plus 5 bytes of counters (lengths, overflow) a layer.
    assert st.row_bytes(c, "full", 8, 4096) == layers * (4096 * 2 * 128 * 2 + 5)
    # KIVI-2 holds 1k tokens in about a quarter of bf16 (2-bit codes, scales, the window).
    assert 0.2 < st.cache_bytes_per_1k_tokens(c, "kivi2", 1) / (1024 * 2 * 128 * 2 * 80 * 8) < 0.3
    rows = st.table()
    full_8 = next(r for r in rows if r["model"] == "Llama-3-70B" and r["devices"] == 8)
    left = st.SHARE * st.CARD_GB * 1e9 - st.weight_bytes_per_device(c, 8)
    assert full_8["max_batch_4k"] == int(left // st.row_bytes(c, "full", 8, 4096))
    # docs/scaling.md quotes the committed table: it is what the script prints now.
    committed = TESTS.parent / "benchmarks" / "results" / "scaling_table.json"
    assert json.loads(committed.read_text()) == json.loads(json.dumps(rows))
