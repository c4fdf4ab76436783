"""Weight-only quantization of the model's linear layers (docs/weights.md).

A quantized weight is a `QuantizedWeight`: `qvalue` [in, out] (int8 or int4), `scale` and an
optional `zero_point` of shape [in // g, out] (g rows of the input dimension share them; g = in:
one per output channel), with the invariant

    w ~= (qvalue - zero_point) * scale     (scale and zero point repeated over each group of g rows)

computed in `scale.dtype`, the compute dtype. Its matmul (`dense`) runs a fused GPU kernel
(codes read as stored, scales applied to partial sums: pallas_kernels/matmul/gemv.py for 1-2
rows, gpu.py for up to 64) for a decode step on a GPU, and otherwise the reference: the weight
dequantized into the dot's operand (convert, subtract, multiply, dot), which XLA computes as a
separate copy of the weight (on the CPU all of a step's matrices at once under its default
scheduler, one at a time under the memory-first one: docs/weights.md).

Formats (`quantize_weights`):
  int8   symmetric, one scale per output channel: q = round(w / s), s = max|w| / 127 per column.
  int4   asymmetric, groups of g rows along the input: q = round(w / s + z) - 8 in [-8, 7],
         s = (max - min) / 15, z = -min / s (a float zero point: each group's minimum is exact, as
         in GGUF's Q4_1), stored as zero_point = z - 8. g is the largest divisor of the input width
         that is at most `group_size` (SmolLM2's width 576 with the default 128: g = 96).
All 4-bit values are `jnp.int4` (orbax saves int4 but not uint4; XLA packs two per byte on GPUs).
Embeddings and norms stay in the compute dtype; so does a tied output projection (the embedding).

Qwix's QArray (google/qwix) has these fields and this invariant, and its `dot_general` for a
float activation is the same dequantize-then-dot; it is not used because it requires the zero
point in qvalue's integer dtype, so GGUF's Q4_1 blocks (zero = -min / scale, not an integer)
could not be held without rounding them again (docs/weights.md).
"""

from __future__ import annotations

import argparse
import functools
import math

import flax.struct
import jax
import jax.numpy as jnp

__all__ = [
    "WEIGHT_CHOICES",
    "QuantizedWeight",
    "add_weights_argument",
    "concat_columns",
    "dense",
    "dequantize",
    "fused_unsupported_reason",
    "group_for",
    "quantize_matrix",
    "quantize_weights",
    "storage_bits",
    "weights_label",
]


@flax.struct.dataclass
class QuantizedWeight:
    """A matrix [in, out] as integers with scales: w ~= (qvalue - zero_point) * scale, the scale
    and zero point of row group i (rows i*g ... i*g + g - 1, g = in // scale.shape[0]) repeated
    over its rows; zero_point None: symmetric (0)."""

    qvalue: jax.Array  # int8 or int4 [in, out]
    scale: jax.Array  # float [in // g, out], the compute dtype
    zero_point: jax.Array | None = None  # float [in // g, out] (scale's dtype), or None

    @property
    def shape(self) -> tuple[int, int]:
        return self.qvalue.shape

    @property
    def dtype(self):
        return self.scale.dtype

    @property
    def group(self) -> int:
        return self.qvalue.shape[0] // self.scale.shape[0]

    def __getitem__(self, index) -> QuantizedWeight:
        """Columns only (`w[:, a:b]`, as LayerWeights' wq ... w_up read the fused matrices): the
        scales are per column, so the columns' scales come along."""
        rows, cols = index if isinstance(index, tuple) and len(index) == 2 else (None, None)
        if rows != slice(None) or not isinstance(cols, slice):
            raise IndexError(f"a QuantizedWeight takes column slices w[:, a:b], got {index!r}")
        return jax.tree.map(lambda x: x[:, cols], self)


# "float": every weight in the compute dtype; "int8" / "int4": quantize_weights after loading;
# "gguf": a GGUF's Q8_0 / Q4_0 / Q4_1 linear layers kept as stored (kivi_jax.loading).
WEIGHT_CHOICES = ("float", "int8", "int4", "gguf")
_LINEAR = ("w_qkv", "wo", "w_gate_up", "w_down")


