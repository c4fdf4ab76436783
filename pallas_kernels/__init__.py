"""Pallas kernels (installed as kivi_jax.pallas_kernels)."""
