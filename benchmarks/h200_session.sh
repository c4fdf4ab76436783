#!/usr/bin/env bash
# One device call: GPU tests, the benchmark (+ tuning sweep), and the kernel's PTX/SASS.
# Run from a folder holding kivi_jax/ (with pallas_kernels/ copied in), tests/ and benchmarks/.
# Usage: bash benchmarks/h200_session.sh OUT_DIR [bench args...]
set -u
out=${1:?out dir}; shift
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/env.txt"
python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())" | tee -a "$out/env.txt"
timeout 300 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_decode_attention_kernel.py \
  2>&1 | tail -40 > "$out/tests.log"; tail -5 "$out/tests.log"
timeout 100 python3 -m pytest -q -m "not gpu" -n 8 -p no:cacheprovider tests/test_decode_attention_kernel.py \
  2>&1 | tail -3 >> "$out/tests.log"; tail -1 "$out/tests.log"
unset XLA_PYTHON_CLIENT_PREALLOCATE
python3 benchmarks/attention.py --out "$out" "$@" 2>&1 | grep -v "^  sweep" | tee "$out/bench.log" | tail -60
# PTX / SASS of the kernel at Llama-3-8B 8x32k KIVI-2.
XLA_FLAGS="--xla_dump_to=/tmp/dump" timeout 120 python3 - <<'PY' > /dev/null 2>&1
import jax, jax.numpy as jnp
from benchmarks.attention import SHAPES, kivi_states, kivi_step, _queries
from kivi_jax.pallas_kernels.decode_attention import GpuTuning
s = [x for x in SHAPES if x.model == "Llama-3-8B" and x.batch == 8][0]
st = kivi_states(jax.random.key(0), s, 2)[0]
jax.block_until_ready(jax.jit(kivi_step(2, GpuTuning()))(_queries(jax.random.key(1), s, 1)[0], st))
PY
mkdir -p /tmp/sass
for f in $(grep -l kivi_decode_attention /tmp/dump/*.ptx 2>/dev/null | head -2); do
  cp "$f" /tmp/sass/
  ptxas -arch=sm_90 -v "$f" -o /tmp/sass/k.cubin 2>&1 | grep -B1 -A3 kivi | head -20 > /tmp/sass/ptxas.txt
  cuobjdump -sass /tmp/sass/k.cubin > /tmp/sass/kernel.sass 2>&1
done
ls /tmp/dump | head -50 > /tmp/sass/dump_listing.txt
tar czf "$out/sass.tgz" -C /tmp sass && ls -la "$out"
