#!/usr/bin/env bash
# One GPU session, as short as possible: the Triton tests compiled on CUDA, then the
# benchmark. Run from the repository root; outputs go to $OUT (default /tmp/gpu_out).
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=src
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
start=$(date +%s)
timeout "${TEST_TIMEOUT:-140}" python3 -m pytest tests/test_triton.py -q -x -p no:cacheprovider \
  -o addopts= --durations=5 > "$OUT/tests.txt" 2>&1
echo "tests rc=$? in $(( $(date +%s) - start )) s"; tail -n 25 "$OUT/tests.txt"
timeout "${BENCH_TIMEOUT:-260}" python3 benchmarks/bench_gpu.py "$@" 2>&1 | tee "$OUT/bench.txt"
echo "all done in $(( $(date +%s) - start )) s"
