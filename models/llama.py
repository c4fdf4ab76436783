"""A Llama-family decoder as pure functions over a weight pytree.

The weights are a `flax.struct` dataclass whose static field is the `LlamaConfig`, so `params`
alone is enough to jit any entry point. Each decoder block's weights are arrays of their own (a
tuple of `LayerWeights`), and the blocks run as a Python loop unrolled into the program: every
matmul reads its weight buffer where it lies and every layer's KV state is a buffer of its own,
so a decode step copies neither. (Under `lax.scan` over stacked weights, XLA copies each layer's
weight matrices out of the stack before the matmuls read them: H200, 7B widths, batch 16, 1.37
against 0.51 ms for 4 layers; docs/design.md.) XLA
compiles each distinct Pallas kernel once however many layers call it. The q, k and v
projections are one matrix, and so are the MLP's gate and up projections: one matmul each,
which reads the weights closer to the memory bandwidth than two or three smaller ones.

Three entry points share the same block code:
  forward         tokens [B, S] -> float32 logits [B, S, V]; causal full-precision attention.
  prefill         the same over a (right-padded) prompt, and each layer's K/V written into its
                  KV state with `kivi_jax.prefill` (with the queries, which a mixed-precision
                  state choosing by attention mass reads); returns the logits of each prompt's
                  last token.
  decode_step     one token per sequence: each layer appends its K/V to the state with
                  `kivi_jax.append`, then attends with `kivi_jax.decode_attention` (full-precision
                  and KIVI states go through this same code).

Axis letters: B batch, S/T query/key tokens, d model width, F MLP width, V vocabulary,
N query heads, H KV heads, D head_dim.
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.rope import apply_rope, rope_angles

from kivi_jax.attention import decode_attention
from kivi_jax.cache import KiviCache, init_cache
from kivi_jax.cache import append as cache_append
from kivi_jax.cache import prefill as cache_prefill
from kivi_jax.paged import PagedCache, append_and_attend
from kivi_jax.weights import QuantizedWeight, concat_columns, dense, storage_bits


@flax.struct.dataclass
class LayerWeights:
    """One decoder block's weights (x @ w layout: [in, out]). Build it from the separate
    projections with `from_projections`; `wq` ... `w_up` read them back (slices). The four
    matrices are float arrays or `QuantizedWeight`s (kivi_jax.weights); the norms and biases
    are float. The biases and q/k norms are there where the config's switches ask for them
    (`LlamaConfig.qkv_bias`, `qk_norm`), else None."""

    attn_norm: jax.Array  # [d]
    w_qkv: jax.Array | QuantizedWeight  # [d, N*D + 2*H*D]: q, k, v projections side by side
    wo: jax.Array | QuantizedWeight  # [N*D, d]
    mlp_norm: jax.Array  # [d]
    w_gate_up: jax.Array | QuantizedWeight  # [d, 2*F]: gate, up
    w_down: jax.Array | QuantizedWeight  # [F, d]
    b_qkv: jax.Array | None = None  # [N*D + 2*H*D]: q, k, v biases, as w_qkv's columns
    q_norm: jax.Array | None = None  # [D], every query head's
    k_norm: jax.Array | None = None  # [D], every key head's

    @classmethod
    def from_projections(
        cls, *, attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down, bq=None, bk=None,
        bv=None, q_norm=None, k_norm=None,
    ) -> LayerWeights:  # fmt: skip
        """From the separate matrices (wq [d, N*D], wk / wv [d, H*D], w_gate / w_up [d, F]),
        biases (bq [N*D], bk / bv [H*D]: all three or none) and q/k norms ([D], both or none)."""
        for (a, x), (b, y) in ((("wk", wk), ("wv", wv)), (("w_gate", w_gate), ("w_up", w_up))):
            if x.shape != y.shape:
                raise ValueError(f"{a} {x.shape} and {b} {y.shape} must have the same shape")
        if not wq.shape[0] == wk.shape[0] == w_gate.shape[0]:
            raise ValueError(
                f"wq {wq.shape}, wk {wk.shape} and w_gate {w_gate.shape} must have the same "
                "input width"
            )
        biases = [bq, bk, bv]
        if any(b is None for b in biases) != all(b is None for b in biases):
            raise ValueError("bq, bk and bv come together (all three or none)")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm come together (both or none)")
        return cls(
            attn_norm=attn_norm,
            w_qkv=concat_columns([wq, wk, wv]),
            wo=wo,
            mlp_norm=mlp_norm,
            w_gate_up=concat_columns([w_gate, w_up]),
            w_down=w_down,
            b_qkv=None if bq is None else jnp.concatenate(biases),
            q_norm=q_norm,
            k_norm=k_norm,
        )

    @property
    def _q_kv_widths(self) -> tuple[int, int]:
        q = self.wo.shape[0]
        return q, (self.w_qkv.shape[1] - q) // 2

    @property
    def wq(self) -> jax.Array:
        return self.w_qkv[:, : self._q_kv_widths[0]]

    @property
    def wk(self) -> jax.Array:
        q, kv = self._q_kv_widths
        return self.w_qkv[:, q : q + kv]

    @property
    def wv(self) -> jax.Array:
        q, kv = self._q_kv_widths
        return self.w_qkv[:, q + kv :]

    @property
    def w_gate(self) -> jax.Array:
        return self.w_gate_up[:, : self.w_down.shape[0]]

    @property
    def w_up(self) -> jax.Array:
        return self.w_gate_up[:, self.w_down.shape[0] :]


@flax.struct.dataclass
class LlamaParams:
    """The weight pytree. `config` is static (not a leaf), so jit specializes on it."""

    embed: jax.Array  # [V, d]
    layers: tuple[LayerWeights, ...]  # one per decoder block
    final_norm: jax.Array  # [d]
    lm_head: jax.Array | QuantizedWeight | None  # [d, V], None when the embeddings are tied
    config: LlamaConfig = flax.struct.field(pytree_node=False)
    # The mesh the weights are placed on (kivi_jax.sharding.shard_params: w_qkv and w_gate_up
    # then hold their columns in per-shard order), None on one device. With a mesh, prefill,
    # decode_step and forward run under shard_map.
    mesh: jax.sharding.Mesh | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def dtype(self):
        return self.embed.dtype

    def astype(self, dtype) -> LlamaParams:
        """Every float array (norms, float weights, quantized weights' scales) cast to `dtype`;
        quantized values keep their integer type."""
        floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)
        return jax.tree.map(lambda x: x.astype(dtype) if floating(x) else x, self)


def init_params(config: LlamaConfig, key: jax.Array, dtype=jnp.float32) -> LlamaParams:
    """Random weights (scaled normal; norms near 1) for tests and benchmarks of the shapes."""
    c = config
    d, F = c.hidden_size, c.intermediate_size
    keys = iter(jax.random.split(key, 3 + 12 * c.num_layers))

    def dense(shape, fan_in):
        return (jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    def norm(shape):
        return (1.0 + 0.1 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    qkv_width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim

    def extras():
        out = {}
        if c.qkv_bias:
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            b = 0.5 * jax.random.normal(next(keys), (qkv_width,), jnp.float32)
            out |= dict(bq=b[:q], bk=b[q : q + kv], bv=b[q + kv :])
        if c.qk_norm:
            out |= dict(q_norm=norm((c.head_dim,)), k_norm=norm((c.head_dim,)))
        return {k: v.astype(dtype) for k, v in out.items()}

    layers = tuple(
        LayerWeights.from_projections(
            **extras(),
            attn_norm=norm((d,)),
            wq=dense((d, c.num_heads * c.head_dim), d),
            wk=dense((d, c.num_kv_heads * c.head_dim), d),
            wv=dense((d, c.num_kv_heads * c.head_dim), d),
            wo=dense((c.num_heads * c.head_dim, d), c.num_heads * c.head_dim),
            mlp_norm=norm((d,)),
            w_gate=dense((d, F), d),
            w_up=dense((d, F), d),
            w_down=dense((F, d), F),
        )
        for _ in range(c.num_layers)
    )
    embed = dense((c.vocab_size, d), 1.0) * jnp.asarray(0.5, dtype)
    lm_head = None if c.tie_embeddings else dense((d, c.vocab_size), d)
    return LlamaParams(embed=embed, layers=layers, final_norm=norm((d,)), lm_head=lm_head, config=c)


def validate_params(params: LlamaParams) -> None:
    """Checks every weight's shape against the config (a loader's last line of defence)."""
    c = params.config
    d, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
    qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if len(params.layers) != c.num_layers:
        raise ValueError(f"{len(params.layers)} layers of weights, the config has {c.num_layers}")
    layer = dict(
        attn_norm=(d,),
        w_qkv=(d, qd + 2 * kvd),
        wo=(qd, d),
        mlp_norm=(d,),
        w_gate_up=(d, 2 * F),
        w_down=(F, d),
    )
    if c.qkv_bias:
        layer["b_qkv"] = (qd + 2 * kvd,)
    if c.qk_norm:
        layer |= dict(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
    expected = {"embed": (params.embed, (V, d)), "final_norm": (params.final_norm, (d,))}
    for i, lw in enumerate(params.layers):
        expected |= {f"layers[{i}].{n}": (getattr(lw, n), shape) for n, shape in layer.items()}
        for n, switch in (("b_qkv", "qkv_bias"), ("q_norm", "qk_norm"), ("k_norm", "qk_norm")):
            if n not in layer and getattr(lw, n) is not None:
                raise ValueError(f"layers[{i}].{n} is set, but the config's {switch} is False")
    if not c.tie_embeddings:
        expected["lm_head"] = (params.lm_head, (d, V))
    for name, (w, shape) in expected.items():
        if w is None or tuple(w.shape) != shape:
            got = None if w is None else tuple(w.shape)
            raise ValueError(f"weight {name} has shape {got}, the config implies {shape}")


# ----------------------------------------------------------------------------- building blocks


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x * weight / rms(x), statistics in float32, result in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def _dense(x: jax.Array, w: jax.Array | QuantizedWeight, preferred_element_type=None) -> jax.Array:
    """x [..., i] @ w [i, o]; a quantized w is dequantized into the dot (kivi_jax.weights)."""
    return dense(x, w, preferred_element_type)


def _qkv(lw: LayerWeights, x: jax.Array, positions: jax.Array, c: LlamaConfig):
    """x [..., d], positions [...] -> q [..., N, D], k, v [..., H, D] (RoPE applied to q and k).

    The rotation runs over all N + 2H heads of the one matmul's output, the value heads given the
    angle 0 (cos 1, sin 0: each value passes through as x * 1 - y * 0), so that XLA computes q, k
    and v in one fusion; rotating q and k apart took a GPU decode step three (docs/history.md E1).
    """
    n, h = c.num_heads, c.num_kv_heads
    qkv = _dense(x, lw.w_qkv)  # [..., (N + 2H) D]
    if c.qkv_bias:
        qkv = qkv + lw.b_qkv.astype(qkv.dtype)
    qkv = qkv.reshape(*x.shape[:-1], n + 2 * h, c.head_dim)
    if c.qk_norm:  # q and k heads over D, each with its norm's weight; v heads as they are
        weight = jnp.concatenate(
            [
                jnp.broadcast_to(lw.q_norm, (n, c.head_dim)),
                jnp.broadcast_to(lw.k_norm, (h, c.head_dim)),
                jnp.ones((h, c.head_dim), lw.q_norm.dtype),
            ]
        )  # [N + 2H, D]
        normed = jnp.arange(n + 2 * h)[:, None] < n + h
        qkv = jnp.where(normed, rms_norm(qkv, weight, c.rms_eps), qkv)
    cos, sin = rope_angles(  # [..., D/2]
        positions, c.head_dim, c.rope_theta, c.rope_factors, c.rope_scale
    )
    rotated = (jnp.arange(n + 2 * h) < n + h)[:, None]  # [N + 2H, 1]: the q and k heads
    cos = jnp.where(rotated, cos[..., None, :], 1.0)  # [..., N + 2H, D/2]
    sin = jnp.where(rotated, sin[..., None, :], 0.0)
    qkv = apply_rope(qkv, cos, sin)
    return qkv[..., :n, :], qkv[..., n : n + h, :], qkv[..., n + h :, :]


def _sum_shards(x: jax.Array, c: LlamaConfig) -> jax.Array:
    """Under tensor parallelism (kivi_jax.sharding) the sum of every shard's partial output of
    wo or w_down over the mesh axis; x itself on one device."""
    return x if c.tensor_parallel_axis is None else jax.lax.psum(x, c.tensor_parallel_axis)


def _mlp(lw: LayerWeights, x: jax.Array) -> jax.Array:
    gate_up = _dense(x, lw.w_gate_up)  # [..., 2F]
    F = lw.w_down.shape[0]
    gate, up = gate_up[..., :F], gate_up[..., F:]
    return _dense(jax.nn.silu(gate) * up, lw.w_down)


def _logits(params: LlamaParams, h: jax.Array) -> jax.Array:
    """Final norm and output projection, accumulated and returned in float32."""
    h = rms_norm(h, params.final_norm, params.config.rms_eps)
    if params.lm_head is None:
        return jnp.einsum("...d,vd->...v", h, params.embed, preferred_element_type=jnp.float32)
    return _dense(h, params.lm_head, preferred_element_type=jnp.float32)


def _embed(params: LlamaParams, tokens: jax.Array) -> jax.Array:
    # An id outside [0, vocab) (only possible under jit, where _check_tokens cannot see the
    # values) reads a row of NaN, so its logits are NaN rather than another token's.
    vocab = params.embed.shape[0]
    return jnp.take(params.embed, jnp.where(tokens < 0, vocab, tokens), axis=0, mode="fill")


def _prompt_attention_impl(dtype) -> str | None:
    """cuDNN's flash attention on a GPU for bfloat16/float16 (no [B, N, S, S] scores in memory),
    else XLA's."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if half and jax.default_backend() == "gpu" else None


