"""Tensor parallelism on 4 host devices (kivi_jax.sharding). Run by tests/test_sharding.py in a
process of its own with XLA_FLAGS=--xla_force_host_platform_device_count=4, so that the rest
of the suite keeps its one device: the pairwise cases there, the full product with -m slow.

Meshes: (model=4) with 8 query / 4 KV heads, (data=2, model=2) and (model=2) with 4 query / 2
KV heads, and (model=4) with 2 KV heads (each replicated over 2 devices); the last two with
Qwen's switches (q/k/v biases, split as w_qkv's columns; q/k norms, replicated).
"""

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from kivi_jax.models import llama
from tiny_model import tiny_params, write_gguf, write_hf_dir

import kivi_jax
from kivi_jax import sharding
from kivi_jax.cache import BATCH_AXIS, kv_head_axis
from kivi_jax.cli import main
from kivi_jax.generate import TokenStream, resolve_kv
from kivi_jax.serving import Engine
from kivi_jax.weights import QuantizedWeight, quantize_weights

if jax.device_count() < 4:
    pytest.fail(
        "tests/sharding_cases.py needs 4 devices: run it through tests/test_sharding.py "
        "(XLA_FLAGS=--xla_force_host_platform_device_count=4)",
        pytrace=False,
    )

KVS = ("full", "kivi2", "kivi4", "kivi2-mix")
MESHES = {  # name: (axis sizes, model heads)
    "model4": ({"model": 4}, dict(num_heads=8, num_kv_heads=4)),
    "data2_model2": ({"data": 2, "model": 2}, {}),
    "model2": ({"model": 2}, dict(qkv_bias=True)),
    "model4_kv_replicated": ({"model": 4}, dict(qkv_bias=True, qk_norm=True)),
}
# In CI each cache kind and each mesh once, through generate or (kivi2 on data=2, model=2) a
# TokenStream, whose compiled decode step's collectives are checked; every pair under -m slow.
PAIRWISE = list(zip(KVS, MESHES, strict=True))
STREAMED = [("kivi2", "data2_model2"), ("full", "model4")]
FULL = [c for c in itertools.product(KVS, MESHES) if c not in PAIRWISE]
PROMPTS = np.random.default_rng(0).integers(3, 200, size=(4, 40))
LENGTHS = np.array([40, 17, 33, 5])  # ragged: right-padded rows
NEW = 12


def make_mesh(name: str) -> Mesh:
    sizes = MESHES[name][0]
    devices = np.asarray(jax.devices()[: int(np.prod(list(sizes.values())))])
    return Mesh(devices.reshape(tuple(sizes.values())), tuple(sizes))


@functools.cache
def params_of(mesh_name: str):
    return tiny_params(**MESHES[mesh_name][1])


@functools.cache
def unsharded_tokens(kv: str, mesh_name: str) -> np.ndarray:
    out = kivi_jax.generate(
        params_of(mesh_name), PROMPTS, lengths=LENGTHS, kv=kv, max_new_tokens=NEW
    )
    return np.asarray(out)


def expected_spec(path, x, mesh: Mesh) -> P:
    axes = [None] * x.ndim
    axes[BATCH_AXIS] = "data" if "data" in mesh.axis_names else None
    if kv_head_axis(path) is not None:
        axes[kv_head_axis(path)] = "model"
    return P(*axes)


def check_generate(kv: str, mesh_name: str):
    mesh = make_mesh(mesh_name)
    params = params_of(mesh_name)
    placed = sharding.shard_params(params, mesh)
    out = kivi_jax.generate(placed, PROMPTS, lengths=LENGTHS, kv=kv, max_new_tokens=NEW)
    # Greedy tokens equal: no near-tie flipped in these cases (the logits are compared below).
    np.testing.assert_array_equal(np.asarray(out), unsharded_tokens(kv, mesh_name))


