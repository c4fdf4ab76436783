"""Quantized weights (kivi_jax.weights): the formats' invariant on hand-computed and random
matrices, the model on quantized weights, GGUF's Q8_0 / Q4_0 / Q4_1 kept as stored, saved
models, and the decode step reading the quantized arrays."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kivi_jax.models import llama
from tiny_model import tiny_params, write_gguf, write_hf_dir

import kivi_jax
from kivi_jax.weights import (
    QuantizedWeight,
    dequantize,
    group_for,
    quantize_matrix,
    quantize_weights,
    weights_label,
)


def quant(name: str):
    """A GGUF tensor type: the gguf package is imported by the GGUF tests only (the GPU
    machine has none; the GPU test below needs none)."""
    return pytest.importorskip("gguf").GGMLQuantizationType[name]


TOKENS = jnp.asarray([[5, 40, 41, 100, 7, 260, 3, 9, 77, 12, 13, 14]], jnp.int32)
LINEAR = ("w_qkv", "wo", "w_gate_up", "w_down")


def test_int8_hand_computed():
    # column 0: max |w| = 2.54 -> scale 0.02, q = [127, -64, 0]; column 1 all zero -> q 0, scale 1
    w = jnp.asarray([[2.54, 0.0], [-1.28, 0.0], [0.0, 0.0]], jnp.float32)
    qw = quantize_matrix(w, bits=8)
    np.testing.assert_array_equal(qw.qvalue, [[127, 0], [-64, 0], [0, 0]])
    np.testing.assert_allclose(qw.scale, [[0.02, 1.0]], rtol=1e-6)
    assert qw.zero_point is None and qw.qvalue.dtype == jnp.int8
    np.testing.assert_allclose(dequantize(qw), w, atol=1e-6)


def test_int4_hand_computed():
    # one group of 4 rows per column: column 0 spans [-1, 2] -> scale 0.2, zero 5 (stored -3),
    # q = round(w / 0.2 + 5) - 8 = [-8, 7, -3, -1]; column 1 constant 3 -> scale 1, zero -3
    w = jnp.asarray([[-1.0, 3.0], [2.0, 3.0], [0.0, 3.0], [0.4, 3.0]], jnp.float32)
    qw = quantize_matrix(w, bits=4, group_size=4)
    assert qw.qvalue.dtype == jnp.int4
    np.testing.assert_array_equal(
        qw.qvalue.astype(jnp.int8), [[-8, -8], [7, -8], [-3, -8], [-1, -8]]
    )
    np.testing.assert_allclose(qw.scale, [[0.2, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(qw.zero_point, [[-3.0, -11.0]], rtol=1e-6)
    np.testing.assert_allclose(dequantize(qw), w, atol=1e-6)


@pytest.mark.parametrize("width, group_size, group", [(576, 128, 96), (1536, 128, 128), (7, 4, 1)])
def test_group_is_the_largest_divisor_not_above_the_group_size(width, group_size, group):
    assert group_for(width, group_size) == group


@pytest.mark.parametrize("bits, group_size", [(8, 128), (4, 128), (4, 32)])
def test_random_matrix_within_half_a_step(rng, bits, group_size):
    w = jnp.asarray(rng.normal(size=(576, 96)), jnp.float32)
    qw = quantize_matrix(w, bits=bits, group_size=group_size)
    g = 576 if bits == 8 else group_for(576, group_size)
    assert qw.scale.shape == (576 // g, 96) and qw.group == g
    step = np.repeat(np.asarray(qw.scale), g, axis=0)
    assert np.all(np.abs(np.asarray(dequantize(qw)) - np.asarray(w)) <= step / 2 * 1.0001)


def test_bad_arguments():
    w = jnp.ones((64, 8), jnp.float32)
    with pytest.raises(ValueError, match="bits must be 8 or 4, got 3"):
        quantize_matrix(w, bits=3)
    with pytest.raises(ValueError, match="group_size must be a positive int, got 0"):
        quantize_weights(tiny_params(), bits=4, group_size=0)
    with pytest.raises(TypeError, match="already hold quantized weights"):
        quantize_weights(quantize_weights(tiny_params(), bits=8), bits=4)
    with pytest.raises(IndexError, match="column slices"):
        quantize_matrix(w, bits=8)[1:, :]


@pytest.mark.parametrize("bits", [4])  # int8 end to end: test_generate_cli_with_int8_weights
def test_model_on_quantized_weights(bits):
    params = tiny_params(tie_embeddings=False)
    q = quantize_weights(params, bits=bits, group_size=32)
    assert weights_label(q) == f"int{bits}" and isinstance(q.lm_head, QuantizedWeight)
    assert llama.param_bytes(q) < llama.param_bytes(params) * (0.5 if bits == 8 else 0.35)
    # the fused matrices' parts are the parts quantized (scales per column)
    lw, lq = params.layers[0], q.layers[0]
    for name in ("wq", "wk", "wv", "w_gate", "w_up"):
        part = quantize_matrix(getattr(lw, name), bits=bits, group_size=32)
        np.testing.assert_array_equal(getattr(lq, name).qvalue, part.qvalue)
    # the same model as its dequantized weights (the matmul is dequantize-then-dot)
    deq = jax.tree.map(dequantize, q, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    np.testing.assert_allclose(
        kivi_jax.forward(q, TOKENS), kivi_jax.forward(deq, TOKENS), atol=1e-5, rtol=1e-5
    )
    assert q.astype(jnp.bfloat16).layers[0].wo.qvalue.dtype == lq.wo.qvalue.dtype


@pytest.mark.parametrize(
    "kind, qtype", [("Q8_0", jnp.int8), ("Q4_0", jnp.int4), ("Q4_1", jnp.int4)]
)
def test_gguf_blocks_kept_as_stored(tmp_path, kind, qtype):
    path = str(tmp_path / f"{kind}.gguf")
    write_gguf(path, tiny_params(), quant=quant(kind))
    stored = kivi_jax.load_model(path, dtype=jnp.float32, weights="gguf").params
    floats = kivi_jax.load_model(path, dtype=jnp.float32).params  # gguf's own dequantization
    assert weights_label(stored) == jnp.dtype(qtype).name
    assert stored.embed.dtype == jnp.float32  # embeddings are dequantized (a Q8_0 here)
    for lq, lf in zip(stored.layers, floats.layers, strict=True):
        for name in LINEAR:
            w = getattr(lq, name)
            assert w.qvalue.dtype == qtype and w.group == 32
            np.testing.assert_allclose(dequantize(w), getattr(lf, name), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(
        kivi_jax.forward(stored, TOKENS), kivi_jax.forward(floats, TOKENS), atol=1e-5, rtol=1e-5
    )


def test_gguf_float_tensors_stay_float(tmp_path):
    path = str(tmp_path / "f32.gguf")
    write_gguf(path, tiny_params())
    params = kivi_jax.load_model(path, dtype=jnp.float32, weights="gguf").params
    assert weights_label(params) == "float"


@pytest.mark.parametrize("weights", ["int4", "gguf"])
def test_saved_quantized_model_round_trip(tmp_path, weights):
    src = str(tmp_path / "tiny.gguf")
    write_gguf(src, tiny_params(tie_embeddings=False), quant=quant("Q4_1"))
    model = kivi_jax.load_model(src, dtype=jnp.float32, weights=weights)
    kivi_jax.save_model(model, tmp_path / "saved")
    again = kivi_jax.load_model(tmp_path / "saved", dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(model.params), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert weights_label(again.params) == "int4"
    with pytest.raises(TypeError, match="already hold quantized weights"):
        kivi_jax.load_model(tmp_path / "saved", weights="int8")


def test_load_model_weights_errors(tmp_path):
    with pytest.raises(ValueError, match="weights must be one of"):
        kivi_jax.load_model(tmp_path, weights="int2")
    write_hf_dir(str(tmp_path / "hf"), tiny_params())
    with pytest.raises(ValueError, match='weights="gguf" keeps a GGUF file'):
        kivi_jax.load_model(tmp_path / "hf", weights="gguf")


def test_generate_cli_with_int8_weights(tmp_path, capsys):
    from kivi_jax.cli import main

    path = str(tmp_path / "q.gguf")
    write_gguf(path, tiny_params(), quant=quant("Q4_1"))
    args = ["the tent", "--model", path, "--max-new-tokens", "3", "--no-chat"]
    assert main([*args, "--weights", "int8"]) == 0
    assert "float32, int8 weights" in capsys.readouterr().err
    write_hf_dir(str(tmp_path / "hf"), tiny_params())
    assert main(["the tent", "--model", str(tmp_path / "hf"), "--weights", "gguf"]) == 2
    assert 'weights="gguf" keeps a GGUF file' in capsys.readouterr().err


# ----------------------------------------------------------------------------- the decode step


def _step_inputs(params, kv=None):
    c = params.config
    caches = kivi_jax.init_cache(
        kv, batch=1, max_len=64, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        dtype=jnp.float32, num_layers=c.num_layers,
    )  # fmt: skip
    return params, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), caches


def test_decode_step_takes_the_quantized_arrays():
    params = quantize_weights(tiny_params(), bits=4, group_size=32)
    jaxpr = jax.make_jaxpr(llama.decode_step)(*_step_inputs(params, kivi_jax.KIVI2))
    inputs = [(tuple(v.aval.shape), v.aval.dtype) for v in jaxpr.jaxpr.invars]
    for lw in params.layers:
        for name in LINEAR:
            w = getattr(lw, name)
            assert (w.shape, jnp.dtype(jnp.int4)) in inputs
            assert (w.shape, jnp.dtype(jnp.float32)) not in inputs  # no float copy passed in


_SCRATCH = """
import jax, jax.numpy as jnp, kivi_jax
from kivi_jax.models import llama
from kivi_jax.models.config import LlamaConfig
from kivi_jax.weights import quantize_weights
c = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=64, rope_theta=1e4, rms_eps=1e-5, tie_embeddings=True,
                max_context=64)
