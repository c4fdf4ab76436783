#!/usr/bin/env bash
# One device call: the GPU tests, then the benchmark. Run from the repository root; the device
# machine gets the checkout only (no install), so this copies the package into /tmp/pk with
# models/ and pallas_kernels/ in place under kivi_jax/, as the wheel lays them out.
# Usage: bash benchmarks/h200_session.sh OUT_DIR [attention.py args]
# (SASS needs no GPU: benchmarks/kernel_sass.py.)
set -u
out=${1:?out dir}; shift
rm -rf /tmp/pk && mkdir -p /tmp/pk
cp -r kivi_jax tests benchmarks pyproject.toml /tmp/pk/
cp -r models /tmp/pk/kivi_jax/models && cp -r pallas_kernels /tmp/pk/kivi_jax/pallas_kernels
cd /tmp/pk && export PYTHONPATH=/tmp/pk PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.mem --format=csv | tee "$out/env.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/env.txt"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu \
  -n 16 -p no:cacheprovider tests/test_decode_attention_kernel.py tests/test_generate_gpu.py \
  > "$out/tests.log" 2>&1
tail -3 "$out/tests.log"
python3 benchmarks/attention.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" | grep -v "^  sweep"