def check_state_sharding(kv: str, mesh_name: str):
    """Each device holds its own KV heads (and rows, over "data") of every state array."""
    mesh = make_mesh(mesh_name)
    params = params_of(mesh_name)
    placed = sharding.shard_params(params, mesh)
    c = params.config
    caches = sharding.init_cache(
        resolve_kv(kv), mesh=mesh, batch=4, max_len=64 + NEW, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, dtype=jnp.float32, num_layers=c.num_layers,
    )  # fmt: skip
    tokens = jnp.asarray(np.pad(PROMPTS, ((0, 0), (0, 24))), jnp.int32)
    logits, caches = jax.jit(llama.prefill)(placed, tokens, jnp.asarray(LENGTHS), caches)
    want_logits, _ = jax.jit(llama.prefill)(
        params, tokens, jnp.asarray(LENGTHS), kivi_jax.init_cache(
            resolve_kv(kv), batch=4, max_len=64 + NEW, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, dtype=jnp.float32, num_layers=c.num_layers,
        ),
    )  # fmt: skip
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    heads = sharding.kv_heads_on_mesh(c.num_kv_heads, mesh)
    m, d = mesh.shape["model"], dict(mesh.shape).get("data", 1)

    def check(path, x):
        spec = expected_spec(path, x, mesh)
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (path, x.sharding)
        local = list(x.shape)
        local[BATCH_AXIS] //= d
        if kv_head_axis(path) is not None:
            assert x.shape[kv_head_axis(path)] == heads
            local[kv_head_axis(path)] //= m
        assert all(s.data.shape == tuple(local) for s in x.addressable_shards), path

    jax.tree_util.tree_map_with_path(check, caches)


def decode_hlo(kv: str, mesh_name: str) -> str:
    """The compiled decode step of a TokenStream on the mesh (its tokens checked too)."""
    mesh = make_mesh(mesh_name)
    stream = TokenStream(
        params_of(mesh_name), PROMPTS, lengths=LENGTHS, kv=kv, max_new_tokens=NEW, mesh=mesh
    )
    tokens = np.stack(list(stream), axis=1)
    np.testing.assert_array_equal(tokens, unsharded_tokens(kv, mesh_name))
    return stream._step.as_text()


def check_collectives(kv: str, mesh_name: str):
    """One all-reduce of the [rows, d] residual after wo and one after w_down per block, and
    no all-gather (nor any other collective) of the state."""
    hlo = decode_hlo(kv, mesh_name)
    mesh = make_mesh(mesh_name)
    c = params_of(mesh_name).config
    rows = 4 // dict(mesh.shape).get("data", 1)
    reduces = re.findall(r"= f32\[(\d+),(\d+)\]\S* all-reduce(?:-start)?\(", hlo)
    assert reduces.count((str(rows), str(c.hidden_size))) == 2 * c.num_layers, reduces
    assert len(reduces) == 2 * c.num_layers, reduces
    assert not re.search(r"all-gather|all-to-all|collective-permute", hlo)


@pytest.mark.parametrize(("kv", "mesh_name"), [c for c in PAIRWISE if c not in STREAMED])
def test_sharded_generate_equals_unsharded(kv, mesh_name):
    check_generate(kv, mesh_name)


@pytest.mark.parametrize(("kv", "mesh_name"), STREAMED)
def test_stream_equals_unsharded_decode_step_all_reduces_twice_per_block(kv, mesh_name):
    check_collectives(kv, mesh_name)


@pytest.mark.parametrize(("kv", "mesh_name"), [PAIRWISE[1], PAIRWISE[3]])
def test_state_split_over_kv_heads_and_rows(kv, mesh_name):
    check_state_sharding(kv, mesh_name)


@pytest.mark.slow
@pytest.mark.parametrize(("kv", "mesh_name"), FULL)
def test_full_product(kv, mesh_name):
    check_generate(kv, mesh_name)
    check_state_sharding(kv, mesh_name)
    check_collectives(kv, mesh_name)


