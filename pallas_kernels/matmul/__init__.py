"""Fused dequantize-matmul kernels for quantized weights (kivi_jax.weights)."""
