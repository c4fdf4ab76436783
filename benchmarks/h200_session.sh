#!/usr/bin/env bash
# One device call of a part of the GPU work, each fitting the device tool's 10 minutes. Run from
# the repository root (the package is staged into /tmp/pk by stage_package.sh).
# Usage: bash benchmarks/h200_session.sh OUT_DIR PART [args]
#   tests         the GPU suite (-m gpu: kernels against the reference, the mixed-state grid,
#                 the weights' fusion test, generate on the GPU)
#   serve MODEL   benchmarks/serve.py for MODEL (Llama-2-7B: kivi2 then full; Llama-3-8B:
#                 kivi2, kivi2-mix, full), each cache in a process of its own with a time limit;
#                 rows are written as they are measured
#   attention     benchmarks/attention.py [args]
# (SASS needs no GPU: benchmarks/kernel_sass.py.)
set -u
out=${1:?out dir}
part=${2:?part}
shift 2
source benchmarks/stage_package.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.mem --format=csv | tee "$out/env.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/env.txt"
quiet() { grep -v "bfc_allocator\|TF_GPU_ALLOCATOR\|Current allocation\|^\*"; }
case "$part" in
  tests)
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -q \
      -m gpu -n 16 -p no:cacheprovider tests/ > "$out/tests.log" 2>&1
    tail -3 "$out/tests.log"
    ;;
  serve)
    model=${1:?model}
    budget=80
    grep -q H100 "$out/env.txt" && budget=70
    kvs="kivi2 full"
    [ "$model" = Llama-3-8B ] && kvs="kivi2 kivi2-mix full"
    for kv in $kvs; do
      timeout "${SERVE_TIMEOUT:-270}" python3 benchmarks/serve.py run --model "$model" \
        --budget-gb "$budget" --kvs "$kv" --requests 160 --rates 1.5 3 inf --seconds 15 \
        --layouts slot --shared-requests 0 \
        --call "${CALL:-gpu}" --out "$out" 2>&1 | quiet | tee "$out/serve_$kv.log" \
        | grep -v "^  \(prefill_row\|insert\|reset\|empty\)"
    done
    ;;
  attention)
    python3 benchmarks/attention.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" \
      | grep -v "^  sweep"
    ;;
  *)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac
