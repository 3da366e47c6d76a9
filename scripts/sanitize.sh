#!/usr/bin/env bash
# NVIDIA compute-sanitizer over flashgen's kernels: memcheck, racecheck, synccheck and initcheck,
# each a separate run of scripts/sanitize_driver.py (small calls of every kernel family in the
# manifest, results checked on the CPU; a family with no case there fails the driver).
#
#   bash scripts/sanitize.sh                       all four tools
#   bash scripts/sanitize.sh memcheck initcheck    only these
#
# Needs: the kernels built (build/manifest.json: `flashgen build`), flashgen installed
# (`pip install -e .`), torch with CUDA, a Hopper GPU, compute-sanitizer.
# Environment: PYTHON (default python3), COMPUTE_SANITIZER (default: compute-sanitizer on PATH,
# else /usr/local/cuda/bin/compute-sanitizer), SANITIZE_TIMEOUT (seconds per tool, default 600),
# OUT (log folder, default /tmp/flashgen-out).
#
# Each tool's full output is teed into $OUT/sanitize-<tool>.log (only driver failures and the first
# sanitizer report lines are echoed live); then one line per tool: tool, exit code, its
# "ERROR SUMMARY" line (racecheck: also "RACECHECK SUMMARY"). Options: --error-exitcode 1 (any
# error found fails the tool's run), --report-api-errors no (cuda-python's start-up
# cuGetProcAddress probes would show as host API errors), racecheck --racecheck-report all (hazards
# and their analysis); memcheck and initcheck run with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so every
# tensor is its own allocation and an access past it is caught, not hidden in a cached block.
# initcheck runs with --check-api-memory-access no: it does not see TMA traffic (seen on an H200,
# compute-sanitizer 2025.3.1: a forward over a never-written k is not reported, and copying a
# forward's output to the host is reported as an uninitialised read, since the kernel stores it
# with TMA), so it checks the kernels' ordinary global loads only (combine's partials and LSEs).
# Exit status: 0 when every tool exited 0 and reported 0 errors; 1 otherwise.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-/tmp/flashgen-out}
py=${PYTHON:-python3}
limit=${SANITIZE_TIMEOUT:-600}
cs=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck synccheck initcheck)
mkdir -p "$out"
[ -x "$cs" ] || { echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 1; }
"$py" -c "import flashgen; flashgen.load_manifest()" || { echo "sanitize: no flashgen or no built kernels"; exit 1; }
"$cs" --version | tail -1

summaries=()
status=0
for tool in "${tools[@]}"; do
  args=(--tool "$tool" --error-exitcode 1 --report-api-errors no)
  envs=()
  case "$tool" in
    memcheck) envs=(PYTORCH_NO_CUDA_MEMORY_CACHING=1) ;;
    initcheck) envs=(PYTORCH_NO_CUDA_MEMORY_CACHING=1); args+=(--check-api-memory-access no) ;;
    racecheck) "$cs" --help 2>/dev/null | grep -q -- '--racecheck-report' && args+=(--racecheck-report all) ;;
    synccheck) ;;
    *) echo "sanitize: unknown tool $tool (memcheck, racecheck, synccheck, initcheck)"; exit 1 ;;
  esac
  log="$out/sanitize-$tool.log"
  echo "--- $tool: $cs ${args[*]} $py $here/sanitize_driver.py"
  t0=$(date +%s)
  env "${envs[@]}" timeout "$limit" "$cs" "${args[@]}" "$py" "$here/sanitize_driver.py" 2>&1 | tee "$log" |
    awk 'n < 40 && (/^FAIL/ || (/^========= [A-Z]/ && !/SUMMARY/)) { print; n++ }'
  rc=${PIPESTATUS[0]}
  summary=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | sed 's/^=* *//' | paste -sd ';' -)
  [ "$rc" = 124 ] && summary="timed out after ${limit} s; $summary"
  summaries+=("$(printf '%-9s exit %-3s %s (%s s)' "$tool" "$rc" "${summary:-no ERROR SUMMARY line}" "$(( $(date +%s) - t0 ))")")
  if [ "$rc" != 0 ] || ! grep -Eq '(ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: [0-9]+ hazards displayed \(0 errors)' "$log"
  then status=1; fi
done
echo "=== compute-sanitizer summary (logs: $out/sanitize-<tool>.log)"
printf '%s\n' "${summaries[@]}"
exit $status
