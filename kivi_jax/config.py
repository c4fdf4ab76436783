"""KiviConfig: the static settings of a KIVI cache (plain or mixed-precision)."""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
import numpy as np

from kivi_jax import quantization

SUPPORTED_BITS = (2, 4, 8)
_INT_FIELDS = (
    "k_bits", "v_bits", "group_size", "residual_length", "sinks", "fine_key_channels",
    "heavy_tokens",
)  # fmt: skip


class Selection(enum.Enum):
    """The score by which a mixed-precision cache picks its important tokens (kivi_jax.cache).

    MASS: the attention mass a token receives while in the full-precision window (its own and
      the next R - 1 queries; each query's softmax over the full-precision keys it sees, the
      sinks and the window, summed over the query heads of the KV head). Needs the queries:
      `prefill(..., q=)` and `append(..., q=)`.
    ERROR: the token's own quantization error, ||k - k'||^2 + ||v - v'||^2 (a function of the
      token and its key group only).
    """

    MASS = "mass"
    ERROR = "error"


class Format(enum.Enum):
    """How a part of the cache stores its floats (scales and zero points, or the tokens kept
    in full precision): in the cache dtype, or in 8 bits (kivi_jax.quantization has the
    rounding rules).

    CACHE: the cache dtype (init_cache's `dtype`: float32, bfloat16 or float16).
    E4M3: float8_e4m3fn (3 mantissa bits, finite range +-448, subnormals down to 2^-9).
    E5M2: float8_e5m2 (2 mantissa bits, finite range +-57344, subnormals down to 2^-16).
    E4M3_INT8: scales and zeros only (k_scale_format, v_scale_format): an e4m3 scale s and an
      int8 zero point n counting units of s * 2^bits / 64 (about 1/64 of the group's range;
      bits the codes' width), both rounded to nearest with the grid centred on the group
      (quantization.IntZero; the others' s rounded up and z down cover the range but widen
      every step).
    INT8: tokens only (residual_format): each token's D values (one KV head) as int8 codes
      with a power-of-two scale 2^e, e an int8 (quantization.encode_int8_tokens): 8 bits a
      value and 8 a token; every value within max|x| / 127 of the token's largest.
    """

    CACHE = "cache"
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    E4M3_INT8 = "e4m3-int8"
    INT8 = "int8"

    def dtype(self, cache_dtype) -> jnp.dtype:
        """The dtype this format stores tokens in, for a cache of `cache_dtype` (INT8: the
        codes'; their exponents are int8 too)."""
        if self is Format.CACHE:
            return jnp.dtype(cache_dtype)
        if self is Format.E4M3_INT8:
            raise ValueError("Format.E4M3_INT8 stores scales and zeros, not tokens")
        if self is Format.INT8:
            return jnp.dtype(jnp.int8)
        return jnp.dtype(jnp.float8_e4m3fn if self is Format.E4M3 else jnp.float8_e5m2)

    def params(self, cache_dtype, bits: int):
        """How this format stores the scales and zeros of `bits`-bit codes in a cache of
        `cache_dtype`: their dtype, or a quantization.IntZero (quantize takes either)."""
        if self is Format.INT8:
            raise ValueError("Format.INT8 stores tokens, not scales and zeros")
        if self is Format.E4M3_INT8:
            return quantization.IntZero(jnp.dtype(cache_dtype), bits - 6)
        return self.dtype(cache_dtype)


class Range(enum.Enum):
    """How a group's quantization range is chosen (kivi_jax.quantization.quantize's trims).

    MINMAX: the group's minimum and maximum (KIVI): every member within half a step of its
      reconstruction (up to the rounding of the scale and zero: quantization's module doc).
    SEARCH: among quantization.SEARCH_TRIMS (min/max and ranges with up to 20% of the span
      cut off either end), the range of least squared error over the group's members after
      quantize-dequantize in the stored format; members beyond it take the end codes. No
      bits stored: the scale and zero encode the range as before.
    """

    MINMAX = "minmax"
    SEARCH = "search"

    @property
    def trims(self) -> tuple[tuple[float, float], ...]:
        return quantization.MINMAX if self is Range.MINMAX else quantization.SEARCH_TRIMS


