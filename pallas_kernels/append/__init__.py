"""The fused KIVI append (experiment: gpu.py)."""
