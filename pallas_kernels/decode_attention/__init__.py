"""Fused KIVI decode attention kernels (see gpu.py for the algorithm)."""

from kivi_jax.pallas_kernels.decode_attention.gpu import (
    GpuTuning,
    decode_attention_pallas,
    kivi_decode_attention_gpu,
    supported_config_reason,
    unsupported_reason,
)

__all__ = [
    "GpuTuning",
    "decode_attention_pallas",
    "kivi_decode_attention_gpu",
    "supported_config_reason",
    "unsupported_reason",
]