def _prompt_block(lw, h, lengths, c: LlamaConfig, attention=None):
    """One decoder block over a right-padded prompt: h [B, S, d] -> (h, q [B, S, N, D], k, v).

    `attention(q, k, v, lengths) -> [B, S, N, D]` replaces the causal full-precision prompt
    attention when given (kivi_jax.eval.views: what a quantized cache would show each query).
    """
    B, S, _ = h.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    x = rms_norm(h, lw.attn_norm, c.rms_eps)
    q, k, v = _qkv(lw, x, positions, c)
    if attention is None:
        attn = jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            local_window_size=None if c.sliding_window is None else (c.sliding_window - 1, 0),
            key_value_seq_lengths=lengths,
            scale=1.0 / math.sqrt(c.head_dim),
            implementation=_prompt_attention_impl(q.dtype),
        )  # [B, S, N, D]; padded keys (t >= lengths[b]) masked out
    else:
        attn = attention(q, k, v, lengths).astype(h.dtype)
    h = h + _sum_shards(_dense(attn.reshape(B, S, c.num_heads * c.head_dim), lw.wo), c)
    h = h + _sum_shards(_mlp(lw, rms_norm(h, lw.mlp_norm, c.rms_eps)), c)
    return h, q, k, v


def _check_tokens(params: LlamaParams, tokens, lengths=None):
    """(tokens, lengths) as arrays, checked: tokens int [B, S] with S <= max_context, and, where
    they are concrete (outside jit), ids in [0, vocab) and lengths in [1, S]. Under jit an id
    outside [0, vocab) gives NaN logits (`_embed`) and lengths are clipped by the attention mask."""
    if not isinstance(getattr(params, "config", None), LlamaConfig):
        raise TypeError(f"params must be the model's weights (model.params), got {params!r:.60}")
    if isinstance(tokens, list | tuple):
        try:
            tokens = np.asarray(tokens)
        except ValueError as e:
            raise ValueError(f"tokens must be a rectangular [batch, seq] of ids: {e}") from None
    if not hasattr(tokens, "ndim") or not hasattr(tokens, "dtype"):
        raise TypeError(f"tokens must be an int array [batch, seq], got {type(tokens).__name__}")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    c = params.config
    if tokens.shape[1] > c.max_context:
        raise ValueError(
            f"tokens: {tokens.shape[1]} positions exceed the model's context "
            f"(max_context={c.max_context})"
        )
    if not isinstance(tokens, jax.core.Tracer) and tokens.size:
        ids = np.asarray(tokens)
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            bad = ids[(ids < 0) | (ids >= c.vocab_size)]
            raise ValueError(
                f"tokens: ids must lie in [0, vocab_size={c.vocab_size}), got {bad[:5].tolist()}"
            )
    if lengths is not None:
        if isinstance(lengths, list | tuple):
            lengths = np.asarray(lengths)
        if getattr(lengths, "shape", None) != tokens.shape[:1] or not jnp.issubdtype(
            lengths.dtype, jnp.integer
        ):
            raise ValueError(
                f"lengths must be ints of shape ({tokens.shape[0]},), got {lengths!r:.80}"
            )
        if not isinstance(lengths, jax.core.Tracer):
            n = np.asarray(lengths)
            if n.size and (n.min() < 1 or n.max() > tokens.shape[1]):
                raise ValueError(
                    f"lengths must lie in [1, seq={tokens.shape[1]}], got {n.tolist()[:8]}"
                )
        lengths = jnp.asarray(lengths)
    return jnp.asarray(tokens), lengths


