"""kivi_jax.paged: the pool of pages and the page table read and written as the contiguous state.

Rows are written into pages of a random order, two rows share the pages of a common sealed
prefix, one row holds no page; the view, the reference attention and every append step then
equal the contiguous cache's, bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax import cache as cache_lib
from kivi_jax import paged
from kivi_jax.attention import decode_attention_reference
from kivi_jax.cache import append, dequantize, init_cache, prefill
from kivi_jax.config import KIVI2_MIX, Format, KiviConfig, Selection

H, D, N = 2, 32, 4  # kv heads, head_dim, query heads
PS, MAX_LEN = 64, 256  # page size, max_len (4 pages a row)
CONFIGS = {
    "kivi2": KiviConfig(residual_length=32),
    "kivi4-8bit": KiviConfig(
        k_bits=4,
        v_bits=4,
        residual_length=32,
        k_scale_format=Format.E4M3,
        residual_format=Format.INT8,
    ),
    "mix-error": dataclasses.replace(KIVI2_MIX, residual_length=32, selection=Selection.ERROR),
    "full": None,
}


def tables(lengths, rng, pages, full):
    """Each row's pages for max_len tokens, in a random order over the pool; row 1 takes row
    0's first two pages (their common prefix); a KIVI row of fewer than G tokens (all in its
    ring, no key group complete) takes none."""
    order = iter(rng.permutation(pages))
    table = np.full((len(lengths), MAX_LEN // PS), paged.NO_PAGE, np.int32)
    for b, n in enumerate(lengths):
        if full or n >= 32:
            table[b] = [next(order) for _ in range(MAX_LEN // PS)]
    table[1, :2] = table[0, :2]
    return table


@pytest.mark.parametrize("kind", ["kivi2", "full"])
def test_pages_in_any_order_read_and_append_as_the_contiguous_state(kind):
    check_paged_equals_contiguous(CONFIGS[kind])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kivi4-8bit", "mix-error"])
def test_other_formats_and_a_mixed_state_page_alike(kind, slow_only):
    check_paged_equals_contiguous(CONFIGS[kind])


def check_paged_equals_contiguous(cfg):
    rng = np.random.default_rng(0)
    lengths = [185, 165, 20]  # rows 0 and 1 share tokens [0, 128): sealed (128 + R <= 165)
    k, v = (rng.standard_normal((3, 185, H, D)).astype(np.float32) for _ in range(2))
    k[1, :128], v[1, :128] = k[0, :128], v[0, :128]
    q = rng.standard_normal((3, 185, N, D)).astype(np.float32)
    kw = dict(num_kv_heads=H, head_dim=D, dtype=jnp.float32)
    flat = prefill(init_cache(cfg, batch=3, max_len=MAX_LEN, **kw), k, v, jnp.array(lengths), q=q)

    state = paged.init_paged(cfg, batch=3, pages=12, page_size=PS, max_len=MAX_LEN, **kw)
    state = dataclasses.replace(state, table=jnp.asarray(tables(lengths, rng, 12, cfg is None)))
    for b, n in enumerate(lengths):
        one = prefill(init_cache(cfg, batch=1, max_len=MAX_LEN, **kw), k[b : b + 1, :n],
                      v[b : b + 1, :n], q=q[b : b + 1, :n])  # fmt: skip
        state = paged.put_sequence(state, one, b)

    @jax.jit
    def step(state, flat, qs, ks, vs, active):
        """Both states' attention before the step, then both appended."""
        before = paged.decode_attention_reference(qs, state), decode_attention_reference(qs, flat)
        state = paged.append(state, ks, vs, active, q=qs)
        seen = paged.view(state)
        return state, seen, append(flat, ks, vs, active, q=qs), before

    active = jnp.array([True, True, True])
    for i in range(16):  # row 0 crosses a page and flushes; row 1's values leave page 2
        if i == 10:
            active = jnp.array([True, True, False])  # row 2 stays without pages
        qs = jnp.asarray(rng.standard_normal((3, N, D)), jnp.float32)
        ks, vs = (jnp.asarray(rng.standard_normal((3, H, D)), jnp.float32) for _ in range(2))
        state, seen, flat, (got, want) = step(state, flat, qs, ks, vs, active)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert not np.asarray(state.rows.overflow).any()
    for a, b in zip(dequantize(seen), dequantize(flat), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(seen), jax.tree.leaves(paged.view(state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a row taken out as its contiguous state and put back into other pages reads the same
    moved = dataclasses.replace(state, table=state.table[jnp.array([1, 0, 2])])
    moved = paged.put_sequence(moved, paged.sequence(state, 0), 1)
    for a, b in zip(dequantize(paged.view(moved)), dequantize(flat), strict=True):
        np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b)[0])
    np.testing.assert_array_equal(np.asarray(state.rows.lengths), [201, 181, 30])


def test_a_write_without_its_page_sets_the_rows_overflow():
    cfg = CONFIGS["kivi2"]
    kw = dict(num_kv_heads=H, head_dim=D, dtype=jnp.float32)
    state = paged.init_paged(cfg, batch=1, pages=1, page_size=PS, max_len=MAX_LEN, **kw)
    one = prefill(init_cache(cfg, batch=1, max_len=MAX_LEN, **kw), jnp.ones((1, 63, H, D)),
                  jnp.ones((1, 63, H, D)))  # fmt: skip
    table = jnp.array([[0, paged.NO_PAGE, paged.NO_PAGE, paged.NO_PAGE]], jnp.int32)
    state = paged.put_sequence(dataclasses.replace(state, table=table), one, 0)  # [0, 64): page 0
    step = jax.jit(lambda s: paged.append(s, jnp.ones((1, H, D)), jnp.ones((1, H, D))))
    state = step(state)  # token 63 completes the group [32, 64), in page 0
    assert not state.rows.overflow[0]
    for _ in range(32):  # tokens 64..95: the group [64, 96) has no page
        state = step(state)
    assert state.rows.overflow[0]


def test_page_size_must_hold_whole_flushes():
    with pytest.raises(ValueError, match="multiple of the residual length R=128"):
        paged.init_paged(KiviConfig(), batch=1, pages=1, page_size=96, max_len=256,
                         num_kv_heads=H, head_dim=D)  # fmt: skip


def random_paged(cfg, lengths, *, seed, dtype=jnp.float32, heads=H, head_dim=D, page_size=PS,
                 max_len=MAX_LEN, pages=12):  # fmt: skip
    """A paged state of random contents (codes, scales, rings: every array read) whose table
    gives each row its pages for its length in a random order over the pool, row 1 sharing
    row 0's first page; a KIVI row of fewer than G tokens (all in its ring) takes none;
    NO_PAGE past each row's length."""
    rng = np.random.default_rng(seed)
    kw = dict(num_kv_heads=heads, head_dim=head_dim, dtype=dtype)
    state = paged.init_paged(cfg, batch=len(lengths), pages=pages, page_size=page_size,
                             max_len=max_len, **kw)  # fmt: skip

    def fill(x):
        if x.dtype == jnp.uint8:
            return jnp.asarray(rng.integers(0, 256, x.shape), jnp.uint8)
        if x.dtype in (jnp.int32, jnp.bool_):  # lengths, overflow: set below
            return x
        return jnp.asarray(rng.standard_normal(x.shape), x.dtype)

    order = iter(rng.permutation(pages))
    table = np.full((len(lengths), state.max_pages), paged.NO_PAGE, np.int32)
    for b, n in enumerate(lengths):
        if cfg is None or n >= 32:
            table[b, : -(-n // page_size)] = [next(order) for _ in range(-(-n // page_size))]
    table[1, 0] = table[0, 0]
    rows = jax.tree.map(fill, state.rows)
    rows = dataclasses.replace(rows, lengths=jnp.asarray(lengths, jnp.int32))
    return dataclasses.replace(state, rows=rows, pages=jax.tree.map(fill, state.pages),
                               table=jnp.asarray(table))  # fmt: skip


@pytest.mark.parametrize("kind", ["kivi2", "kivi4-8bit", "full", "mix-error"])
@pytest.mark.parametrize("window", [None, 70])
def test_paged_reference_reads_page_by_page_as_the_reference_reads_the_view(kind, window):
    # lengths: two pages and a half (row 0), a row sharing row 0's first page, a row whose
    # tokens are all in its ring (no page), an empty row, one ending on a page boundary
    state = random_paged(CONFIGS[kind], [185, 165, 20, 0, 128], seed=1)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((5, N, D)), jnp.float32)
    got = paged.decode_attention(q, state, impl="reference", window=window)
    want = decode_attention_reference(q, paged.view(state), window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got)[3], 0.0)


@pytest.mark.parametrize("kind", ["kivi2", "full"])
def test_append_writes_two_pages_a_row_as_the_whole_view_would(kind):
    # rows on both sides of page and flush boundaries (page 64, R = G = 32), one at max_len - 1
    # (its second step is past max_len), one without pages; the rows outgrow their pages
    # (writes dropped, overflow set) on both paths alike
    state = random_paged(CONFIGS[kind], [63, 64, 95, 96, 255, 20], seed=3)
    rng = np.random.default_rng(4)
    paged_step = jax.jit(paged.append)
    view_step = jax.jit(lambda s, k, v, a: paged._append_through_view(s, k, v, a, q=None)[0])
    by_view = state
    for _step in range(40):
        k, v = (jnp.asarray(rng.standard_normal((6, H, D)), jnp.float32) for _ in range(2))
        active = jnp.asarray(rng.random(6) < 0.9)
        state, by_view = paged_step(state, k, v, active), view_step(by_view, k, v, active)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(by_view), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(state.rows.overflow)[4]  # a step past max_len


@pytest.mark.parametrize(
    ("k_bits", "v_bits", "group_size", "page_size"), [(2, 2, 32, 64), (4, 2, 16, 32)]
)
def test_the_append_kernel_writes_the_pool_in_place_as_the_two_page_append_does(
    monkeypatch, k_bits, v_bits, group_size, page_size
):
    # the GPU path (pallas_kernels/append/gpu.py through the table, interpreted here) against
    # the two-page XLA path: rows crossing page and group boundaries, a row past max_len, rows
    # outgrowing their pages (writes dropped), inactive rows. Rows 0 and 1 share a sealed page
    # (the two paths differ where two rows write one page: the XLA path puts back whole pages)
    cfg = KiviConfig(k_bits=k_bits, v_bits=v_bits, group_size=group_size, residual_length=32)
    state = random_paged(cfg, [200, 180, 95, 96, 255, 20], seed=3, page_size=page_size,
                         pages=4 * MAX_LEN // page_size)  # fmt: skip
    rng = np.random.default_rng(4)
    steps = [
        (*(jnp.asarray(rng.standard_normal((6, H, D)), jnp.float32) for _ in range(2)),
         jnp.asarray(rng.random(6) < 0.9))
        for _ in range(40)
    ]  # fmt: skip

    def run():
        step, s = jax.jit(paged.append), state
        for k, v, active in steps:
            s = step(s, k, v, active)
        return s

    want, traced = run(), []

    def in_place(*args):
        traced.append(1)
        return kernel_path(*args, interpret=True)

    kernel_path = paged._append_in_place
    with monkeypatch.context() as m:
        m.setattr(cache_lib, "_append_kernel_applies", cache_lib._append_kernel_supports)
        m.setattr(paged, "_append_in_place", in_place)
        jax.clear_caches()  # the path is chosen when the step is traced
        got = run()
    jax.clear_caches()
    assert traced, "the kernel was not used"
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(got.rows.overflow)[[4, 5]].all()  # past max_len; row 5 without pages
