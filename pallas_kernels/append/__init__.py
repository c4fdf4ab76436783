"""A decode step's KIVI append as one GPU kernel per layer (gpu.py)."""
