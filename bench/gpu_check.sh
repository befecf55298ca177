#!/usr/bin/env bash
# One call on the device machine: GPU-marked tests, then the benchmarks; a short table last.
# JSON lands in $OUT (and bench/results/). Usage: bash bench/gpu_check.sh [quick]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/rlcu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
status=0
timeout ${RLCU_TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider ${RLCU_GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 || status=1
for b in ${RLCU_BENCH:-kernel_bench train_step generate}; do
  echo "=== bench/$b.py"
  timeout ${RLCU_BENCH_TIMEOUT:-240} python3 bench/$b.py ${RLCU_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_$b.log" | tail -40 || status=1
done
exit $status
