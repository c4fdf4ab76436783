"""The KV state as a pool of pages and a page table per sequence (the serving engine's layout).

A `PagedCache` holds one layer's state of B sequences in two parts, plus the table that joins
them. P pages of `page_size` (ps) tokens, M = max_pages pages per sequence at most:

    rows    a Cache of batch B: every per-sequence array that has no token axis (the rings,
            lengths, overflow, a mixed state's sinks, heavy tokens and ring scores); the
            fields with a token axis are None here
    pages   a Cache of batch P holding only the fields with a token axis, each page ps tokens
            of one sequence: e.g. k_codes [P, H, ps // kpb, D], k_scale [P, H, ps // G, D],
            v_codes [P, H, ps, D // vpb] (kivi_jax.cache's layout with the batch axis read as
            pages and the capacity as ps; its static fields those of `rows`); the other
            fields are None
    table   int32 [B, M]: table[b, m] is the page holding tokens [m * ps, (m + 1) * ps) of
            sequence b, NO_PAGE where it has none

The fields with a token axis are found from the layout itself (`token_axes`: the axes whose
size follows the capacity in init_cache), so any array a cache format keeps per token is paged
without a change here. One page id indexes every such array of a layer (codes, scales, zeros,
a mixed state's fine channels) and the same page id in every layer.

`view` is the contiguous Cache the pages represent (the table gathered: capacity M * ps, a
missing page reading as zeros). `decode_attention` reads through the table (the reference page
by page, the GPU kernels and the TPU kernel with the table as an operand) and `append` writes
what a step writes (plain KIVI on a GPU: the append kernel through the table, in place; a
full-precision state: its token's entry; else the two pages a step can reach); a mixed state
(sinks and heavy tokens are sequence positions) and what the kernels do not take read the
view. A page must be in the table before a write lands in it: an append whose quantized
tokens reach a token without its page sets the row's overflow flag (the write is dropped),
as a write past max_len does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import cache as cache_lib
from kivi_jax.cache import Cache, FullCache, KiviCache, init_cache
from kivi_jax.config import KiviConfig

NO_PAGE = np.iinfo(np.int32).max  # a table entry without a page (read as zeros, writes dropped)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["rows", "pages", "table"],
    meta_fields=["page_size", "token_axes"],
)
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """One layer's KV state as pages (module doc). token_axes: (key path of a field with a
    token axis, that axis), from `token_axes`."""

    rows: Cache
    pages: Cache
    table: jax.Array  # int32 [B, M]
    page_size: int
    token_axes: tuple[tuple[str, int], ...]

    @property
    def num_pages(self) -> int:
        return jax.tree.leaves(self.pages)[0].shape[0]

    @property
    def max_pages(self) -> int:
        return self.table.shape[1]


def _key(path) -> str:
    return jax.tree_util.keystr(path)


def token_axes(cache: Cache) -> tuple[tuple[str, int], ...]:
    """(key path, token axis) of every array of `cache`'s kind that holds tokens by position:
    the arrays whose shape follows the capacity (init_cache at two capacities, shapes only)."""
    config = cache.config if isinstance(cache, KiviCache) else None
    unit = 1 if config is None else config.group_size  # a capacity is a multiple of G

    def shapes(max_len):
        make = lambda: init_cache(config, batch=1, max_len=max_len, num_kv_heads=cache.num_kv_heads,
                                  head_dim=cache.head_dim, dtype=cache.dtype)  # fmt: skip
        flat, _ = jax.tree_util.tree_flatten_with_path(jax.eval_shape(make))
        return {_key(p): x.shape for p, x in flat}

    small, big = shapes(unit), shapes(2 * unit)
    axes = []
    for name, shape in small.items():
        moved = [a for a, (s, b) in enumerate(zip(shape, big[name], strict=True)) if s != b]
        if moved:
            (axis,) = moved
            axes.append((name, axis))
    return tuple(axes)


def check_page_size(cache: Cache, page_size: int) -> None:
    """Raises unless a page of `page_size` tokens holds whole flushes: a multiple of R (and so
    of G) for a KiviCache, any positive size for a FullCache."""
    if not isinstance(page_size, int | np.integer) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if isinstance(cache, KiviCache) and page_size % cache.config.residual_length:
        raise ValueError(
            f"page_size={page_size} must be a multiple of the residual length "
            f"R={cache.config.residual_length} (keys flush R tokens at a time)"
        )


DEFAULT_PAGE_SIZE = 128  # tokens, rounded up to a multiple of a KIVI state's R


def default_page_size(config: KiviConfig | None) -> int:
    """DEFAULT_PAGE_SIZE rounded up to a multiple of `config`'s residual length R (a page holds
    whole flushes: check_page_size); DEFAULT_PAGE_SIZE for a full-precision state (None)."""
    r = 1 if config is None else config.residual_length
    return -(-DEFAULT_PAGE_SIZE // r) * r


def max_pages(max_len: int, page_size: int) -> int:
    """Pages a sequence of max_len tokens may hold."""
    return -(-max_len // page_size)


def split(cache: Cache, axes) -> tuple[Cache, Cache]:
    """(the arrays without a token axis, those with one), each in `cache`'s structure with
    None in place of the other part's arrays."""
    names = dict(axes)
    keep = lambda token: lambda path, x: x if (_key(path) in names) == token else None
    rows = jax.tree_util.tree_map_with_path(keep(False), cache)
    return rows, jax.tree_util.tree_map_with_path(keep(True), cache)


def merge(a: Cache, b: Cache) -> Cache:
    """The arrays of `a` and `b` (split's two parts) as one Cache."""
    return jax.tree.map(lambda x, y: y if x is None else x, a, b, is_leaf=lambda x: x is None)


def init_paged(
    config, *, batch: int, pages: int, page_size: int, max_len: int, num_kv_heads: int,
    head_dim: int, dtype=jnp.bfloat16, num_layers: int | None = None,
) -> PagedCache | tuple[PagedCache, ...]:  # fmt: skip
    """An empty paged state: `batch` sequences of up to `max_len` tokens, `pages` pages of
    `page_size` tokens, every table entry NO_PAGE (init_cache's arguments otherwise)."""
    kw = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    template = jax.eval_shape(lambda: init_cache(config, batch=1, max_len=page_size, **kw))
    check_page_size(template, page_size)
    axes = token_axes(template)
    m = max_pages(max_len, page_size)

    def one():
        rows, _ = split(init_cache(config, batch=batch, max_len=max_len, **kw), axes)
        _, pool = split(init_cache(config, batch=pages, max_len=page_size, **kw), axes)
        pool = dataclasses.replace(pool, max_len=max_len)  # the static fields of the rows'
        table = jnp.full((batch, m), NO_PAGE, jnp.int32)
        return PagedCache(rows=rows, pages=pool, table=table, page_size=page_size, token_axes=axes)

    return one() if num_layers is None else tuple(one() for _ in range(num_layers))


def view(paged: PagedCache) -> Cache:
    """The contiguous Cache the pages represent: every token-axis array gathered through the
    table, capacity max_pages * page_size (a missing page reads as zeros)."""
    axes = dict(paged.token_axes)

    def gather(path, x):  # x [P, ..., E, ...] (E at axis a) -> [B, ..., M * E, ...]
        a = axes[_key(path)]
        g = jnp.take(x, paged.table, axis=0, mode="fill", fill_value=0)  # [B, M, ...]
        g = jnp.moveaxis(g, 1, a)  # [B, ..., M, E, ...]
        return g.reshape(*g.shape[:a], g.shape[a] * g.shape[a + 1], *g.shape[a + 2 :])

    return merge(paged.rows, jax.tree_util.tree_map_with_path(gather, paged.pages))


