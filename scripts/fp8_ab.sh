#!/usr/bin/env bash
# e4m3 forward old/new A/B at the default tiles (tune tables off on both sides), for kernel changes that
# leave the tiles alone (2026-11-22: O staged in shared memory and TMA-stored; the first block's K descales read early). Run on the GPU machine
# from the repo root with .base/ carried (scripts/make_base.sh; delete .base/build first):
#   OUT=... bash scripts/fp8_ab.sh
# FP8 GPU tests first (TESTS_K: -k, default all of test_fp8_gpu.py), then fp8_bench.py (F8ARGS) old, new,
# old, new with FLASHGEN_TUNE_TABLE=off (TABLES=on: with the tables), and fp8_compare.py's table last.
set -uo pipefail
out=${OUT:-/tmp/flashgen-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
flt='fwd_e4m3_*,fwd_bf16_hd*_noncausal_m*,fwd_bf16_hd*_causal_m*,quant_*'
flashgen build --all --filter "$flt" -j "$(nproc)" 2>&1 | tail -1
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite ./.base 2>&1 | tail -2
(cd .base && FLASHGEN_ROOT=$PWD PYTHONPATH=/tmp/oldsite python3 -m flashgen.cli build --filter "$flt" -j "$(nproc)" 2>&1 | tail -1)
timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_fp8_gpu.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
  | tee "$out/test_fp8.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
oldenv() { PYTHONPATH=/tmp/oldsite FLASHGEN_ROOT=$PWD/.base FLASHGEN_KERNEL_DIR=$PWD/.base/build "$@"; }
[ "${TABLES:-off}" = off ] && export FLASHGEN_TUNE_TABLE=off  # TABLES=on: each tree serves its own tune tables
f8=${F8ARGS:---seqlens 512,2048,16384}
for r in 1 2; do
  oldenv timeout 120 python3 scripts/fp8_bench.py --no-cudnn $f8 > "$out/f8_old$r.md" 2>&1
  timeout 120 python3 scripts/fp8_bench.py --no-cudnn $f8 > "$out/f8_new$r.md" 2>&1
done
python3 scripts/fp8_compare.py "$out"/f8_old1.md "$out"/f8_new1.md "$out"/f8_old2.md "$out"/f8_new2.md | tee "$out/f8_compare.md"
