"""Flax Llama that threads the KV state (installed as kivi_jax.models)."""
