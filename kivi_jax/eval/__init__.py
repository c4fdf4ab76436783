"""Accuracy studies of KV quantization on a real model (the `kivi-eval` CLI)."""