def test_params_round_trip_and_forward():
    params = params_of("model4_kv_replicated")
    placed = sharding.shard_params(params, make_mesh("model4_kv_replicated"))
    # wk, wv stored twice (2 KV heads on 4 devices): 4 q heads + 2 * 4 kv heads of 32 columns
    assert placed.layers[0].w_qkv.shape == (64, 12 * 32)
    assert placed.layers[0].w_qkv.sharding.spec == P(None, "model")
    back = sharding.unshard_params(placed)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)
    tokens = jnp.asarray(PROMPTS[:, :9], jnp.int32)
    np.testing.assert_allclose(
        llama.forward(placed, tokens), llama.forward(params, tokens), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(NotImplementedError, match="unshard_params"):
        llama.forward_with_qkv(placed, tokens)


def test_saved_model_restored_into_its_shards(tmp_path):
    write_hf_dir(str(tmp_path / "hf"), params_of("model4"))
    model = kivi_jax.load_model(tmp_path / "hf", dtype=jnp.float32)
    kivi_jax.save_model(model, tmp_path / "saved")
    mesh = make_mesh("model4")
    again = kivi_jax.load_model(tmp_path / "saved", dtype=jnp.float32, mesh=mesh)
    assert again.params.mesh == mesh
    w = again.params.layers[1].w_down
    assert w.sharding.spec == P("model", None)
    assert {s.data.shape for s in w.addressable_shards} == {(96 // 4, 64)}
    back = sharding.unshard_params(again.params)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)
    # Saved from the mesh: the ordinary order again.
    kivi_jax.save_model(again, tmp_path / "from_mesh")
    third = kivi_jax.load_model(tmp_path / "from_mesh", dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(third.params), strict=True):
        np.testing.assert_array_equal(a, b)


@functools.cache
def quantized_params(bits: int, group_size: int = 16):
    """The tiny model (untied: its output projection quantized too) with int8 or int4 weights;
    int4's groups of 16 rows divide over (model=2): 96 / 2 = 48 rows of w_down a shard."""
    return quantize_weights(tiny_params(tie_embeddings=False), bits=bits, group_size=group_size)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_weights_on_a_mesh_answer_as_one_device(bits):
    """The same quantized weights, split over (model=2): w_qkv, w_gate_up by columns (their
    scales and zero points alike), wo, w_down by rows with int4's group scales split along
    (int8's per-channel scales replicated); greedy tokens equal the one-device ones."""
    params, mesh = quantized_params(bits), make_mesh("model2")
    placed = sharding.shard_params(params, mesh)
    w = placed.layers[0].w_down
    assert isinstance(w, QuantizedWeight) and w.qvalue.sharding.spec == P("model", None)
    assert w.scale.sharding.spec == (P() if bits == 8 else P("model", None))
    assert placed.layers[0].w_qkv.scale.sharding.spec == P(None, "model")
    out = kivi_jax.generate(placed, PROMPTS, lengths=LENGTHS, kv="kivi2", max_new_tokens=NEW)
    want = kivi_jax.generate(params, PROMPTS, lengths=LENGTHS, kv="kivi2", max_new_tokens=NEW)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    back = sharding.unshard_params(placed)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)


def test_quantized_groups_must_divide_over_the_model_axis():
    # w_down [96, 64] in groups of 32 rows: a shard of (model=2) would take 48 rows, 1.5 groups
    with pytest.raises(ValueError, match=r"layers\[0\]\.w_down is quantized in groups of 32 "
                       r"input rows.*each shard's 48 rows must be whole groups"):  # fmt: skip
        sharding.shard_params(quantized_params(4, group_size=32), make_mesh("model2"))


def test_saved_quantized_model_restored_into_its_shards(tmp_path):
    write_hf_dir(str(tmp_path / "hf"), tiny_params(tie_embeddings=False))
    model = kivi_jax.load_model(
        tmp_path / "hf", dtype=jnp.float32, weights="int4", weight_group_size=16
    )
    kivi_jax.save_model(model, tmp_path / "saved")
    mesh = make_mesh("model2")
    again = kivi_jax.load_model(tmp_path / "saved", dtype=jnp.float32, mesh=mesh)
    assert again.params.mesh == mesh
    w = again.params.layers[1].w_down
    assert isinstance(w, QuantizedWeight) and w.qvalue.dtype == jnp.int4
    assert {s.data.shape for s in w.scale.addressable_shards} == {(48 // 16, 64)}
    back = sharding.unshard_params(again.params)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)
    # A float model restored on the mesh, then quantized there: the same weights, in shards.
    kivi_jax.save_model(kivi_jax.load_model(tmp_path / "hf", dtype=jnp.float32), tmp_path / "float")
    third = kivi_jax.load_model(
        tmp_path / "float", dtype=jnp.float32, mesh=mesh, weights="int4", weight_group_size=16
    )
    want = sharding.param_sharding(third.params, mesh)
    for x, s in zip(jax.tree.leaves(third.params), jax.tree.leaves(want), strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim), (x.shape, x.sharding, s)
    back = sharding.unshard_params(third.params)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)


ENGINE_REQUESTS = {"a": (20, 9), "long": (40, 8), "b": (5, 6)}  # name: (prompt, new tokens)
ENGINE_PROGRAMS = {
    f"jit({name})"
    for name in (
        "prefill_batch",
        "prefill_chunk",
        "empty_row",
        "insert_row",
        "reset",
        "decode",
    )
}
compiled: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, fun_name="?", **_: (
        compiled.append(fun_name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
)


def run_engine(params, mesh):
    """Warmup, then three requests on two slots (the third reuses a slot), the long one
    prefilled in two chunks of 32, with none of the engine's programs compiled after warmup;
    returns the engine and each request's tokens."""
    e = Engine(params, kv="kivi2", slots=2, max_len=64, prefill_chunk=32, decode_steps=4,
               mesh=mesh)  # fmt: skip
    e.warmup()  # every program compiled ahead (kivi-serve's start), none run
    before = len(compiled)
    handles = {
        name: e.submit(PROMPTS[i, :n].tolist(), max_new_tokens=new)
        for i, (name, (n, new)) in enumerate(ENGINE_REQUESTS.items())
    }
    while e.step():
        pass
    assert not ENGINE_PROGRAMS & set(compiled[before:]), ENGINE_PROGRAMS & set(compiled[before:])
    return e, {name: h.result() for name, h in handles.items()}


@pytest.mark.parametrize(
    "mesh_name", ["data2_model2", pytest.param("model4_kv_replicated", marks=pytest.mark.slow)]
)
def test_engine_on_a_mesh_answers_as_one_device_with_its_state_split(mesh_name):
    """Each request's greedy tokens equal the one-device engine's, and the slots' state, its
    other arrays and the prefill scratch stay in their shards (KV heads over "model", slots
    over "data") through inserts, chunks, decode calls and resets."""
    mesh = make_mesh(mesh_name)
    params = params_of(mesh_name)
    e, got = run_engine(params, mesh)
    assert e.params.mesh == mesh
    assert got == run_engine(params, None)[1]

    def check(path, x):
        spec = expected_spec(path, x, mesh)
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (path, x.sharding)

    jax.tree_util.tree_map_with_path(check, e._state.caches)
    rows = "data" if "data" in mesh.axis_names else None
    for x in jax.tree.leaves(dataclasses.replace(e._state, caches=())):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, P(rows)), x.ndim), x.sharding
    for x in jax.tree.leaves(e._scratch):
        want = NamedSharding(mesh, P(rows, None, "model", None))
        assert x.sharding.is_equivalent_to(want, x.ndim), x.sharding
    if "data" in mesh.axis_names:
        with pytest.raises(ValueError, match="batch of 3 rows is not divisible by the 'data'"):
            Engine(params, slots=3, max_len=64, mesh=mesh)


