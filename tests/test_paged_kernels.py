"""Decode attention through a page table (kivi_jax.paged.decode_attention): the GPU kernels with
the table as an operand (each tile's page id loaded in the kernel), in interpret mode, against
the reference on the gathered view (tolerance: tests/test_decode_attention_kernel.py's).

States are real (prompts prefilled, then appends: conftest.streamed_cache), cut into pages in a
random order over a pool with spare pages: the first page of the last row that has pages is
the first such row's (shared), the empty row has none, NO_PAGE past each row's length.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches_reference, streamed_cache, triton_modules
from kivi_jax.pallas_kernels.decode_attention import GpuTuning, gpu, tpu

import kivi_jax
from kivi_jax import paged

MAX_LEN = 256


def paged_case(rng, *, k_bits, v_bits, D, n_rep, dtype, page_size, H=2, R=64,
               prompts=(147, 0, 94, 200), steps=3, max_len=MAX_LEN):  # fmt: skip
    """(q, a paged state): by default rows of 150, 0, 97 and 203 tokens (after 3 appends)."""
    cfg = kivi_jax.KiviConfig(k_bits=k_bits, v_bits=v_bits, group_size=32, residual_length=R)
    prompts = list(prompts)
    cache = streamed_cache(rng, config=cfg, H=H, D=D, max_len=max_len, prompts=prompts,
                           steps=steps, dtype=dtype)  # fmt: skip
    lengths = np.asarray(cache.lengths)
    need = [-(-int(n) // page_size) for n in lengths]
    order = iter(rng.permutation(sum(need) + 2))
    table = np.full((len(prompts), -(-max_len // page_size)), paged.NO_PAGE, np.int32)
    for b, n in enumerate(need):
        table[b, :n] = [next(order) for _ in range(n)]
    holders = [b for b, n in enumerate(need) if n]
    table[holders[-1], 0] = table[holders[0], 0]  # shared: the last row's tokens (put last)
    state = paged.init_paged(cfg, batch=len(prompts), pages=sum(need) + 2, page_size=page_size,
                             max_len=max_len, num_kv_heads=H, head_dim=D, dtype=dtype)  # fmt: skip
    state = dataclasses.replace(state, table=jnp.asarray(table))
    for b in range(len(prompts)):
        state = paged.put_sequence(state, jax.tree.map(lambda x, b=b: x[b : b + 1], cache), b)
    q = jnp.asarray(rng.normal(size=(len(prompts), H * n_rep, D)).astype(np.float32), dtype)
    return q, state


CC = GpuTuning(gqa_scores="cuda_cores", gqa_values="cuda_cores")


@pytest.mark.parametrize(
    ("k_bits", "v_bits", "D", "n_rep", "dtype", "page_size", "tuning"),
    [
        (2, 2, 64, 1, jnp.bfloat16, 64, GpuTuning()),  # MHA; pages smaller than a value tile
        (4, 4, 64, 4, jnp.float16, 128, GpuTuning()),  # GQA: the tensor-core kernels
        (2, 4, 128, 2, jnp.bfloat16, 64, CC),  # GQA on the CUDA-core kernels
    ],
)
def test_paged_kernels_match_the_reference_on_the_view_interpret(
    rng, k_bits, v_bits, D, n_rep, dtype, page_size, tuning
):
    q, state = paged_case(rng, k_bits=k_bits, v_bits=v_bits, D=D, n_rep=n_rep, dtype=dtype,
                          page_size=page_size)  # fmt: skip
    out = gpu.decode_attention_pallas_paged(q, state, interpret=True, tuning=tuning)
    assert_matches_reference(out, q, paged.view(state))


def test_pallas_reads_the_pool_through_the_table_not_a_view(rng):
    q, state = paged_case(rng, k_bits=2, v_bits=2, D=64, n_rep=4, dtype=jnp.bfloat16,
                          page_size=64)  # fmt: skip
    run = lambda q, s: paged.decode_attention(q, s, impl="pallas", interpret=True)
    jaxpr = jax.make_jaxpr(run)(q, state).jaxpr
    assert "kivi_scores_mma_paged" in str(jaxpr) and "kivi_values_mma_paged" in str(jaxpr)
    assert "gather" not in set(outside_kernels(jaxpr))  # no view gathered


def outside_kernels(jaxpr):
    """The primitives of `jaxpr` and its sub-jaxprs, not looking into the Pallas kernels."""
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from outside_kernels(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from outside_kernels(sub)


def test_a_mixed_state_is_named_where_the_paged_kernels_do_not_read_it():
    cfg = dataclasses.replace(kivi_jax.KIVI2_MIX, residual_length=64)
    state = paged.init_paged(cfg, batch=1, pages=2, page_size=64, max_len=128, num_kv_heads=2,
                             head_dim=64, dtype=jnp.bfloat16)  # fmt: skip
    q = jnp.zeros((1, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="kivi2-mix"):
        gpu.decode_attention_pallas_paged(q, state, interpret=True)


def abstract_paged_kivi2(B, H, D, ps, M):
    """The shapes of a bfloat16 KIVI-2 (G 32, R 128) PagedCache of B rows of M pages of ps
    tokens, B * M pages in the pool (nothing allocated: for lowering only)."""
    cfg = kivi_jax.KiviConfig(group_size=32, residual_length=128)
    return jax.eval_shape(lambda: paged.init_paged(
        cfg, batch=B, pages=B * M, page_size=ps, max_len=M * ps, num_kv_heads=H, head_dim=D,
        dtype=jnp.bfloat16,
    ))  # fmt: skip


@pytest.mark.parametrize(("n_rep", "tuning"), [(1, GpuTuning()), (4, GpuTuning()), (4, CC)])
def test_paged_kernels_lower_to_triton(monkeypatch, n_rep, tuning):
    # for CUDA, on the CPU: the table loaded in the kernels, the pool's pages indexed by it
    B, H, D, ps, M = 2, 2, 64, 128, 4
    state = abstract_paged_kivi2(B, H, D, ps, M)
    q = jax.ShapeDtypeStruct((B, H * n_rep, D), jnp.bfloat16)
    run = lambda q, s: gpu.decode_attention_pallas_paged(q, s, tuning=tuning)
    names = set(triton_modules(monkeypatch, run, q, state))
    kind = "_mma" if n_rep > 1 and tuning == GpuTuning() else ""
    assert {f"kivi_scores{kind}_paged", f"kivi_values{kind}_paged"} <= {
        n.split("_stages")[0] for n in names
    }


def test_a_paged_decode_step_on_a_gpu_gathers_no_view():
    # one layer's step (the append through the table, then the paged attention) as a GPU runs
    # it (benchmarks/decode_ops.py: traced with the dispatch seeing a GPU, lowered for CUDA):
    # its gathers are the two pages of each row that the append writes, and table entries:
    # each at most 2 / M of the view's largest array (M = 8 pages a row)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import decode_ops

    B, H, D, ps, M = 2, 2, 64, 64, 8
    state = jax.eval_shape(lambda: paged.init_paged(
        kivi_jax.KiviConfig(residual_length=64), batch=B, pages=B * M, page_size=ps,
        max_len=M * ps, num_kv_heads=H, head_dim=D, dtype=jnp.bfloat16,
    ))  # fmt: skip
    x = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)

    def step(state, q, k, v):
        state = paged.append(state, k, v, q=q)
        return paged.decode_attention(q, state), state

    with decode_ops._as_on_a_gpu():
        text = jax.jit(step, donate_argnums=0).trace(state, x(B, 2 * H, D), x(B, H, D),
                                                     x(B, H, D))  # fmt: skip
        text = text.lower(lowering_platforms=("cuda",)).as_text()
    assert "kivi_scores_mma_paged" in text and "kivi_values_mma_paged" in text
    largest_view = B * H * (M * ps // 4) * D  # k_codes [B, H, C / kpb, D], 2 bits
    gathers = re.findall(r"stablehlo\.gather.*-> tensor<([0-9x]+)x[a-z0-9]+>", text)
    assert gathers
    for shape in gathers:
        assert np.prod([int(n) for n in shape.split("x")]) * M // 2 <= largest_view, shape


def test_the_tpu_kernel_reads_the_table_as_a_scalar_prefetch_operand_interpret(rng):
    # TPU interpret mode (unused memory NaN): pages of 512 tokens, one block of one chunk each;
    # rows of 0, 131 (one quantized value) and 603 tokens (the key tail [384, 512) ends a
    # chunk; past a page)
    import test_decode_attention_tpu as tpu_tests

    q, state = paged_case(rng, k_bits=2, v_bits=4, D=64, n_rep=2, dtype=jnp.bfloat16,
                          page_size=512, R=128, prompts=(0, 131, 603), steps=0,
                          max_len=1024)  # fmt: skip
    run = lambda q, s: paged.decode_attention(q, s, impl="pallas_tpu", interpret=True)
    assert "kivi_decode_tpu_paged" in str(jax.make_jaxpr(run)(q, state))
    tpu_tests._check(q, paged.view(state), attend=lambda q, _: run(q, state))


@pytest.mark.parametrize(("n_rep", "D", "ps"), [(1, 128, 2048), (4, 64, 2048), (1, 128, 1536)])
def test_the_paged_tpu_kernel_lowers_for_tpu(n_rep, D, ps):
    # Pallas's TPU lowering (block shapes against the tiling, the index maps reading the
    # table from SMEM) accepts it: one Mosaic custom call, at 8 rows of 16 pages of 2048 (and
    # of 1536: three chunks a page, blocks of one chunk)
    B, H, M = 8, 2, 16
    state = abstract_paged_kivi2(B, H, D, ps, M)
    q = jax.ShapeDtypeStruct((B, H * n_rep, D), jnp.bfloat16)
    run = lambda q, s: tpu.decode_attention_pallas_tpu_paged(q, s)
    hlo = jax.jit(run).trace(q, state).lower(lowering_platforms=("tpu",)).as_text()
    assert hlo.count("tpu_custom_call") == 1
