#!/usr/bin/env bash
# Wheels of the benchmark peers that the GPU machine cannot download (it reaches no package index):
# the cuDNN frontend (cuDNN's FP8 attention forward, scripts/cudnn_fp8_peer.py) for CPython 3.10-3.13,
# into .wheels/ (git-ignored). Carry `.wheels` with the device call; scripts/device_check.sh installs
# the one for its Python from there. 1.14.0 (pyproject's `peers` extra) depends on no other package
# (it loads the libcudnn that torch ships); its latest releases require nvidia-cutlass-dsl and more.
# Usage: bash scripts/fetch_peer_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .wheels
for py in 3.10 3.11 3.12 3.13; do
  python3 -m pip download -q --no-deps --only-binary :all: --python-version "$py" --platform manylinux_2_28_x86_64 \
    -d .wheels "nvidia-cudnn-frontend==1.14.0"
done
ls -la .wheels