def test_kivi_serve_tensor_parallel_serves_an_engine_on_the_mesh(tmp_path, monkeypatch, capsys):
    from kivi_jax.serving import server

    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, params_of("model2"))
    apps = []
    monkeypatch.setattr(server, "create_app", lambda engine, *a, **kw: apps.append(engine))
    monkeypatch.setattr(server, "serve", lambda app, sock, **kw: sock.close() or 0)
    argv = ["--model", path, "--max-len", "64", "--slots", "2", "--port", "0",
            "--no-compilation-cache"]  # fmt: skip
    assert server.main([*argv, "--tensor-parallel", "2"]) == 0
    (engine,) = apps
    assert engine.mesh.shape == {"model": 2} and engine.params.mesh == engine.mesh
    assert server.main([*argv, "--tensor-parallel", "3"]) == 2  # 4 query heads on 3 devices
    err = capsys.readouterr().err
    assert err.startswith("kivi-serve: error: ")
    assert "4 query heads are not divisible by the 'model' axis of 3" in err


def bad_meshes():
    d = jax.devices()
    tiny = tiny_params().config  # 4 query heads, 2 KV heads, MLP width 96
    return [
        (Mesh(np.asarray(d[:2]), ("x",)), tiny, 4, "needs a 'model' axis"),
        (Mesh(np.asarray(d[:4]).reshape(2, 2), ("model", "pipe")), tiny, 4, r"\['pipe'\]"),
        (Mesh(np.asarray(d[:3]), ("model",)), tiny, 3, "4 query heads are not divisible"),
        (
            Mesh(np.asarray(d[:4]), ("model",)),
            tiny_params(num_heads=12, num_kv_heads=6).config,
            4,
            "6 KV heads are not divisible",
        ),
        (
            Mesh(np.asarray(d[:4]), ("model",)),
            tiny_params(intermediate_size=90).config,
            4,
            "MLP width 90",
        ),
        (
            Mesh(np.asarray(d[:4]).reshape(2, 2), ("data", "model")),
            tiny,
            3,
            "batch of 3 rows is not divisible by the 'data' axis",
        ),
    ]


