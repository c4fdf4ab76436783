#!/usr/bin/env bash
# One device call: GPU tests (while the kernel's PTX/SASS is dumped), then the benchmark.
# Run from a folder holding kivi_jax/ (with pallas_kernels/ copied in), tests/ and benchmarks/.
# Usage: bash benchmarks/h200_session.sh OUT_DIR [bench args...]
set -u
out=${1:?out dir}; shift
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/env.txt"
python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())" | tee -a "$out/env.txt"
# PTX / SASS of the kernel (default tuning) at Llama-2-7B 8x32k KIVI-2, in the background.
(XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_dump_to=/tmp/dump" timeout 150 python3 - <<'PY' > /tmp/dump.log 2>&1
import jax
from benchmarks.attention import SHAPES, kivi_states, kivi_step, _queries
from kivi_jax.pallas_kernels.decode_attention import GpuTuning
s = [x for x in SHAPES if x.model == "Llama-2-7B" and x.batch == 8][0]
st = kivi_states(jax.random.key(0), s, 2)[0]
for t in (GpuTuning(), GpuTuning(k_mode="dequant", v_mode="dequant")):
    jax.block_until_ready(jax.jit(kivi_step(2, t))(_queries(jax.random.key(1), s, 1)[0], st))
PY
mkdir -p /tmp/sass; i=0
for f in $(grep -l kivi_decode_attention /tmp/dump/*.ptx 2>/dev/null | head -4); do
  i=$((i+1)); cp "$f" /tmp/sass/k$i.ptx
  ptxas -arch=sm_90 -v "$f" -o /tmp/sass/k$i.cubin > /tmp/sass/ptxas$i.txt 2>&1
  cuobjdump -sass /tmp/sass/k$i.cubin > /tmp/sass/k$i.sass 2>&1
done
cp /tmp/dump.log /tmp/sass/; ls /tmp/dump > /tmp/sass/dump_listing.txt
tar czf "$out/sass.tgz" -C /tmp sass) &
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider \
  tests/test_decode_attention_kernel.py > "$out/tests.log" 2>&1; tail -3 "$out/tests.log"
wait
python3 benchmarks/attention.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" | grep -v "^  sweep"
ls -la "$out"
