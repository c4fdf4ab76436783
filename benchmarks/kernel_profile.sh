#!/usr/bin/env bash
# Nsight Compute profile of the decode kernels (H200; run from the repository root, as
# h200_session.sh does). Usage: bash benchmarks/kernel_profile.sh OUT_DIR [kernel_profile.py args]
# Writes OUT_DIR/profile.ncu-rep, details.txt (every section, every launch) and raw.csv.
set -u -o pipefail
out=$(realpath -m "${1:?out dir}"); shift
mkdir -p "$out"
source benchmarks/stage_package.sh
# No command buffers (CUDA graphs): each kernel is its own launch.
export XLA_FLAGS="--xla_gpu_enable_command_buffer=" XLA_PYTHON_CLIENT_PREALLOCATE=false
command -v ncu > /dev/null || export PATH="$PATH:$(ls -d /opt/nvidia/nsight-compute/* | tail -1)"
ncu --version | tail -1 | tee "$out/ncu_version.txt"
ncu --clock-control none --kernel-name regex:kivi --set full --import-source no \
  -o "$out/profile" -f python3 benchmarks/kernel_profile.py "$@" 2>&1 | tail -20
ncu --import "$out/profile.ncu-rep" --page details > "$out/details.txt"
ncu --import "$out/profile.ncu-rep" --page raw --csv > "$out/raw.csv"
# Per-instruction SASS with stall samples, one file per kernel name (every launch of it).
for k in kivi_scores kivi_values; do
  ncu --import "$out/profile.ncu-rep" --page source --csv --print-source sass \
    --kernel-name "$k" > "$out/source_$k.csv" 2>> "$out/source.log" || true
done
cat "$out/ncu_version.txt" >> "$out/source.log" && rm "$out/ncu_version.txt"
gzip -f "$out"/*.csv "$out/details.txt" "$out/profile.ncu-rep"
ls -la "$out"