def _as_pages(x: jax.Array, a: int, entries: int) -> jax.Array:
    """x [B, ..., M * entries, ...] (token axis a) -> [B, M, ..., entries, ...]."""
    x = x.reshape(*x.shape[:a], x.shape[a] // entries, entries, *x.shape[a + 1 :])
    return jnp.moveaxis(x, a, 1)


def _put_pages(paged: PagedCache, tokens: Cache, ids: jax.Array, at: jax.Array) -> Cache:
    """The pool with the pages `at` [B, J] (table positions) of `tokens` (split's token part of
    a contiguous Cache of B rows, capacity a multiple of page_size) written at page ids
    `ids` [B, J] (NO_PAGE: dropped)."""
    axes = dict(paged.token_axes)

    def put(path, pool, x):
        a = axes[_key(path)]
        pages = _as_pages(x, a, pool.shape[a])  # [B, M, ...]
        at_ = at.reshape(*at.shape, *(1,) * (pages.ndim - 2))
        chosen = jnp.take_along_axis(pages, at_, axis=1)  # [B, J, ...]
        flat = chosen.reshape(-1, *chosen.shape[2:])
        return pool.at[ids.reshape(-1)].set(flat.astype(pool.dtype), mode="drop")

    return jax.tree_util.tree_map_with_path(put, paged.pages, tokens)


def _extent(cache: Cache) -> jax.Array:
    """[B]: the tokens whose token-axis entries the arrays hold: a KiviCache's complete key
    groups, [0, l - l % G) (values are quantized only up to l - R), a FullCache's l."""
    n = cache.lengths
    if isinstance(cache, FullCache):
        return n
    return n - n % cache.config.group_size


def append(paged: PagedCache, k: jax.Array, v: jax.Array, active=None, *, q=None) -> PagedCache:
    """kivi_jax.cache.append through the table (same arguments; the paged state after the
    step, bit for bit the pages and rows of the contiguous state's). One step writes tokens
    in [l - R, l] only (the value leaving the window, l - R, and a key group completed at l,
    R <= page_size; a full-precision state token l), which lie in the two pages from the one
    holding token max(l - R, 0). A full-precision state writes its token's entry alone; plain
    KIVI on a GPU runs the append kernel, which writes the pool in place through the table;
    elsewhere (and where the kernel does not apply) the append runs on those two pages of each
    row and writes them back (a mixed state, whose sinks and heavy tokens are sequence
    positions, on the whole view: `reads_by_page`)."""
    if not reads_by_page(paged):
        return _append_through_view(paged, k, v, active, q=q)[0]
    n, ps, cap = paged.rows.lengths, paged.page_size, paged.rows.max_len
    r = paged.rows.config.residual_length if isinstance(paged.rows, KiviCache) else 0
    wanted = jnp.ones(n.shape, bool) if active is None else jnp.asarray(active)
    if wanted.shape != n.shape or wanted.dtype != jnp.bool_:
        raise ValueError(
            f"append: active must be bools of shape {n.shape}, got "
            f"{wanted.dtype}{list(wanted.shape)}"
        )
    fits = wanted & (n < cap)
    if not isinstance(fits, jax.core.Tracer) and not bool(jnp.all(fits == wanted)):
        bad = np.flatnonzero(np.asarray(wanted & ~fits))
        raise ValueError(
            f"cache capacity exceeded: max_len={cap}, but rows {bad.tolist()} would hold "
            f"{(np.asarray(n)[bad] + 1).tolist()} tokens"
        )
    if isinstance(paged.rows, FullCache):
        return _flag_missing(_append_token(paged, k, v, fits), wanted & ~fits)
    if cache_lib._append_kernel_applies(paged.rows):
        return _flag_missing(_append_in_place(paged, k, v, fits), wanted & ~fits)
    first = jnp.maximum(n - r, 0) // ps  # [B] the window's first table column
    cols = first[:, None] + jnp.arange(2)  # [B, 2]
    ids = jnp.take_along_axis(paged.table, cols, axis=1, mode="fill", fill_value=NO_PAGE)
    window = view(dataclasses.replace(paged, table=ids))  # [B] rows of two pages
    base = first * ps
    window = dataclasses.replace(window, lengths=n - base, max_len=2 * ps)
    out = cache_lib.append(window, k, v, fits, q=q)
    out = dataclasses.replace(out, lengths=out.lengths + base, max_len=cap)
    rows, tokens = split(out, paged.token_axes)
    pages = _put_pages(paged, tokens, ids, jnp.broadcast_to(jnp.arange(2), ids.shape))
    return _flag_missing(dataclasses.replace(paged, rows=rows, pages=pages), wanted & ~fits)


def _append_token(paged: PagedCache, k, v, fits) -> PagedCache:
    """A FullCache's step: each fitting row's token l written into its page, the one entry
    (dropped where the table holds no page)."""
    n, ps = paged.rows.lengths, paged.page_size
    column = jnp.take_along_axis(paged.table, (n // ps)[:, None], axis=1, mode="fill",
                                 fill_value=NO_PAGE)[:, 0]  # fmt: skip
    page = jnp.where(fits, column, NO_PAGE)  # [B]

    def put(pool, x):  # pool [P, ps, H, D] <- x [B, H, D] at (page, l % ps)
        return pool.at[page, n % ps].set(x.astype(pool.dtype), mode="drop")

    pages = dataclasses.replace(paged.pages, k=put(paged.pages.k, k), v=put(paged.pages.v, v))
    rows = dataclasses.replace(paged.rows, lengths=n + fits.astype(n.dtype))
    return dataclasses.replace(paged, rows=rows, pages=pages)


def _append_in_place(paged: PagedCache, k, v, fits, *, interpret: bool = False) -> PagedCache:
    """A plain KIVI state's step by the append kernel (pallas_kernels/append/gpu.py), which
    writes the pool through the table in place: no page gathered or written back."""
    from kivi_jax.pallas_kernels.append.gpu import append_kernel

    rows, pool, cfg = paged.rows, paged.pages, paged.rows.config
    k, v = (cache_lib.entering_tokens(cfg, x, rows.dtype) for x in (k, v))
    names = cache_lib._APPEND_FIELDS
    arrays = [getattr(rows if getattr(pool, f) is None else pool, f) for f in names]
    out = dict(zip(names, append_kernel(
        *arrays, rows.lengths, fits.astype(jnp.int32), k, v, table=paged.table,
        k_bits=cfg.k_bits, v_bits=cfg.v_bits, group_size=cfg.group_size,
        residual_length=cfg.residual_length, interpret=interpret,
    ), strict=True))  # fmt: skip
    held = {f: out[f] for f in names if getattr(pool, f) is not None}
    ring = {f: out[f] for f in names if f not in held}
    rows = dataclasses.replace(rows, **ring, lengths=rows.lengths + fits.astype(jnp.int32))
    return dataclasses.replace(paged, rows=rows, pages=dataclasses.replace(pool, **held))


def _flag_missing(paged: PagedCache, dropped: jax.Array) -> PagedCache:
    """`paged` with the overflow flag set on the rows whose step was `dropped` (past max_len)
    or whose last complete key group (a full-precision state: last token) has no page."""
    rows = paged.rows
    extent = _extent(rows)
    last = jnp.maximum(extent - 1, 0) // paged.page_size
    page_of_last = jnp.take_along_axis(paged.table, last[:, None], axis=1)[:, 0]
    missing = (extent > 0) & (page_of_last == NO_PAGE)
    return dataclasses.replace(
        paged, rows=dataclasses.replace(rows, overflow=rows.overflow | dropped | missing)
    )


def _append_through_view(paged: PagedCache, k, v, active, *, q) -> tuple[PagedCache, Cache]:
    """`append` on the whole contiguous view, the two pages a step can write (those of tokens
    l - 1 - R and l - 1 after it) put back through the table -> (the paged state, the view
    after the step)."""
    cache = cache_lib.append(view(paged), k, v, active, q=q)
    n, ps = cache.lengths, paged.page_size
    r = cache.config.residual_length if isinstance(cache, KiviCache) else 0
    at = jnp.stack([jnp.maximum(n - 1 - r, 0) // ps, jnp.maximum(n - 1, 0) // ps], axis=1)
    rows, tokens = split(cache, paged.token_axes)
    ids = jnp.take_along_axis(paged.table, at, axis=1)  # [B, 2]
    out = dataclasses.replace(paged, rows=rows, pages=_put_pages(paged, tokens, ids, at))
    out = _flag_missing(out, jnp.zeros_like(rows.overflow))
    return out, merge(out.rows, tokens)


def append_and_attend(
    paged: PagedCache, q: jax.Array, k: jax.Array, v: jax.Array, active=None, *,
    window: int | None = None,
) -> tuple[PagedCache, jax.Array]:  # fmt: skip
    """One layer's decode step through the table: `append` (this step's k, v [B, H, D]),
    then `decode_attention` of q [B, Nq, D] over the state holding them -> (the paged state,
    the attention [B, Nq, D]). A mixed state, read through the view, gathers it once: its
    append's view is what kivi_jax.attention.decode_attention reads."""
    if reads_by_page(paged):
        out = append(paged, k, v, active, q=q)
        return out, decode_attention(q, out, window=window)
    from kivi_jax.attention import decode_attention as contiguous

    out, held = _append_through_view(paged, k, v, active, q=q)
    return out, contiguous(q, held, window=window)


def put_sequence(paged: PagedCache, cache: Cache, row) -> PagedCache:
    """One sequence's contiguous state (`cache`, batch 1, any capacity up to max_pages *
    page_size) into row `row`: its per-row arrays, and its token-axis arrays' pages through the
    row's table entries (NO_PAGE entries dropped). The table is the caller's: it already holds
    the row's pages."""
    axes = dict(paged.token_axes)
    rows, tokens = split(cache, paged.token_axes)
    m = paged.max_pages

    def pad(path, x):  # the token axis padded to max_pages pages
        a, pool = axes[_key(path)], _leaf(paged.pages, path)
        width = [(0, m * pool.shape[a] - x.shape[a]) if i == a else (0, 0) for i in range(x.ndim)]
        return jnp.pad(x, width)

    tokens = jax.tree_util.tree_map_with_path(pad, tokens)
    ids = jax.lax.dynamic_slice_in_dim(paged.table, row, 1, axis=0)  # [1, M]
    pool = _put_pages(paged, tokens, ids, jnp.arange(m, dtype=jnp.int32)[None])
    put = lambda big, small: jax.lax.dynamic_update_slice_in_dim(
        big, small.astype(big.dtype), row, axis=cache_lib.BATCH_AXIS
    )
    return dataclasses.replace(paged, rows=jax.tree.map(put, paged.rows, rows), pages=pool)


def sequence(paged: PagedCache, row) -> Cache:
    """Row `row`'s contiguous state (batch 1, capacity max_pages * page_size): what
    put_sequence takes back."""
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1, axis=0)
    one = dataclasses.replace(paged, rows=jax.tree.map(take, paged.rows), table=take(paged.table))
    return view(one)


def _leaf(tree, path):
    for p in path:
        tree = getattr(tree, p.name)
    return tree


def decode_attention_reference(q: jax.Array, paged: PagedCache, window: int | None = None):
    """kivi_jax.attention.decode_attention_reference over the pages: the table gathered into
    the contiguous view, then the reference (same arguments and result). What the paged
    attention (`decode_attention`) is tested against."""
    from kivi_jax.attention import decode_attention_reference as reference

    return reference(q, view(paged), window)


def reads_by_page(paged: PagedCache) -> bool:
    """Whether a page's tokens can be read on their own, knowing only the row's length: a
    FullCache, or plain KIVI (a ring slot t % R, page_size a multiple of R). A mixed state's
    sinks and heavy tokens are positions in the whole sequence: it is read through the view."""
    return not (isinstance(paged.rows, KiviCache) and paged.rows.side is not None)


def page(paged: PagedCache, m) -> Cache:
    """Table column m as a contiguous Cache of page_size tokens, its token i each row's token
    m * page_size + i (lengths less m * page_size, so a row's rings and masks read as they do
    in the view; a missing page reads as zeros). Only where `reads_by_page`."""
    ids = jax.lax.dynamic_index_in_dim(paged.table, m, axis=1, keepdims=False)  # [B]
    take = lambda x: jnp.take(x, ids, axis=0, mode="fill", fill_value=0)
    rows = dataclasses.replace(paged.rows, lengths=paged.rows.lengths - m * paged.page_size)
    return dataclasses.replace(merge(rows, jax.tree.map(take, paged.pages)),
                               max_len=paged.page_size)  # fmt: skip


def _attention_by_pages(q: jax.Array, paged: PagedCache, window: int | None) -> jax.Array:
    """The reference read page by page: each table column's logits and values
    (`kivi_jax.attention.masked_logits` of `page`), merged by an online softmax in float32; no
    contiguous view. Equals the reference up to float32 rounding (the order of the sums)."""
    from kivi_jax.attention import check_decode_inputs, masked_logits

    b, _, d = q.shape
    first = page(paged, 0)
    rep, h = check_decode_inputs(q, first), first.num_kv_heads
    hi = jax.lax.Precision.HIGHEST

    def step(carry, m):
        top, total, acc = carry  # [B, H, rep, 1], [B, H, rep, 1], [B, H, rep, D]
        s, held, v = masked_logits(q, page(paged, m), window)  # [B, H, rep, ps], v [B, H, ps, D]
        new = jnp.maximum(top, jnp.max(s, axis=-1, keepdims=True))
        base = jnp.where(jnp.isfinite(new), new, 0.0)
        p = jnp.where(held, jnp.exp(s - base), 0.0)
        keep = jnp.exp(top - base)  # 0 while top is -inf
        total = total * keep + jnp.sum(p, axis=-1, keepdims=True)
        acc = acc * keep + jnp.einsum("bhrt,bhtd->bhrd", p, v, precision=hi)
        return (new, total, acc), None

    init = (jnp.full((b, h, rep, 1), -jnp.inf, jnp.float32), jnp.zeros((b, h, rep, 1), jnp.float32),
            jnp.zeros((b, h, rep, d), jnp.float32))  # fmt: skip
    (_, total, acc), _ = jax.lax.scan(step, init, jnp.arange(paged.max_pages))
    out = acc / jnp.where(total > 0, total, 1.0)
    return out.reshape(q.shape).astype(q.dtype)


def decode_attention(
    q: jax.Array,
    paged: PagedCache,
    *,
    impl: str = "auto",
    interpret: bool = False,
    window: int | None = None,
) -> jax.Array:
    """kivi_jax.attention.decode_attention over a PagedCache (same arguments, `impl` names and
    result), reading through the table where the implementation can:

      "reference"   plain jnp page by page (`_attention_by_pages`; no contiguous view); a mixed
                    state on the view (`reads_by_page`)
      "pallas"      the GPU kernels with the table as an operand, each tile's page id loaded
                    in the kernel (`gpu.decode_attention_pallas_paged`); a mixed state
                    (kivi2-mix): the contiguous kernels on the view
      "pallas_tpu"  the TPU kernel with the table as a scalar-prefetch operand
                    (`tpu.decode_attention_pallas_tpu_paged`: plain KIVI, page_size a
                    multiple of its chunk, 512 tokens at G = 32); otherwise the contiguous
                    TPU kernel on the view
      "auto"        on a GPU "pallas" where the kernels support the state, cuDNN on the view
                    for a bfloat16/float16 FullCache; on a TPU "pallas_tpu" where it reads
                    through the table, else as kivi_jax.attention does on the view; else
                    "reference". A window: "reference".
    """
    from kivi_jax.attention import IMPLEMENTATIONS, cudnn_unsupported_reason
    from kivi_jax.attention import decode_attention as contiguous

    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    backend = jax.default_backend()
    if impl == "auto":
        impl = "reference" if window is not None or backend not in ("gpu", "tpu") else impl
    if impl == "reference":
        if reads_by_page(paged):
            return _attention_by_pages(q, paged, window)
        return decode_attention_reference(q, paged, window)
    from kivi_jax.pallas_kernels.decode_attention import gpu, tpu

    by_table = window is None and reads_by_page(paged)
    if impl == "pallas" and by_table and isinstance(paged.rows, KiviCache):
        if not interpret and backend != "gpu":
            raise NotImplementedError(
                f"impl='pallas': the fused kernel runs on a CUDA GPU (backend here: {backend}); "
                "pass interpret=True to run it on the CPU"
            )
        return gpu.decode_attention_pallas_paged(q, paged, interpret=interpret)
    tpu_paged = by_table and isinstance(paged.rows, KiviCache)
    if impl == "pallas_tpu" and tpu_paged and tpu.unsupported_paged_reason(q, paged) is None:
        if not interpret and backend != "tpu":
            raise NotImplementedError(
                f"impl='pallas_tpu': the fused kernel runs on a TPU (backend here: {backend}); "
                "pass interpret=True to run it on the CPU"
            )
        return tpu.decode_attention_pallas_tpu_paged(q, paged, interpret=interpret)
    if impl == "auto" and backend == "tpu" and tpu_paged:
        if tpu.unsupported_paged_reason(q, paged) is None:
            return tpu.decode_attention_pallas_tpu_paged(q, paged)
    if impl == "auto" and backend == "gpu" and by_table:
        if gpu.unsupported_paged_reason(q, paged) is None:
            return gpu.decode_attention_pallas_paged(q, paged)
        if cudnn_unsupported_reason(q, page(paged, 0)) is not None:
            return _attention_by_pages(q, paged, None)
    return contiguous(q, view(paged), impl=impl, interpret=interpret, window=window)
