#!/usr/bin/env bash
# One GPU session in one command: install, build every variant with all cores, run the GPU
# tests, then the benchmark (table printed last). Used with the device tool:
#   bash scripts/device_check.sh [quick|full]     (logs and CSV/PNG under $OUT when set)
set -uo pipefail
mode=${1:-full}
out=${OUT:-/tmp/flashgen-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
t0=$(date +%s)
flashgen build --all -j "$(nproc)" 2>&1 | tail -4 | tee "$out/build.log"
echo "build: $(( $(date +%s) - t0 )) s"
if [ "$mode" = quick ]; then
  timeout 300 python3 -m pytest -x -q tests/gpu/test_fwd_gpu.py -k "b9_q17 or b3_q113 or b1_q1_" 2>&1 | tail -25 | tee "$out/test.log"
  exit 0
fi
timeout 420 python3 -m pytest -q tests/gpu 2>&1 | tail -30 | tee "$out/test.log"
flashgen bench --csv "$out/bench.csv" --png "$out/bench.png" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