@dataclasses.dataclass(frozen=True, kw_only=True)
class KiviConfig:
    """Settings of a KIVI quantized KV cache.

    Attributes:
      k_bits: bits per key code (per-channel quantization), one of 2, 4, 8.
      v_bits: bits per value code (per-token quantization), one of 2, 4, 8.
      group_size: G. Keys are grouped over G consecutive tokens of one channel; values over G
        consecutive channels of one token. G must divide head_dim (checked when a cache is made).
      residual_length: R, a positive multiple of G. Keys keep the last (l mod R) tokens in full
        precision and are quantized R at a time; values keep the last min(l, R) tokens.

    Mixed precision (all off by default: plain KIVI; kivi_jax.cache's module doc has the layout):
      sinks: S < G, the first S tokens of each sequence kept in full precision (keys and
        values), and left out of the range of the first key group.
      sliding_keys: keys read from the ring for the last min(l, R) tokens, like values (instead
        of the last l mod R): keys and values leave the window together, one at a time.
      fine_key_channels: F < head_dim. In each key group, the F channels of widest range (over
        the group's non-sink tokens) are quantized with 2 * k_bits bits: the high k_bits in
        the usual codes, the low k_bits in a second plane.
      heavy_tokens: N, a per-sequence (per KV head) budget of tokens kept in full precision
        after they leave the window: the N highest-scoring of those that have left.
      selection: the score of the heavy tokens (Selection).

    Storage formats (config.Format; all CACHE by default; docs/design.md, "Storage formats"):
      k_scale_format, v_scale_format: the keys' and the values' scales and zero points (CACHE,
        E4M3, E5M2 or E4M3_INT8).
      residual_format: the tokens kept in full precision: both rings, the sinks and the heavy
        tokens (CACHE, E4M3, E5M2 or INT8).

    Quantization ranges (config.Range; MINMAX by default):
      k_range, v_range: how each key group's and each value group's range is chosen (the fine
        key channels' codes keep MINMAX).
    """

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    sinks: int = 0
    sliding_keys: bool = False
    fine_key_channels: int = 0
    heavy_tokens: int = 0
    selection: Selection = Selection.MASS
    k_scale_format: Format = Format.CACHE
    v_scale_format: Format = Format.CACHE
    residual_format: Format = Format.CACHE
    k_range: Range = Range.MINMAX
    v_range: Range = Range.MINMAX

    @property
    def mixed(self) -> bool:
        """Whether any mixed-precision feature is on (the TPU kernel and the fused append
        kernel read none of them; the GPU decode kernels read all)."""
        return bool(self.sinks or self.sliding_keys or self.fine_key_channels or self.heavy_tokens)

    @property
    def needs_queries(self) -> bool:
        """Whether prefill and append need the queries (heavy tokens chosen by MASS)."""
        return self.heavy_tokens > 0 and self.selection is Selection.MASS

    def __post_init__(self):
        for name in _INT_FIELDS:  # numpy ints (e.g. read from an array) taken as Python ints
            value = getattr(self, name)
            if isinstance(value, np.integer):
                object.__setattr__(self, name, int(value))
        for name in ("k_bits", "v_bits"):
            bits = getattr(self, name)
            if not isinstance(bits, int) or isinstance(bits, bool) or bits not in SUPPORTED_BITS:
                raise ValueError(f"KiviConfig.{name} must be one of {SUPPORTED_BITS}, got {bits!r}")
        g, r = self.group_size, self.residual_length
        if not isinstance(g, int) or isinstance(g, bool) or g <= 0 or g % 4:
            raise ValueError(
                f"KiviConfig.group_size must be a positive multiple of 4 (a group fills whole "
                f"bytes of 2-bit codes), got {g!r}"
            )
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0 or r % g:
            raise ValueError(
                f"KiviConfig.residual_length must be a positive multiple of "
                f"group_size={g}, got {r!r}"
            )
        for name in ("sinks", "fine_key_channels", "heavy_tokens"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"KiviConfig.{name} must be a non-negative int, got {n!r}")
        if self.sinks >= g:
            raise ValueError(
                f"KiviConfig.sinks={self.sinks} must be below group_size={g} (the first key "
                f"group's range is taken over its other tokens)"
            )
        if self.fine_key_channels and 2 * self.k_bits > 8:
            raise ValueError(
                f"KiviConfig.fine_key_channels needs k_bits of 2 or 4 (fine codes have "
                f"2 * k_bits bits), got k_bits={self.k_bits}"
            )
        if not isinstance(self.sliding_keys, bool):
            raise ValueError(f"KiviConfig.sliding_keys must be a bool, got {self.sliding_keys!r}")
        if not isinstance(self.selection, Selection):
            raise ValueError(f"KiviConfig.selection must be a Selection, got {self.selection!r}")
        for name in ("k_scale_format", "v_scale_format", "residual_format"):
            if not isinstance(getattr(self, name), Format):
                raise ValueError(f"KiviConfig.{name} must be a Format, got {getattr(self, name)!r}")
        for name in ("k_range", "v_range"):
            if not isinstance(getattr(self, name), Range):
                raise ValueError(f"KiviConfig.{name} must be a Range, got {getattr(self, name)!r}")
        if self.residual_format is Format.E4M3_INT8:
            raise ValueError(
                "KiviConfig.residual_format cannot be Format.E4M3_INT8 (a format of scales and "
                "zero points); use CACHE, E4M3, E5M2 or INT8"
            )
        for name in ("k_scale_format", "v_scale_format"):
            if getattr(self, name) is Format.INT8:
                raise ValueError(
                    f"KiviConfig.{name} cannot be Format.INT8 (a format of tokens); use CACHE, "
                    f"E4M3, E5M2 or E4M3_INT8"
                )

    @property
    def plain_formats(self) -> bool:
        """Whether every float is stored in the cache dtype (no Format other than CACHE)."""
        formats = (self.k_scale_format, self.v_scale_format, self.residual_format)
        return all(f is Format.CACHE for f in formats)

    def check_head_dim(self, head_dim: int) -> None:
        """Raises ValueError unless group_size divides head_dim (value groups span channels)."""
        if head_dim % self.group_size:
            raise ValueError(
                f"group_size={self.group_size} must divide head_dim={head_dim}: values are "
                f"quantized per token in groups of group_size channels"
            )
        if self.fine_key_channels >= head_dim:
            raise ValueError(
                f"fine_key_channels={self.fine_key_channels} must be below head_dim={head_dim}"
            )


