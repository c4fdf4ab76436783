"""KiviConfig: the static settings of a KIVI cache."""

from __future__ import annotations

import dataclasses

SUPPORTED_BITS = (2, 4, 8)


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
    """

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 32
    residual_length: int = 128

    def __post_init__(self):
        for name in ("k_bits", "v_bits"):
            bits = getattr(self, name)
            if not isinstance(bits, int) or bits not in SUPPORTED_BITS:
                raise ValueError(f"KiviConfig.{name} must be one of {SUPPORTED_BITS}, got {bits!r}")
        g, r = self.group_size, self.residual_length
        if not isinstance(g, int) or g <= 0 or g % 4:
            raise ValueError(
                f"KiviConfig.group_size must be a positive multiple of 4 (a group fills whole "
                f"bytes of 2-bit codes), got {g!r}"
            )
        if not isinstance(r, int) or r <= 0 or r % g:
            raise ValueError(
                f"KiviConfig.residual_length must be a positive multiple of "
                f"group_size={g}, got {r!r}"
            )

    def check_head_dim(self, head_dim: int) -> None:
        """Raises ValueError unless group_size divides head_dim (value groups span channels)."""
        if head_dim % self.group_size:
            raise ValueError(
                f"group_size={self.group_size} must divide head_dim={head_dim}: values are "
                f"quantized per token in groups of group_size channels"
            )


KIVI2 = KiviConfig(k_bits=2, v_bits=2)
KIVI4 = KiviConfig(k_bits=4, v_bits=4)