# int4's default group: a GGUF's own block width (its Q4_0 / Q4_1 / Q8_0 tensors, re-quantized in
# groups of 32, keep their grid: +0.00% perplexity on the default model, against +50% in groups of
# 96 / 128, docs/weights.md), else the common 128 of float checkpoints.
GGUF_GROUP_SIZE, DEFAULT_GROUP_SIZE = 32, 128


def group_for(width: int, group_size: int) -> int:
    """The largest divisor of `width` that is at most `group_size` (576, 128 -> 96)."""
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    return max(g for g in range(1, min(width, group_size) + 1) if width % g == 0)


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def quantize_matrix(w: jax.Array, *, bits: int, group_size: int = 128) -> QuantizedWeight:
    """w [in, out] (float) -> QuantizedWeight (module docstring: int8, or int4 in row groups)."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"w must be a float matrix [in, out], got {w.dtype}{list(w.shape)}")
    dtype, wf = w.dtype, w.astype(jnp.float32)
    if bits == 8:
        amax = jnp.max(jnp.abs(wf), axis=0, keepdims=True)  # [1, out]
        scale = jnp.where(amax > 0, amax / 127.0, 1.0)  # an all-zero column: q = 0
        q = jnp.clip(jnp.round(wf / scale), -127, 127).astype(jnp.int8)
        return QuantizedWeight(qvalue=q, scale=scale.astype(dtype))
    n_in, n_out = w.shape
    g = group_for(n_in, group_size)
    grouped = wf.reshape(n_in // g, g, n_out)  # [in / g, g, out]
    lo, hi = grouped.min(axis=1), grouped.max(axis=1)  # [in / g, out]
    scale = jnp.where(hi > lo, (hi - lo) / 15.0, 1.0)  # a constant group: q = 0, z = -lo
    zero = -lo / scale
    q = jnp.clip(jnp.round(grouped / scale[:, None] + zero[:, None]), 0, 15) - 8
    return QuantizedWeight(
        qvalue=q.reshape(n_in, n_out).astype(jnp.int4),
        scale=scale.astype(dtype),
        zero_point=(zero - 8).astype(dtype),
    )


def dequantize(w: QuantizedWeight | jax.Array) -> jax.Array:
    """The weight [in, out] in its scale's dtype (a float array is returned as is)."""
    if not isinstance(w, QuantizedWeight):
        return w
    n_in, n_out = w.shape
    q = w.qvalue.astype(w.scale.dtype).reshape(-1, w.group, n_out)  # [in / g, g, out]
    if w.zero_point is not None:
        q = q - w.zero_point[:, None]
    return (q * w.scale[:, None]).reshape(n_in, n_out)


def fused_unsupported_reason(x: jax.Array, w: QuantizedWeight) -> str | None:
    """Why `dense(x, w)` runs neither fused GPU kernel; None where one runs: on a GPU, 1-2 rows
    through the small-M kernel (pallas_kernels/matmul/gemv.py: no tensor cores, no padding;
    16-bit scales, N a multiple of 256 int4 / 128 int8 columns, row groups a power of two >= 8
    or one per column), else at most 64 rows (a decode step's batch; a prefill of that few
    tokens too) through the tensor-core kernel (pallas_kernels/matmul/gpu.py: bf16 / f16
    activations, int8 / int4 codes, N a multiple of 64, row groups a power of two in [16, 128]
    or one per column). The kernels apply scales to exact integer products where the reference
    rounds each dequantized weight to the compute dtype, so the paths differ by that rounding
    (one batch can take one path and another the other)."""
    if jax.default_backend() != "gpu":
        return f"the fused kernel needs a GPU (backend here: {jax.default_backend()})"
    from kivi_jax.pallas_kernels.matmul.gpu import unsupported_reason

    if _small_rows_reason(x, w) is None:
        return None
    return unsupported_reason(math.prod(x.shape[:-1]), *w.shape, w.group, w.qvalue.dtype, x.dtype)


def _small_rows_reason(x: jax.Array, w: QuantizedWeight) -> str | None:
    """Why the small-M kernel does not take x @ w (pallas_kernels/matmul/gemv.py)."""
    from kivi_jax.pallas_kernels.matmul import gemv

    rows = math.prod(x.shape[:-1])
    return gemv.unsupported_reason(rows, *w.shape, w.group, w.qvalue.dtype, x.dtype, w.scale.dtype)