KIVI2 = KiviConfig(k_bits=2, v_bits=2)
KIVI4 = KiviConfig(k_bits=4, v_bits=4)
# KIVI-2 with mixed precision; the defaults are the study's (docs/accuracy.md, "Mixed precision").
KIVI2_MIX = KiviConfig(
    k_bits=2,
    v_bits=2,
    sinks=4,
    sliding_keys=True,
    fine_key_channels=16,
    heavy_tokens=32,
    selection=Selection.ERROR,
)
# KIVI-2 at <= 3 bits per held value (issue 61; docs/accuracy.md, "Fewer bits per value" and
# "A better 2-bit quantizer"): kivi2-mix's sinks, sliding keys and fine key channels with e4m3
# scales and int8 zero points rounded to nearest (E4M3_INT8), an int8 residual with a
# power-of-two scale per token (rings and sinks: INT8), a ring of 160 tokens in place of heavy
# tokens, and each key group's range searched (Range.SEARCH).
KIVI2_LEAN = dataclasses.replace(
    KIVI2_MIX,
    residual_length=160,
    heavy_tokens=0,
    k_scale_format=Format.E4M3_INT8,
    v_scale_format=Format.E4M3_INT8,
    residual_format=Format.INT8,
    k_range=Range.SEARCH,
)
