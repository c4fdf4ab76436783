#!/usr/bin/env bash
# One device call: the GPU tests, then the benchmark. Run from the repository root (the package
# is staged into /tmp/pk by stage_package.sh).
# Usage: bash benchmarks/h200_session.sh OUT_DIR [attention.py args]
# (SASS needs no GPU: benchmarks/kernel_sass.py.)
set -u
out=${1:?out dir}; shift
source benchmarks/stage_package.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.mem --format=csv | tee "$out/env.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/env.txt"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu \
  -n 16 -p no:cacheprovider tests/ \
  > "$out/tests.log" 2>&1
tail -3 "$out/tests.log"
python3 benchmarks/attention.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" | grep -v "^  sweep"
