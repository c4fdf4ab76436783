"""kivi-jax."""