params = quantize_weights(llama.init_params(c, jax.random.key(0)), bits=4)
caches = kivi_jax.init_cache(None, batch=1, max_len=64, num_kv_heads=2, head_dim=64,
                             dtype=jnp.float32, num_layers=3)
zeros = jnp.zeros((1,), jnp.int32)
memory = jax.jit(llama.decode_step).lower(params, zeros, zeros, caches).compile().memory_analysis()
largest = 256 * 1024 * 4  # one block's w_gate_up [256, 2 * 512] in float32
everything = 3 * (256 * 512 + 256 * 256 + 256 * 1024 + 512 * 256) * 4
assert largest <= memory.temp_size_in_bytes <= largest + 64 * 1024, memory.temp_size_in_bytes
assert memory.temp_size_in_bytes < everything / 4
"""


def test_decode_step_scratch_is_one_matrix_on_the_cpu():
    # XLA's CPU scheduler must be the memory-first one (xla_cpu_enable_concurrency_optimized_
    # scheduler=false, docs/weights.md): its default runs every layer's dequantization at the
    # start of the step. The flag is read when the backend starts, hence a fresh process.
    flags = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    )
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    script = textwrap.dedent(_SCRATCH)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("batch, kernel", [(8, "quantized_matmul"), (1, "quantized_gemv")])
@pytest.mark.parametrize("bits", [8, 4])
def test_decode_step_reads_the_quantized_weights_in_the_kernel_on_the_gpu(bits, batch, kernel):
    """No full-precision copy of a weight per step: every linear layer runs a fused kernel
    (pallas_kernels/matmul: the small-M one at batch 1), the compiled step's scratch is far
    below its smallest dequantized matrix beside the widest layer's float32 split-K partial
    sums, and no fusion outputs a bf16 weight."""
    import re

    from kivi_jax.models.config import LlamaConfig
    from kivi_jax.pallas_kernels.matmul.gpu import default_tiling

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    c = LlamaConfig(vocab_size=4096, hidden_size=2048, intermediate_size=8192, num_layers=2,
                    num_heads=16, num_kv_heads=4, head_dim=128, rope_theta=5e5, rms_eps=1e-5,
                    tie_embeddings=False, max_context=512)  # fmt: skip
    params = quantize_weights(llama.init_params(c, jax.random.key(0), jnp.bfloat16), bits=bits)
    caches = kivi_jax.init_cache(
        kivi_jax.KIVI2, batch=batch, max_len=512, num_kv_heads=4, head_dim=128,
        dtype=jnp.bfloat16, num_layers=2,
    )  # fmt: skip
    zeros = jnp.zeros((batch,), jnp.int32)
    compiled = jax.jit(llama.decode_step).lower(params, zeros, zeros, caches).compile()
    smallest = 2048 * 2048 * 2  # wo [N*D, d] in bfloat16
    # The tensor-core kernel's partial sums of w_gate_up [2048, 16384]: [splits, 16 rows, N]
    # float32 (batch 8 padded to the MMA's 16 rows); the small-M kernel's are smaller.
    partials = default_tiling(2048, 16384, 2048 if bits == 8 else 128).splits * 16 * 16384 * 4
    assert compiled.memory_analysis().temp_size_in_bytes < partials + smallest / 4
    shapes = {f"bf16[{a},{b}]" for a, b in [(2048, 3072), (2048, 2048), (2048, 16384),
                                             (8192, 2048), (2048, 4096)]}  # fmt: skip
    text = compiled.as_text()
    assert text.count(kernel) >= 2 * 4 + 1  # 4 linear layers a block + lm_head
    entry = text.split("\nENTRY", 1)[1]
    for line in entry.splitlines():
        m = re.match(r"\s*%\S+ = (bf16\[[0-9,]+\])", line)
        assert not (m and m.group(1) in shapes and "parameter(" not in line), line


def test_int4_of_a_gguf_keeps_its_block_grid_by_default(tmp_path):
    """load_model(weights="int4") of a GGUF re-quantizes in its blocks' width (32): Q4_1 blocks
    come back on their own grid (to float32 rounding), where groups of 128 would round each
    weight a second time."""
    path = str(tmp_path / "Q4_1.gguf")
    write_gguf(path, tiny_params(), quant=quant("Q4_1"))
    floats = kivi_jax.load_model(path, dtype=jnp.float32).params
    int4 = kivi_jax.load_model(path, dtype=jnp.float32, weights="int4").params
    coarse = kivi_jax.load_model(path, dtype=jnp.float32, weights="int4", weight_group_size=128)
    coarse = coarse.params
    for lq, lc, lf in zip(int4.layers, coarse.layers, floats.layers, strict=True):
        for name in LINEAR:
            w, f = getattr(lq, name), getattr(lf, name)
            assert w.group == 32
            np.testing.assert_allclose(dequantize(w), f, atol=1e-5, rtol=1e-5)
            assert getattr(lc, name).group > 32
            assert float(jnp.max(jnp.abs(dequantize(getattr(lc, name)) - f))) > 1e-3
