#!/usr/bin/env bash
# Export a base commit's tree into .base/ (git-ignored through .git/info/exclude) for the forward
# regression check on the GPU: bash scripts/make_base.sh [COMMIT] [DIR]   (default: d59df88, the last
# commit before kernel families were made pluggable; DIR default .base, another name starting with
# .base for a second old tree in the same call: device_check.sh's BASE=DIR). Carry the folder with the
# device call.
set -euo pipefail
base=${1:-d59df88}
dir=${2:-.base}
case "$dir" in .base*) ;; *) echo "DIR must start with .base (got $dir)"; exit 2 ;; esac
case "$dir" in */*) echo "DIR must be a folder name in the checkout's root (got $dir)"; exit 2 ;; esac
cd "$(dirname "$0")/.."
mkdir -p .git/info; grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
rm -rf "$dir" && mkdir "$dir"
git archive "$base" | tar -x -C "$dir"
echo "exported $base into $dir/ ($(du -sh "$dir" | cut -f1))"
