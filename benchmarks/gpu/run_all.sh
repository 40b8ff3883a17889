#!/usr/bin/env bash
# The GPU check and benchmark of grpo_fast in one command (under 8 minutes on an H200).
#
#   benchmarks/gpu/run_all.sh            # CUDA: kernels vs reference at real shapes, timings, JSON
#   benchmarks/gpu/run_all.sh --dry-run  # CPU: the same code paths on tiny shapes (Triton interpreter)
#
# JSON goes to $OUT (default benchmarks/results). The fused-linear and trainer-step
# benchmarks run after the kernels when their scripts exist; they get the same arguments.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
status=0
python benchmarks/gpu/bench_kernels.py --out "$OUT" "$@" || status=$?
for script in benchmarks/gpu/bench_fused_linear.py benchmarks/gpu/bench_trainer_step.py; do
    if [ -f "$script" ]; then
        python "$script" "$@" || status=$?
    fi
done
exit "$status"