@pytest.mark.parametrize("case", range(6))
def test_bad_mesh_raises_before_anything_runs(case):
    mesh, config, batch, message = bad_meshes()[case]
    with pytest.raises(ValueError, match=message):
        sharding.check_mesh(mesh, config, batch)
    params = jax.eval_shape(lambda: llama.init_params(config, jax.random.key(0)))
    with pytest.raises(ValueError, match=message):  # shape-only params: nothing could run
        kivi_jax.generate(params, PROMPTS[:batch], kv="kivi2", max_new_tokens=2, mesh=mesh)


def test_mesh_type_and_mismatch_errors():
    with pytest.raises(TypeError, match=r"jax\.sharding\.Mesh"):
        sharding.check_mesh("model=4", tiny_params().config)
    placed = sharding.shard_params(params_of("model2"), make_mesh("model2"))
    with pytest.raises(ValueError, match="differs from the mesh the params are placed on"):
        kivi_jax.generate(placed, PROMPTS, kv="kivi2", max_new_tokens=2, mesh=make_mesh("model4"))


def test_cli_tensor_parallel_answers_as_one_device(tmp_path, capsys):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, params_of("model2"))
    argv = ["the theme", "--model", path, "--kv", "kivi2", "--max-new-tokens", "6"]
    assert main(argv) == 0
    one = capsys.readouterr().out
    assert main([*argv, "--tensor-parallel", "2"]) == 0
    out, err = capsys.readouterr()
    assert out == one
    assert "split over 2 devices" in err
    assert main([*argv, "--tensor-parallel", "3"]) == 2  # 4 query heads on 3 devices
    assert "4 query heads are not divisible by the 'model' axis of 3" in capsys.readouterr().err
