#!/usr/bin/env bash
# One device call: the GPU kernel tests, then the benchmark (sweep of kernel variants first).
# The device machine gets the checkout only; run this from a folder that holds kivi_jax/ (with
# pallas_kernels/ copied in as kivi_jax/pallas_kernels), tests/, benchmarks/ and pyproject.toml.
# Usage: bash benchmarks/h200_session.sh OUT_DIR [attention.py args, e.g. --block-sweep]
# (SASS needs no GPU: benchmarks/kernel_sass.py.)
set -u
out=${1:?out dir}; shift
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/env.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/env.txt"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 -m pytest -q -m gpu -n 14 \
  -p no:cacheprovider tests/test_decode_attention_kernel.py > "$out/tests.log" 2>&1
tail -3 "$out/tests.log"
python3 benchmarks/attention.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" | grep -v "^  sweep"