def dense(x: jax.Array, w: QuantizedWeight | jax.Array, preferred_element_type=None) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in x's dtype (float32 with
    preferred_element_type=float32). A quantized w is read as stored by a fused kernel where
    one applies (`fused_unsupported_reason`: a decode step on a GPU), else dequantized into
    the dot's operand (the reference)."""
    if isinstance(w, QuantizedWeight) and fused_unsupported_reason(x, w) is None:
        from kivi_jax.pallas_kernels.matmul.gemv import quantized_gemv
        from kivi_jax.pallas_kernels.matmul.gpu import quantized_matmul

        kernel = quantized_gemv if _small_rows_reason(x, w) is None else quantized_matmul
        y = kernel(x.reshape(-1, x.shape[-1]), w.qvalue, w.scale, w.zero_point)
        return y.reshape(*x.shape[:-1], w.shape[1]).astype(preferred_element_type or x.dtype)
    if isinstance(w, QuantizedWeight):
        w = dequantize(w).astype(x.dtype)
    return jnp.einsum("...i,io->...o", x, w, preferred_element_type=preferred_element_type)


def concat_columns(ws) -> QuantizedWeight | jax.Array:
    """Matrices [in, out_i] side by side -> [in, sum out_i]: float arrays, or QuantizedWeights of
    one format (the same qvalue dtype, groups and zero point or none); scales are per column."""
    if not any(isinstance(w, QuantizedWeight) for w in ws):
        return jnp.concatenate(ws, axis=1)
    first = ws[0]
    for w in ws:
        if (
            not isinstance(w, QuantizedWeight)
            or w.qvalue.dtype != first.qvalue.dtype
            or w.scale.shape[0] != first.scale.shape[0]
            or (w.zero_point is None) != (first.zero_point is None)
        ):
            raise TypeError("matrices fused into one must all be QuantizedWeights of one format")
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *ws)


def storage_bits(x) -> int:
    """Bits one element of array `x` takes in device memory (int4: 4, not its itemsize's 8)."""
    dtype = jnp.dtype(x.dtype)
    return 4 if dtype in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else dtype.itemsize * 8


def quantize_weights(params, *, bits: int, group_size: int = 128):
    """`params` (LlamaParams, float weights) with every linear layer quantized: each block's
    w_qkv, wo, w_gate_up, w_down and an untied lm_head (module docstring for the formats).

    Raises:
      ValueError: bits not 8 or 4, group_size not a positive int.
      TypeError: params already hold quantized weights.
    """
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    group_for(1, group_size)  # checks group_size
    if any(isinstance(getattr(lw, n), QuantizedWeight) for lw in params.layers for n in _LINEAR):
        raise TypeError("params already hold quantized weights; quantize float weights")
    q = lambda w: quantize_matrix(w, bits=bits, group_size=group_size)
    layers = tuple(lw.replace(**{n: q(getattr(lw, n)) for n in _LINEAR}) for lw in params.layers)
    lm_head = None if params.lm_head is None else q(params.lm_head)
    return params.replace(layers=layers, lm_head=lm_head)


def weights_label(params) -> str:
    """ "float", "int8", "int4", or "mixed" (a GGUF whose linear layers differ in format)."""
    label = lambda w: jnp.dtype(w.qvalue.dtype).name if isinstance(w, QuantizedWeight) else "float"
    kinds = {label(getattr(lw, n)) for lw in params.layers for n in _LINEAR}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def add_weights_argument(parser: argparse.ArgumentParser) -> None:
    """`--weights float|int8|int4|gguf` and `--weight-group-size N`: pass them on as
    `load_model(..., weights=args.weights, weight_group_size=args.weight_group_size)`."""
    parser.add_argument(
        "--weights",
        choices=WEIGHT_CHOICES,
        default="float",
        help="the linear layers' weights: float (the compute dtype), int8 (per output "
        "channel), int4 (in groups along the input, with a zero point), or gguf (a GGUF file's "
        "Q8_0/Q4_0/Q4_1 tensors kept as stored) (default: float)",
    )
    parser.add_argument(
        "--weight-group-size",
        type=int,
        default=None,
        metavar="N",
        help="int4's group along the input: the largest divisor of each layer's input width "
        "that is at most N (default: 32 for a GGUF, whose blocks are 32 wide, else 128)",
    )
