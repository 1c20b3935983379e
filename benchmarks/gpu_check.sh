#!/usr/bin/env bash
# One GPU session, as short as possible: the benchmark (the deliverable), the window
# benchmark, then the Triton tests compiled on CUDA with the time left. Run from the
# repository root; outputs go to $OUT (default /tmp/gpu_out). BENCH_TIMEOUT,
# WINDOW_TIMEOUT and TEST_TIMEOUT bound each part.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=src
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
start=$(date +%s)
timeout "${BENCH_TIMEOUT:-250}" python3 benchmarks/bench_gpu.py "$@" 2>&1 | tee "$OUT/bench.txt"
echo "bench done at $(( $(date +%s) - start )) s"
# issue 11's GPU row: window 4096 at T = 32768 against SDPA's dense mask and Triton causal
timeout "${WINDOW_TIMEOUT:-150}" python3 benchmarks/bench_window_gpu.py 2>&1 | tee "$OUT/window.txt"
echo "window bench done at $(( $(date +%s) - start )) s"
timeout "${TEST_TIMEOUT:-120}" python3 -m pytest tests/test_triton.py -q -x -p no:cacheprovider \
  -o addopts= --durations=5 > "$OUT/tests.txt" 2>&1
echo "tests rc=$? at $(( $(date +%s) - start )) s"; tail -n 30 "$OUT/tests.txt"