# ----------------------------------------------------------------------------- entry points


def _prompt_pass(params, tokens, lengths, attention, collect: bool):
    """Every block over the prompt: (h [B, S, d], per layer (q, k, v) if collect)."""
    c = params.config
    B, S = tokens.shape
    if attention is not None and c.sliding_window is not None and S > c.sliding_window:
        raise NotImplementedError(
            f"a replaced prompt attention does not apply the model's sliding window "
            f"({c.sliding_window} tokens), which a prompt of {S} tokens reaches past"
        )
    lengths = jnp.full((B,), S, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    h, qkv = _embed(params, tokens), []
    for lw in params.layers:
        h, q, k, v = _prompt_block(lw, h, lengths, c, attention)
        if collect:
            qkv.append((q, k, v))
    return h, qkv


def forward(
    params: LlamaParams, tokens: jax.Array, lengths: jax.Array | None = None, *, attention=None
) -> jax.Array:
    """Causal forward pass (full-precision attention unless `attention` is given).

    Args:
      params: the weights (carrying their config).
      tokens: int [B, S]; with `lengths`, right-padded (token t of row b is real if t < lengths[b]).
      lengths: optional int [B], 1 <= lengths[b] <= S. Padded positions get logits too (of no use).
      attention: optional hashable callable `(q [B, S, N, D], k, v [B, S, H, D], lengths [B]) ->
        [B, S, N, D]` used as every layer's prompt attention (static: one compile per value).

    Returns:
      float32 logits [B, S, V].

    Raises (before anything compiles): TypeError/ValueError for tokens that are not int
    [B, S] (a rectangular list of lists is taken), S > max_context, an id outside
    [0, vocab_size) or lengths outside [1, S]. Called under jit, the values cannot be checked:
    an id outside [0, vocab_size) then makes its row's logits NaN (docs/design.md).
    """
    tokens, lengths = _check_tokens(params, tokens, lengths)
    if params.mesh is not None:
        from kivi_jax import sharding

        return sharding.forward(params, tokens, lengths, attention=attention)
    return _forward(params, tokens, lengths, attention=attention)


@functools.partial(jax.jit, static_argnames=("attention",))
def _forward(params, tokens, lengths, *, attention):
    h, _ = _prompt_pass(params, tokens, lengths, attention, collect=False)
    return _logits(params, h)


def forward_with_qkv(
    params: LlamaParams,
    tokens: jax.Array,
    lengths: jax.Array | None = None,
    *,
    attention=None,
    logits_at: jax.Array | None = None,
):
    """`forward` that also returns every layer's q, k, v (post-RoPE), stacked on a layer axis.

    Args:
      params, tokens, lengths, attention: as `forward` (checked alike).
      logits_at: optional int [B]; if given, only the logits at these positions are computed.

    Returns:
      (float32 logits [B, S, V], or [B, V] with `logits_at`; q [L, B, S, N, D]; k, v
      [L, B, S, H, D]).
    """
    if params.mesh is not None:
        raise NotImplementedError(
            "forward_with_qkv runs on one device: kivi_jax.sharding.unshard_params(params)"
        )
    tokens, lengths = _check_tokens(params, tokens, lengths)
    return _forward_with_qkv(params, tokens, lengths, attention=attention, logits_at=logits_at)


@functools.partial(jax.jit, static_argnames=("attention",))
def _forward_with_qkv(
    params: LlamaParams,
    tokens: jax.Array,
    lengths: jax.Array | None = None,
    *,
    attention=None,
    logits_at: jax.Array | None = None,
):
    h, qkv = _prompt_pass(params, tokens, lengths, attention, collect=True)
    if logits_at is not None:
        h = jnp.take_along_axis(h, logits_at[:, None, None], axis=1)[:, 0]  # [B, d]
    q, k, v = (jnp.stack(x) for x in zip(*qkv, strict=True))
    return _logits(params, h), q, k, v


def prefill(
    params: LlamaParams, tokens: jax.Array, lengths: jax.Array, caches, *, rows: int | None = None
):
    """Runs the prompt and writes every layer's K/V into its (empty) KV state.

    Args:
      params: the weights.
      tokens: int [B, S], right-padded prompts.
      lengths: int32 [B], the real prompt lengths (>= 1).
      caches: one empty KV state per layer (`kivi_jax.init_cache(..., num_layers=L)`).
      rows: prefill this many rows at a time (static), so that the prompt's working memory is
        that of `rows` rows whatever the batch; None or >= B: all rows in one pass. Each row's
        state is what prefilling it alone gives, so the chunks only change the rounding of
        the prompt's matmuls (their tiling follows the rows).

    Returns:
      (float32 logits of each prompt's last real token [B, V], the filled states).

    Raises: as `forward` for the tokens and lengths (values checked where concrete).
    """
    tokens, lengths = _check_tokens(params, tokens, lengths)
    if params.mesh is not None:
        from kivi_jax import sharding

        return sharding.prefill(params, tokens, lengths, caches, rows=rows)
    B = tokens.shape[0]
    if rows is None or rows >= B:
        return _prefill_all(params, tokens, lengths, caches)
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive int or None, got {rows!r}")

    def chunk(i, carry):
        # Chunk i covers rows [start, start + rows); the last one is moved back to end at B,
        # and the rows it shares with the previous chunk are prefilled again, from empty
        # states, to the same states.
        logits, caches = carry
        start = jnp.minimum(i * rows, B - rows)
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, rows, axis=0)
        put_rows = lambda big, small: jax.lax.dynamic_update_slice_in_dim(big, small, start, 0)
        put_state = lambda cache, filled: jax.tree.map(put_rows, cache, filled)
        out, caches = _prefill_all(params, take(tokens), take(lengths), caches, put=put_state)
        return put_rows(logits, out), caches

    logits = jnp.zeros((B, params.config.vocab_size), jnp.float32)
    return jax.lax.fori_loop(0, -(-B // rows), chunk, (logits, tuple(caches)))


def _empty_like(cache, batch: int):
    """An empty state of `cache`'s kind and capacity for `batch` sequences (init_cache's fill
    values: a mixed state's empty heavy-token slots are -1 / -inf, not zeros)."""
    return init_cache(
        cache.config if isinstance(cache, KiviCache) else None,
        batch=batch,
        max_len=cache.max_len,
        num_kv_heads=cache.num_kv_heads,
        head_dim=cache.head_dim,
        dtype=cache.dtype,
    )


def _prefill_all(params: LlamaParams, tokens: jax.Array, lengths: jax.Array, caches, put=None):
    """`prefill` of the rows of `tokens` [b, S] in one pass. Without `put`, `caches` are their
    empty states, returned filled; with it, the states of the whole batch, and each layer's
    filled state of the b rows is written into its layer's by `put(cache, filled)` as soon as
    it is made."""
    c = params.config
    h, out = _embed(params, tokens), []
    for lw, cache in zip(params.layers, caches, strict=True):
        h, q, k, v = _prompt_block(lw, h, lengths, c)
        if put is None:
            state = cache_prefill(cache, k, v, lengths, q=q)
        else:
            empty = _empty_like(cache, tokens.shape[0])
            state = put(cache, cache_prefill(empty, k, v, lengths, q=q))
        # The barrier makes the next block wait for this layer's state, so that its K/V die
        # here: left free, XLA on a GPU wrote every layer's state at the end and kept the K/V
        # of all layers alive until then (H200, Llama-2-7B, 10 rows of 2048 tokens, q/k/v as
        # one matmul: 25.0 GB of prefill scratch, 2.6 GB with the barrier).
        h, state = jax.lax.optimization_barrier((h, state))
        out.append(state)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [b, d]
    return _logits(params, last), tuple(out)


def decode_step(params: LlamaParams, tokens: jax.Array, positions: jax.Array, caches, active=None):
    """One decode step: feeds one token per sequence, appends its K/V, attends over the state.

    Args:
      params: the weights.
      tokens: int32 [B], the token fed at this step.
      positions: int32 [B], its position (the number of tokens already in the state).
      caches: one KV state per layer: a contiguous Cache, or a kivi_jax.paged.PagedCache (the
        step's writes and the attention's reads go through its table).
      active: optional bool [B]; inactive sequences append nothing (their logits are meaningless).

    Returns:
      (float32 logits [B, V], the updated states).
    """
    if params.mesh is not None:
        from kivi_jax import sharding

        return sharding.decode_step(params, tokens, positions, caches, active)
    c = params.config
    B = tokens.shape[0]
    h, updated = _embed(params, tokens), []
    for lw, cache in zip(params.layers, caches, strict=True):
        x = rms_norm(h, lw.attn_norm, c.rms_eps)
        q, k, v = _qkv(lw, x, positions, c)  # q [B, N, D], k, v [B, H, D]
        if isinstance(cache, PagedCache):  # written and read through the table
            cache, attn = append_and_attend(cache, q, k, v, active, window=c.sliding_window)
        else:
            cache = cache_append(cache, k, v, active=active, q=q)
            attn = decode_attention(q, cache, window=c.sliding_window)  # [B, N, D], this token
        h = h + _sum_shards(_dense(attn.reshape(B, c.num_heads * c.head_dim), lw.wo), c)
        h = h + _sum_shards(_mlp(lw, rms_norm(h, lw.mlp_norm, c.rms_eps)), c)
        updated.append(cache)
    return _logits(params, h), tuple(updated)


def param_bytes(params: LlamaParams) -> int:
    """Bytes the weights take in device memory (an int4 element is half a byte)."""
    return int(sum(np.prod(x.shape) * storage_bits(x) for x in jax.tree.leaves(params)) // 8)


def _chunk_attention(q, sk, sv, offset, c: LlamaConfig):
    """The chunk's causal attention over the prompt so far, flash-style: key blocks of the
    chunk's width C, from the first the window reaches to the chunk's own, each one
    dot_product_attention call ([B, N, C, C] logits at most, whatever the scratch's width),
    merged by their log-sum-exp in float32.

    q [B, C, N, D] at positions offset .. offset + C (offset a multiple of C); sk, sv
    [B, P, H, D] the keys and values of positions [0, offset + C) -> [B, C, N, D] float32.
    Keys after a query (the chunk's padding among them) are masked out."""
    C, window = q.shape[1], c.sliding_window
    scale = 1.0 / math.sqrt(c.head_dim)
    qpos = offset + jnp.arange(C)

    def block(start):
        k = jax.lax.dynamic_slice_in_dim(sk, start, C, axis=1)
        v = jax.lax.dynamic_slice_in_dim(sv, start, C, axis=1)
        behind = qpos[:, None] - (start + jnp.arange(C))[None, :]  # [C, C]
        seen = behind >= 0 if window is None else (behind >= 0) & (behind < window)
        out, lse = jax.nn.dot_product_attention(
            q, k, v, mask=seen[None, None], scale=scale, return_residual=True
        )  # [B, C, N, D], [B, C, N]
        return out.astype(jnp.float32), lse.astype(jnp.float32)

    def merge(a, b):
        (oa, la), (ob, lb) = a, b
        m = jnp.maximum(la, lb)
        wa, wb = jnp.exp(la - m), jnp.exp(lb - m)
        return (oa * wa[..., None] + ob * wb[..., None]) / (wa + wb)[..., None], m + jnp.log(
            wa + wb
        )

    first = 0 if window is None else jnp.maximum(offset - window + 1, 0) // C
    earlier = jax.lax.fori_loop(
        first,
        offset // C,
        lambda j, acc: merge(acc, block(j * C)),
        (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)),
    )
    out, _ = merge(earlier, block(offset))
    return out


def prefill_chunk(
    params: LlamaParams,
    tokens: jax.Array,
    offset: jax.Array,
    count: jax.Array,
    scratch: tuple,
    caches,
    *,
    every_position: bool = False,
):
    """One chunk of a long prompt (chunked prefill, kivi_jax.serving): its tokens attend in full
    precision over the whole prompt so far, and their K/V are added to the KV states.

    Args:
      params: the weights.
      tokens: int32 [B, C], the chunk (right-padded in the prompt's last chunk).
      offset: int32 [], the prompt tokens before the chunk (the position of its first token), a
        multiple of C.
      count: int32 [B], the chunk's real tokens.
      scratch: per layer (k, v) [B, P, H, D] in the params dtype: the prompt's keys and values
        so far (positions [0, offset)), P >= offset + C; the chunk's are written at offset.
      caches: one KV state per layer, holding the prompt's first `offset` tokens.
      every_position: return the logits of every position of the chunk [B, C, V] (an echo's
        prompt logprobs), not only of its last real token.

    Returns:
      (float32 logits of the chunk's last real token [B, V], the scratch, the states). Run over
      chunks from offset 0, the states are those of `prefill` of the whole prompt (the cache
      holds the same tokens); the logits differ from it only in the attention's reduction
      shapes (the chunk's queries over key blocks of C merged by their log-sum-exp, in place
      of one pass over the prompt's width).
    """
    if params.mesh is not None:
        from kivi_jax import sharding

        return sharding.prefill_chunk(
            params, tokens, offset, count, scratch, caches, every_position=every_position
        )
    c = params.config
    B, C = tokens.shape
    positions = jnp.broadcast_to(offset + jnp.arange(C, dtype=jnp.int32), (B, C))
    h, out, kept = _embed(params, tokens), [], []
    for lw, cache, (sk, sv) in zip(params.layers, caches, scratch, strict=True):
        x = rms_norm(h, lw.attn_norm, c.rms_eps)
        q, k, v = _qkv(lw, x, positions, c)  # q [B, C, N, D], k, v [B, C, H, D]
        sk = jax.lax.dynamic_update_slice_in_dim(sk, k.astype(sk.dtype), offset, axis=1)
        sv = jax.lax.dynamic_update_slice_in_dim(sv, v.astype(sv.dtype), offset, axis=1)
        attn = _chunk_attention(q, sk, sv, offset, c)  # [B, C, N, D]
        attn = attn.astype(h.dtype).reshape(B, C, c.num_heads * c.head_dim)
        h = h + _sum_shards(_dense(attn, lw.wo), c)
        h = h + _sum_shards(_mlp(lw, rms_norm(h, lw.mlp_norm, c.rms_eps)), c)
        state = cache_prefill(cache, k, v, count, q=q)
        h, state = jax.lax.optimization_barrier((h, state))
        out.append(state)
        kept.append((sk, sv))
    if every_position:
        return _logits(params, h), tuple(kept), tuple(out)
    last = jnp.take_along_axis(h, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
    return _logits(params, last), tuple(kept), tuple(out)
