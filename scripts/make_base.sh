#!/usr/bin/env bash
# Export a base commit's tree into .base/ (git-ignored through .git/info/exclude) for the forward
# regression check on the GPU: bash scripts/make_base.sh [COMMIT]   (default: d59df88, the last
# commit before kernel families were made pluggable). Carry `.base` with the device call.
set -euo pipefail
base=${1:-d59df88}
cd "$(dirname "$0")/.."
mkdir -p .git/info; grep -qx '/.base/' .git/info/exclude 2>/dev/null || echo '/.base/' >> .git/info/exclude
rm -rf .base && mkdir .base
git archive "$base" | tar -x -C .base
echo "exported $base into .base/ ($(du -sh .base | cut -f1))"
