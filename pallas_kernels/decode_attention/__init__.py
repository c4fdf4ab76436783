"""Fused KIVI decode attention kernels (the algorithms: gpu.py and tpu.py)."""

from kivi_jax.pallas_kernels.decode_attention.gpu import (
    GpuTuning,
    decode_attention_pallas,
    kivi_decode_attention_gpu,
    supported_config_reason,
    unsupported_reason,
)
from kivi_jax.pallas_kernels.decode_attention.tpu import (
    TpuTuning,
    decode_attention_pallas_tpu,
    kivi_decode_attention_tpu,
)
from kivi_jax.pallas_kernels.decode_attention.tpu import (
    supported_config_reason as tpu_supported_config_reason,
)
from kivi_jax.pallas_kernels.decode_attention.tpu import (
    unsupported_reason as tpu_unsupported_reason,
)

__all__ = [
    "GpuTuning",
    "TpuTuning",
    "decode_attention_pallas",
    "decode_attention_pallas_tpu",
    "kivi_decode_attention_gpu",
    "kivi_decode_attention_tpu",
    "supported_config_reason",
    "tpu_supported_config_reason",
    "tpu_unsupported_reason",
    "unsupported_reason",
]
