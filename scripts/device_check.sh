#!/usr/bin/env bash
# One GPU session in one command (used with the device tool). Logs and CSVs go under $OUT (more than 7 files: all of
# them also in $OUT/a-all.tgz, since the device tool brings back 8).
#   bash scripts/device_check.sh test      install, build every variant with all cores, GPU tests (forward, backward,
#                                          training), short forward + combine/overhead bench, short backward bench,
#                                          quantize_fp8 bandwidth (quant_bench.py), FA3 Table 3 (fp8_accuracy.py)
#   bash scripts/device_check.sh regress   forward grid of the base commit (.base/, made by scripts/make_base.sh)
#                                          and of this tree, alternated twice, same harness; table printed last
#                                          (GPU_TESTS=1: every GPU test first; FP8=1: e4m3 at 4k/16k old/new too;
#                                          REGRESS_ARGS: a sub-grid; each tree serves its own tune tables, so for a
#                                          kernel-only comparison run with FLASHGEN_TUNE_TABLE=off)
#   bash scripts/device_check.sh grid      every GPU test, the forward grid twice (bf16, fp16) with SDPA peers and the ratio
#                                          table (regress_fwd.py peers), e4m3 at 16k, host overhead per call
#   bash scripts/device_check.sh full      test, then `flashgen bench --backward` (forward and backward grids vs SDPA
#                                          cuDNN/FA2, ablation, combine; backward CSV/PNG as bench_bwd.*)
#   bash scripts/device_check.sh quantab  quantize_fp8 A/B (carry .base): the quant GPU tests, quant_bench.py of .base and this
#                                          tree alternated twice, then fp8_bench.py's e4m3 "from bf16" column (F8ARGS) the same way
#   bash scripts/device_check.sh perf      kernel-change check: FP8 + forward API GPU tests, the FP8 grid (fp8_bench.py), and a
#                                          reduced forward regression grid (bf16, hd 64/128/256, seqlen 512/2k/16k) against
#                                          .base/ (scripts/make_base.sh), alternated twice, SDPA peers in the same runs
#   bash scripts/device_check.sh tests     the host overhead per call (flash_attn_func, core launch, SDPA), then every GPU test
#                                          (TESTS_K: only those matching -k, e.g. TESTS_K=chunk for attention_chunk's)
#                                          (TESTS: files, default tests/gpu; a cold machine runs about half the suite in one call)
#                                          (the tests' timeout: TEST_TIMEOUT, capped by CALL_LIMIT, default 560 s from the start,
#                                          so that the call ends inside the tool's 600 s; the PASSED / FAILED count of the log last)
#                                          (BUILD_ALL=0, any mode: the default build set only, without the tune
#                                          candidates; over all 310 variants the suite ran past 450 s on an H200,
#                                          session 2026-12-04, against 114-164 s in earlier sessions' calls)
#   bash scripts/device_check.sh varlen    the varlen kernels' smoke (sanitize_driver.py's varlen cases, forward and backward, 90 s), their GPU tests
#                                          (TESTS_K, default "varlen_kernel or varlen_backward or packed_documents or cuda_graph"; the backlog of untested GPU tests:
#                                          TESTS_K='chunk or head_dim_v_256 or varlen or kvcache or cuda_graph'), then
#                                          scripts/varlen_bench.py twice (kernel vs composed path vs SDPA; training: the
#                                          varlen kernels both ways vs groups vs per run vs SDPA); GPU_TIME=1: then
#                                          scripts/varlen_gpu_time.py (profiler GPU time vs host time per call); EQUAL=1: then
#                                          scripts/varlen_equal_bench.py (varlen kernels vs flash_attn_func at equal lengths,
#                                          forward and backward; EQUAL_ARGS its arguments)
#   bash scripts/device_check.sh compare   this tree against .base/ in one session: the e4m3 forward (fp8_bench.py, 16k) and
#                                          the bf16 backward (bench --backward-only, 4k/16k), old, new, old, new
#                                          (F8ARGS: fp8_bench.py's arguments; BWD=0: no backward; TESTS: GPU
#                                          tests run first; VARIANTS: fp8_bench.py --variants args, this tree)
#   bash scripts/device_check.sh bwdgrid   the backward and feature GPU tests (TESTS_K), then the backward's FA3 grid (bf16) twice
#                                          with SDPA peers (SEQLENS, HEAD_DIMS, BWD_ARGS), CSVs grid1/grid2
#   bash scripts/device_check.sh bwd       backward change check: bwd GPU tests (TESTS: files, TESTS_K: -k), then the backward alone of
#                                          .base/ and this tree alternated old, new, old, new (bf16, hd 64/128/256;
#                                          SEQLENS, default 512,2048,16384; HEAD_DIMS, default 64,128,256; DTYPES), default
#                                          and deterministic, SDPA peers;
#                                          new/old table printed last (scripts/bwd_compare.py); SPLIT=1: the time
#                                          per kernel of both trees too (bwd_split.py, DTYPES' first); BWD_ARGS: more
#                                          bench arguments (e.g. --causal true); OLD_FILTER: the old tree's build filter
#                                          (default 'bwd_*,fwd_bf16*,fwd_fp16*')
#   bash scripts/device_check.sh tune      `flashgen tune` on this GPU (table and log under $OUT), then Nsight Compute
#                                          profiles of the e4m3 hd128/hd256 and bf16 hd128 forward at 16k (details page
#                                          and per-SASS-line stall samples, tarred)
#   bash scripts/device_check.sh sections  the causal forward grid with the L2 sections overridden (SECTIONS: default, MiB), twice each,
#                                          alternated, SDPA peers in every run (scripts/section_table.py prints the table)
#   bash scripts/device_check.sh prof      Nsight Compute profiles (PROFS: "name:profile_fwd.py args;..."; PROF_METRICS: more
#                                          metrics, e.g. 'regex:sm__pipe_.*_cycles_active.avg.pct_of_peak_sustained_active'),
#                                          key lines printed, details pages and per-SASS-line stall samples tarred; then
#                                          scripts/clock_probe.py for each CLOCKS entry ("profile_fwd-style args;...")
#   bash scripts/device_check.sh fp8var    FP8 GPU tests (TESTS_K: -k, default every built variant and the outliers), then
#                                          fp8_bench.py --variants twice over the variants matching MATCH (default
#                                          '*noncausal_m*'; CAUSAL no|yes|both, default no; SEQLENS default 2048,16384;
#                                          HEAD_DIMS default 64,128,256)
#   bash scripts/device_check.sh tunekeys  forward + FP8 GPU tests (TESTS_K), `flashgen tune --merge` for each TUNE_KEYS entry
#                                          (';'-separated tune options) into this GPU's table (copied to $OUT), then with it
#                                          the 16-bit sub-grid REGRESS_ARGS with SDPA peers and the e4m3 grid F8ARGS, twice each
#   bash scripts/device_check.sh fp8tune   tunekeys for e4m3 alone: forward + FP8 GPU tests (TESTS_K, default every built,
#                                          vt_global and outlier tests), `flashgen tune --dtypes e4m3 --merge` into this
#                                          GPU's table (copied to $OUT), then the e4m3 grid with it twice (F8ARGS, default 2k/16k)
#   bash scripts/device_check.sh variants  forward GPU tests (TESTS_K), then fp8_bench.py --variants --rounds ROUNDS for each dtype of
#                                          DTYPES (default e4m3,bf16) over MATCH / CAUSAL / SEQLENS / HEAD_DIMS as fp8var
#   bash scripts/device_check.sh varlenab  the varlen backward A/B (carry .base): GPU tests matching TESTS_K (none unset), then
#                                          scripts/varlen_bwd_ab.py (packed causal documents, hd 64/128/256) of .base/ and this
#                                          tree alternated twice, then (GPU_TIME=1, the default) varlen_gpu_time.py of both,
#                                          the old/new table last (OLD_FILTER, default 'varlen')
#   bash scripts/device_check.sh kvab      the kvcache kernel A/B (carry .base): test_kvcache_gpu.py (TESTS_K),
#                                          varlen_gpu_time.py --decode-only (decode and prefill steps, GPU and host us)
#                                          of .base/ and this tree alternated twice, then memcheck over the varlen_prep
#                                          cases (MEMCHECK=0: none)
#   bash scripts/device_check.sh pagedab   the paged K / V loads A/B (carry .base): sanitize_driver's varlen cases, the
#                                          varlen kernel GPU tests (TESTS_K), scripts/paged_decode.py of .base/ and this tree
#                                          alternated twice (PAGED_ARGS; OLD_FILTER default 'varlen')
#   bash scripts/device_check.sh tuneab    re-tune some keys against the shipped table: builds the candidates of TUNE_FILTER (default
#                                          the 16-bit hd64 causal tiles), `flashgen tune --merge TUNE_KEYS --rounds 3` into a copy of
#                                          this GPU's shipped table under $OUT, then regress_fwd.py over REGRESS_ARGS (default the
#                                          keys' 512-2k points) with the shipped table (old) and the new one (new) alternated
#                                          twice, SDPA peers in every run; the old/new and the peers tables last (GRID=1:
#                                          then the whole forward grid twice with the new table, its peers table last)
#   bash scripts/device_check.sh splitkv   flash_attn_func's num_splits (split-KV on the varlen kernel): the split and PackGQA GPU
#                                          tests (test_packgqa_gpu.py), the varlen / kvcache split tests (test_kvcache_gpu.py,
#                                          test_features_gpu.py: -k "split_kv or varlen_kernel_forward"), then scripts/split_bench.py twice
#                                          (num_splits 1 against 0, SDPA peers; SPLIT_ARGS, e.g. "--sweep 2,4,8,16,32
#                                          --shapes 16:8:1:2048,...": the fastest split count per row too; SPLIT_TIMEOUT
#                                          per run, default 200 s), one build (no .base); PDLAB=1: test_combine_gpu.py
#                                          too, and split_bench with FLASHGEN_PDL 0 / 1 (the combine as the split
#                                          forward's programmatic dependent) alternated twice, off / on last
#   bash scripts/device_check.sh envab     a runtime switch's A/B on one build: the GPU tests of TESTS (files; TESTS_K: -k)
#                                          first, then scripts/split_bench.py with ENV_VAR (e.g. FLASHGEN_FEW_TILE) 0 / 1
#                                          alternated twice for each ';'-separated argument set of SPLIT_SETS; the
#                                          0 / 1 table of each set last (unsplit_us and split_us)
#   bash scripts/device_check.sh decodeab  the one-warpgroup PackGQA decode tile: test_packgqa_gpu.py and test_kvcache_gpu.py
#                                          (TESTS_K), then split_bench.py (DECODE_ARGS) and paged_decode.py (PAGED_ARGS, default
#                                          pages 0, 16) with
#                                          FLASHGEN_DECODE_WG1 0 / 1 alternated twice, one build; the off / on tables last
#   bash scripts/device_check.sh cfgab     a config A/B on one machine: CFG_FILE (default configs/fwd.yaml) as it is (a) and
#                                          through CFG_SED (b), CFG_FILTER rebuilt per side, split_bench.py (DECODE_ARGS)
#                                          alternated twice (CFG_OFF=1: FLASHGEN_DECODE_WG1=0 too); the a / b table last
#   bash scripts/device_check.sh packgqaab PackGQA A/B (carry .base): test_packgqa_gpu.py, then scripts/packgqa_bench.py (PACKGQA_ARGS,
#                                          default --head-dim 64) of .base/ and this tree alternated twice (OLD_FILTER, default
#                                          'fwd_bf16_hd64*'); the rule's pick of each tree side by side last
#   bash scripts/device_check.sh tailab    the causal order's last L2 section on the same kernels: core.CAUSAL_TAIL_SECTIONS 2
#                                          (new) against 1 (old), alternated twice with SDPA peers (DTYPES, SEQLENS,
#                                          HEAD_DIMS; default bf16,fp16 / 512,1024,2048 / 64,128,256); TESTS_K: forward GPU tests first;
#                                          F8=1: then the e4m3 causal forward (fp8_bench.py) with FLASHGEN_CAUSAL_TAIL_SECTIONS 2 / 1
#   bash scripts/device_check.sh fwdchange forward kernel change check: every GPU test, then .base/ and this tree alternated
#                                          twice: the e4m3 forward (fp8_bench.py F8ARGS, default 2k/16k, each tree's tables)
#                                          and the bf16 forward sub-grid (hd 64/128/256, 512/2k/16k; REGRESS_ARGS) with SDPA
#                                          peers; the old/new table printed last (GPU_TESTS=0: no tests; TESTS_K: the
#                                          forward and FP8 GPU tests matching it instead of every GPU test; F8ARGS=none:
#                                          no e4m3 runs; OLD_FILTER: the old tree's build filter, default 'fwd_e4m3*,fwd_bf16*')
#   bash scripts/device_check.sh fp8ab     e4m3 kernel A/B (carry .base; BUILD_FILTER='fwd_e4m3_*,fwd_bf16_hd*_noncausal_m*,
#                                          fwd_bf16_hd*_causal_m*,quant_*' saves the full build): the FP8 GPU tests (TESTS_K),
#                                          then fp8_bench.py (F8ARGS, default 512/2k/16k) of .base/ and this tree alternated
#                                          twice, tune tables off (TABLES=on: each tree's own), the old/new table last
#                                          (fwdchange and fp8ab: BASE=.alt compares against another exported tree instead of .base)
#   bash scripts/device_check.sh sanity    compute-sanitizer (the nvidia-h100-x1 kind has it): synccheck over every case of
#                                          scripts/sanitize_driver.py, racecheck over the cases matching RACE (default
#                                          'bwd'), then the GPU tests (TESTS: files, default all of tests/gpu)
#   bash scripts/device_check.sh tail      the backward's unordered tail on one build: bwd GPU tests (TESTS_K: -k), then
#                                          scripts/bwd_tail_ab.py (WAVES, default 0,1,0.5; ROUNDS, default 2; TAIL_ARGS: more of its
#                                          arguments, e.g. --knob/--points) twice, its
#                                          table printed last
#   bash scripts/device_check.sh probe     per-CTA clock64 records of the backward main kernel (PATCH, PROBE_FILTER, PROBE_POINTS, PROBE_SCRIPT;
#                                          raw CSVs under $OUT), after the backward bench of BWD_ARGS twice if set
#   bash scripts/device_check.sh patchab   backward A/B of PATCHES (space-separated patch files, e.g. docs/results/bwd_end_overlap/
#                                          *.patch) against this tree, one build (no .base): each patch's bwd GPU tests (TESTS_K,
#                                          default 'determin or bwd or grad'; TEST_PATCHES: which patches, default the last), then the bench
#                                          of the tree and of each patch in turn, twice (SEQLENS, HEAD_DIMS, DTYPES, BWD_ARGS as
#                                          bwd; PATCH_FILTER rebuilt per patch, from the cache after the first round), one
#                                          bwd_compare.py table per patch (old = the tree)
#   bash scripts/device_check.sh split     the backward's time per kernel (pre, main, post) at FA3-protocol points, default then
#                                          deterministic (scripts/bwd_split.py; HEAD_DIMS, SEQLENS, DTYPES as bwd)
#   bash scripts/device_check.sh counter   scripts/counter_probe.py at each POINTS entry (';'-separated counter_probe.py
#                                          arguments, default bf16 hd256 causal 512): flash_attn_func against SDPA
#                                          cuDNN, interleaved (trees with the memset counter: also without it); OLD=1
#                                          (carry .base): the .base tree's and this tree's, alternated twice
#   bash scripts/device_check.sh trainhost the GPU tests of TESTS (TESTS_K: -k; none when TESTS is unset), then the eager training
#                                          step's host time (scripts/train_host.py: flash_attn_func forward + backward against
#                                          SDPA) of .base's package and this tree's alternated twice, both on this tree's
#                                          kernels (host-only changes: carry .base, scripts/make_base.sh)
#   bash scripts/device_check.sh decode    flash_attn_with_kvcache decode steps against the split count (scripts/decode_splits.py,
#                                          DECODE_ARGS its arguments; CUDA-graph replay over layers; BUILD_FILTER='varlen,combine'
#                                          is all it needs), the tables under $OUT/decode_splits.md, the summary printed last
#   bash scripts/device_check.sh packgqa   PackGQA and backward head_dim_v GPU tests (+ the DLPack e4m3 entry), then
#                                          scripts/packgqa_bench.py twice (packed / unpacked / SDPA on decode-like calls)
set -uo pipefail
# The old tree (.base) runs as `oldenv`: its package from /tmp/oldsite, its kernels from .base/build and,
# through FLASHGEN_ROOT=.base, its own tune tables (.base/configs/tune). Before 2026-11-22 FLASHGEN_ROOT
# was not set there, so the old side ran its default tiles while the new side ran its tables: old/new
# ratios at keys whose table tile differs from the default measured the tile too (docs/PERF.md).
# Nsight Compute profile of the kernels of profile_fwd.py's last call (its NVTX range "prof"): details page and
# per-SASS-line stall samples under /tmp/prof, key lines printed. prof NAME PROFILE_FWD_ARGS...
prof() {
  local name=$1; shift
  timeout "${PROF_TIMEOUT:-150}" ncu --clock-control none --nvtx --nvtx-include "prof/" --launch-count 4 \
    --metrics "dram__bytes_read.sum,dram__bytes_write.sum${PROF_METRICS:+,$PROF_METRICS}" \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --section InstructionStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
    --section SourceCounters -f -o "/tmp/prof/$name" python3 scripts/profile_fwd.py "$@" 2>&1 | grep -v '^==PROF==' | tail -3
  ncu -i "/tmp/prof/$name.ncu-rep" --page details > "/tmp/prof/$name.details.txt" 2>&1
  ncu -i "/tmp/prof/$name.ncu-rep" --page source --csv --print-source sass > "/tmp/prof/$name.sass.csv" 2>&1
  grep -E '^  [a-zA-Z_]|Duration|SM Frequency|Elapsed Cycles|DRAM Throughput|L2 Cache Throughput|Memory Throughput|Mem Busy|Max Bandwidth|Mem Pipes Busy|Compute \(SM\) Throughput|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|L2 Hit Rate  |dram__bytes|sm__|l1tex__|lts__' \
    "/tmp/prof/$name.details.txt" | sed "s/^/$name: /"
}

# The old tree's environment (see above); modes that compare against .base/ run their old side through it.
# BASE (fwdchange and fp8ab): another old tree's folder instead of .base (e.g. a copy of this tree with one
# template change, to compare two forms of a change in one call); its package goes to /tmp/oldsite<BASE>.
BASE=${BASE:-.base}
OLDSITE=/tmp/oldsite${BASE#.base}
oldenv() { PYTHONPATH=$OLDSITE FLASHGEN_ROOT=$PWD/$BASE FLASHGEN_KERNEL_DIR=$PWD/$BASE/build "$@"; }
# The old tree installed into $OLDSITE and its kernels matching $1 built (fwdchange, fp8ab).
old_build() {
  test -d "$BASE" || { echo "no $BASE/: run scripts/make_base.sh here first and carry it"; exit 2; }
  python3 -m pip install -q --no-deps --no-build-isolation --target "$OLDSITE" "./$BASE" 2>&1 | grep -v 'already exists' | tail -2
  (cd "$BASE" && FLASHGEN_ROOT=$PWD PYTHONPATH=$OLDSITE python3 -m flashgen.cli build --filter "$1" -j "$(nproc)" 2>&1 | tail -1)
}
# The e4m3 forward of .base and of this tree alternated old, new, old, new (fp8_bench.py with these arguments),
# then fp8_compare.py's old/new table.
f8_alternate() {
  for r in 1 2; do
    oldenv timeout 120 python3 scripts/fp8_bench.py "$@" > "$out/f8_old$r.md" 2>&1
    timeout 120 python3 scripts/fp8_bench.py "$@" > "$out/f8_new$r.md" 2>&1
  done
  python3 scripts/fp8_compare.py "$out"/f8_old1.md "$out"/f8_new1.md "$out"/f8_old2.md "$out"/f8_new2.md | tee "$out/f8_compare.md"
}

mode=${1:-test}
out=${OUT:-/tmp/flashgen-out}
# A call that runs past the device tool's 600 s limit costs all of it and loses what comes after; CALL_LIMIT (default
# 560 s from this script's start, bash's SECONDS) caps the test run's timeout (`cap N`: N, or less where the call's
# time left minus 20 s is less; at least 30), so that a slow test file ends with its log and summary, not the call.
# split_bench.py with the environment variable $1 at 0 and 1, alternated twice (more arguments: split_bench's):
# $out/$2<0|1>_<run>.csv / .md, the tables scripts/split_ab.py compares
split_alternate() {
  local var=$1 name=$2 r x
  shift 2
  for r in 1 2; do
    for x in 0 1; do
      env "$var=$x" timeout "${SPLIT_TIMEOUT:-200}" python3 scripts/split_bench.py "$@" \
        --csv "$out/$name${x}_$r.csv" > "$out/$name${x}_$r.md" 2>&1
      echo "split_bench $var=$x run $r rc $?"
    done
  done
}
cap() { local left=$(( ${CALL_LIMIT:-560} - SECONDS - 20 )); [ "$left" -lt 30 ] && left=30; echo $(( $1 < left ? $1 : left )); }
# The forward grid with SDPA peers (scripts/regress_fwd.py), once per run of GRID_RUNS (default "1 2") into
# $out/grid<run>.csv; arguments go to regress_fwd.py run (grid, and tuneab's GRID=1)
fwd_grid_runs() { for r in ${GRID_RUNS:-1 2}; do python3 scripts/regress_fwd.py run --label new --csv "$out/grid$r.csv" "$@" 2>&1 | tail -1; done; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
t_smi=$SECONDS
python3 -c "import torch, cuda.bindings, triton; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__, 'triton', triton.__version__)"
t_torch=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
# (where a cold call's time goes before the build: sessions 9-10 saw 150-190 s of wall time outside build and tests)
echo "setup: nvidia-smi ${t_smi} s, torch import $(( t_torch - t_smi )) s, pip install $(( SECONDS - t_torch )) s"
# Benchmark peers from carried wheels (scripts/fetch_peer_wheels.sh; the machine reaches no index): the cuDNN frontend
pyt=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
for w in .wheels/*-"$pyt"-*.whl; do [ -f "$w" ] && python3 -m pip install -q --no-deps --no-index "$w" 2>&1 | tail -1; done
t0=$(date +%s)
# (BUILD_ALL=0: the default build set, without the tune candidates that `--all` adds)
build_args=($([ "${BUILD_ALL:-1}" = 0 ] || echo --all) ${BUILD_FILTER:+--filter "$BUILD_FILTER"})
# A build carried from the workstation (scripts/prebuilt.py pack, carry [".prebuilt"]) replaces this one when its
# stamp is this tree's, these build arguments' and this nvcc's; any difference builds here as before.
if [ -f .prebuilt/stamp ] && [ "$(cat .prebuilt/stamp)" = "$(python3 scripts/prebuilt.py stamp "${build_args[@]}")" ]; then
  # (pack checked its SASS: marked as checked for the check below)
  mkdir -p build/fatbin && cp .prebuilt/fatbin/* build/fatbin/ && cp .prebuilt/manifest.json build/manifest.json \
    && sha256sum build/manifest.json | cut -c1-64 > build/.sass_checked
  echo "manifest: build/manifest.json carried from .prebuilt ($(ls .prebuilt/fatbin | wc -l) fatbins; stamp matches)" | tee "$out/build.log"
else
  [ -f .prebuilt/stamp ] && echo "prebuilt: .prebuilt/stamp is not this tree's / arguments' / nvcc's: building here"
  flashgen build "${build_args[@]}" -j "$(nproc)" 2>&1 | tail -3 | tee "$out/build.log"
fi
echo "build: $(( $(date +%s) - t0 )) s"
# The SASS check (cuobjdump on every fatbin, in parallel since session 16: before, one at a time, it took minutes of
# every call, warm follow-ups included); skipped when this manifest's content passed it already on this machine.
t0=$(date +%s)
sha=$(sha256sum build/manifest.json | cut -c1-64)
if [ "$(cat build/.sass_checked 2>/dev/null)" = "$sha" ]; then
  echo "sass: this manifest passed before (build/.sass_checked)"
else
  python3 -m flashgen.generator.sass build/manifest.json > "$out/sass.log" 2>&1 && echo "$sha" > build/.sass_checked
  echo "sass ok kernels: $(grep -c '^ok' "$out/sass.log"), $(grep -c '^FAIL' "$out/sass.log") failing manifest(s), $(( $(date +%s) - t0 )) s"
  grep '^FAIL' "$out/sass.log" | cut -c1-400
fi

case "$mode" in
fp8tune|tunekeys)
  # fp8tune: tunekeys for e4m3 alone (TUNE_KEYS "--dtypes e4m3"; TESTS_K default "every_built or vt_global or
  # outliers"; F8ARGS default "--seqlens 2048,16384")
  if [ "$mode" = fp8tune ]; then
    TUNE_KEYS=${TUNE_KEYS:---dtypes e4m3}
    TESTS_K=${TESTS_K:-every_built or vt_global or outliers}
    F8ARGS=${F8ARGS:---seqlens 2048,16384}
  fi
  # `flashgen tune --merge` for the keys of each TUNE_KEYS entry (';'-separated tune options, e.g. "--dtypes bf16,fp16
  # --head-dims 64 --causal false;--dtypes e4m3 --head-dims 128"; TUNE_ARGS added to each, e.g. --commit) into this
  # GPU's table (copied to $OUT), after the forward and FP8 GPU tests matching TESTS_K (default every built variant);
  # then, with that table, twice each: the 16-bit sub-grid REGRESS_ARGS with SDPA peers (regress_fwd.py peers) and
  # the e4m3 grid F8ARGS (fp8_bench.py with cuDNN's FP8); either is skipped when unset
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_fwd_gpu.py tests/gpu/test_fp8_gpu.py \
    -k "${TESTS_K:-every_built}" 2>&1 | tee "$out/test_fwd.log" | grep -E "FAILED|ERROR|Error|passed|failed" | tail -20
  slug=$(python3 -c "from flashgen import tuning, launch; print(tuning.gpu_slug(launch.device_name(0)))")
  IFS=';' read -ra keys <<< "${TUNE_KEYS:?TUNE_KEYS: tune options per key set}"
  for k in "${keys[@]}"; do
    timeout 400 flashgen tune --merge $k ${TUNE_ARGS:-} 2>&1 | tee -a "$out/tune.log" | grep -E '^\| (bf16|fp16|e4m3)|wrote|rror' | tail -40
  done
  cp "configs/tune/$slug.yaml" "$out/"
  if [ -n "${REGRESS_ARGS:-}" ]; then
    for r in 1 2; do python3 scripts/regress_fwd.py run --label new --csv "$out/grid$r.csv" $REGRESS_ARGS 2>&1 | tail -1; done
    python3 scripts/regress_fwd.py peers "$out"/grid*.csv | tee "$out/peers.txt" | tail -30
  fi
  if [ -n "${F8ARGS:-}" ]; then
    for r in 1 2; do timeout 200 python3 scripts/fp8_bench.py $F8ARGS 2>&1 | tee "$out/fp8_grid_$r.md" | grep '^|'; done
  fi
  ;;
fp8var|variants)
  # variants: the same for every dtype of DTYPES (default e4m3,bf16), the forward GPU tests of TESTS_K first, and
  # ROUNDS (default 2) timing rounds alternated over the variants within each run (fp8_bench.py --rounds)
  if [ "$mode" = fp8var ]; then tf=tests/gpu/test_fp8_gpu.py; else tf="tests/gpu/test_fwd_gpu.py tests/gpu/test_fp8_gpu.py"; fi
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider --tb=short $tf \
    -k "${TESTS_K:-every_built or outliers}" 2>&1 | tee "$out/test_fwd.log" | grep -E "FAILED|ERROR|Error|passed|failed" | tail -20
  dts=${DTYPES:-e4m3,bf16}; [ "$mode" = fp8var ] && dts=e4m3
  for dt in ${dts//,/ }; do
    timeout 280 python3 scripts/fp8_bench.py --variants --dtype "$dt" --rounds "${ROUNDS:-2}" --match "${MATCH:-*noncausal_m*}" \
      --causal "${CAUSAL:-no}" --seqlens "${SEQLENS:-2048,16384}" --head-dims "${HEAD_DIMS:-64,128,256}" 2>&1 \
      | tee "$out/variants_$dt.md" | grep '^|'
  done
  ;;
tail)
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_bwd_gpu.py \
    ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$out/test_bwd.log" | grep -E "FAILED|ERROR|Error|passed|failed" | tail -20
  for r in 1 2; do
    timeout "${BENCH_TIMEOUT:-150}" python3 scripts/bwd_tail_ab.py --waves "${WAVES:-0,1,0.5}" --rounds "${ROUNDS:-2}" ${TAIL_ARGS:-} \
      --csv "$out/tail$r.csv" > "$out/tail$r.md" 2> "$out/tail$r.log"
  done
  cat "$out"/tail1.md "$out"/tail2.md
  ;;
probe)
  # PATCH (default docs/results/bwd_4k/cta_probe.patch) applied, PROBE_FILTER (default the bf16 hd256 causal backward
  # and forward) rebuilt with it, PROBE_SCRIPT (default docs/results/bwd_persistent/bwd_cta_probe.py, the role tiles;
  # docs/results/bwd_n128_probe/ has the block_n 128 patch and script) over PROBE_POINTS (head_dim,seqlen,causal
  # ...), the raw records under $OUT; then the patch reverted and the same kernels rebuilt without it. Before it:
  # the bench of BWD_ARGS (if set) on the unpatched build, twice, with SDPA peers.
  if [ -n "${BWD_ARGS:-}" ]; then
    for r in 1 2; do
      timeout ${BENCH_TIMEOUT:-200} python3 -m flashgen.cli bench --backward-only --no-ablation --no-overhead --no-combine \
        $BWD_ARGS --csv "$out/bwd_new$r.csv" --png /tmp/n.png > "$out/bench_new$r.log" 2>&1
      echo "bench run $r: rc $?"; grep -A40 'backward TFLOP' "$out/bench_new$r.log" | tail -n +2
    done
  fi
  pf=${PROBE_FILTER:-bwd_bf16_hd256_causal_m*,fwd_bf16_hd256_causal*}
  pt=${PATCH:-docs/results/bwd_4k/cta_probe.patch}
  git apply "$pt" || patch -p1 < "$pt" || exit 3
  flashgen build --filter "$pf" -j "$(nproc)" 2>&1 | tail -1
  PROBE_DUMP=$out FLASHGEN_TUNE_TABLE=off timeout ${PROBE_TIMEOUT:-200} python3 ${PROBE_SCRIPT:-docs/results/bwd_persistent/bwd_cta_probe.py} \
    ${PROBE_POINTS:-256,2048,1 256,4096,1 256,16384,1} 2>&1 | tee "$out/probe.txt"
  git apply -R "$pt" || patch -R -p1 < "$pt"
  flashgen build --filter "$pf" -j "$(nproc)" 2>&1 | tail -1
  ;;
patchab)
  pf=${PATCH_FILTER:-bwd_*}
  with_patch() {  # $1: a patch or "" (the tree); the rest: the command, run with its kernels built
    local pt=$1 rc
    shift
    if [ -n "$pt" ]; then git apply "$pt" || exit 3; fi
    flashgen build --filter "$pf" -j "$(nproc)" 2>&1 | grep -E "FAIL|spill bytes\)$" | grep -v " 0 spill" | head -3
    "$@"; rc=$?
    if [ -n "$pt" ]; then git apply -R "$pt" || exit 3; fi
    return $rc
  }
  for p in ${TEST_PATCHES:-${PATCHES##* }}; do
    with_patch "$p" timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --tb=line tests/gpu/test_bwd_gpu.py \
      tests/gpu/test_features_gpu.py -k "${TESTS_K:-determin or bwd or grad}" > "$out/test_$(basename "$p" .patch).log" 2>&1
    echo "tests with $p: $(grep -E "passed|failed" "$out/test_$(basename "$p" .patch).log" | tail -1)"
  done
  bw="--backward-only --seqlens ${SEQLENS:-512,1024,2048} --head-dims ${HEAD_DIMS:-64,128} --dtypes ${DTYPES:-bf16} --no-ablation --no-overhead --no-combine ${BWD_ARGS:-}"
  for r in 1 2; do
    for p in "" $PATCHES; do
      name=$([ -n "$p" ] && basename "$p" .patch || echo tree)
      with_patch "$p" timeout ${BENCH_TIMEOUT:-200} python3 -m flashgen.cli bench $bw --csv "$out/bwd_${name}_$r.csv" \
        --png /tmp/b.png > "$out/bench_${name}_$r.log" 2>&1
      echo "$name run $r: rc $?"
    done
  done
  for p in $PATCHES; do
    name=$(basename "$p" .patch)
    echo "## $name / tree"
    python3 scripts/bwd_compare.py "$out/bwd_tree_1_bwd.csv" "$out/bwd_${name}_1_bwd.csv" "$out/bwd_tree_2_bwd.csv" \
      "$out/bwd_${name}_2_bwd.csv" | tee "$out/compare_$name.md" | tail -1
  done
  ;;
split)
  for dt in ${DTYPES:-bf16}; do
    for det in "" --deterministic; do
      timeout 200 python3 scripts/bwd_split.py --dtype "$dt" $det --head-dims "${HEAD_DIMS:-64,128,256}" \
        --seqlens "${SEQLENS:-512,2048,16384}" 2>&1 | tee -a "$out/bwd_split.md"
    done
  done
  ;;
packgqa)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_packgqa_gpu.py \
    tests/gpu/test_fp8_gpu.py::test_dlpack_entry_matches_flash_attn_func 2>&1 | tee "$out/test_packgqa.log" | tail -25
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu -k head_dim_v 2>&1 | tee "$out/test_hdv.log" | tail -25
  for run in 1 2; do
    timeout 200 python3 scripts/packgqa_bench.py --csv "$out/packgqa_$run.csv" 2>&1 | tee "$out/packgqa_$run.md" | tail -50
  done
  ;;
test|full)
  timeout 480 python3 -m pytest -q -p no:cacheprovider -rs --durations=10 tests/gpu 2>&1 | tee "$out/test.log" | tail -60
  # a kernel variant the tests needed and did not find (every bwd variant should be built)
  echo "missing-variant skips: $(grep -c 'MISSING-[A-Z]*-VARIANT' "$out/test.log")"
  if [ "$mode" = full ]; then
    flashgen bench --backward --csv "$out/bench.csv" --png "$out/bench.png" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
  else
    flashgen bench --seqlens 4096 --head-dims 128 --dtypes bf16 --no-ablation --csv "$out/bench.csv" --png "$out/bench.png" 2>&1 | tail -16
    flashgen bench --backward-only --seqlens 4096 --head-dims 64,128 --dtypes bf16 --csv "$out/bench.csv" --png "$out/bench.png" 2>&1 | tail -7
  fi
  python3 scripts/quant_bench.py 2>&1 | tee "$out/quant_bench.md"      # quantize_fp8 bandwidth
  python3 scripts/fp8_accuracy.py 2>&1 | tee "$out/fp8_accuracy.md"    # FA3 Table 3
  ;;
tune)
  timeout 300 flashgen tune -o "$out/tune.yaml" 2>&1 | tee "$out/tune.log" | tail -40
  mkdir -p /tmp/prof
  prof e4m3_hd128 --dtype e4m3 --head-dim 128
  prof e4m3_hd256 --dtype e4m3 --head-dim 256
  prof bf16_hd128 --dtype bf16 --head-dim 128
  prof e4m3_hd64 --dtype e4m3 --head-dim 64
  (cd /tmp/prof && tar czf "$out/profiles.tgz" *.details.txt *.sass.csv)
  ;;
counter)
  # OLD=1 (carry .base): each point alternated old, new, old, new (counter_old.md / counter_new.md), the .base
  # tree's kernels built with OLD_FILTER (default BUILD_FILTER)
  [ "${OLD:-0}" = 1 ] && old_build "${OLD_FILTER:-${BUILD_FILTER:-fwd_bf16*,fwd_fp16*}}"
  IFS=';' read -ra points <<< "${POINTS:---dtype bf16 --head-dim 256 --seqlen 512}"
  for pt in "${points[@]}"; do
    for r in 1 2; do
      [ "${OLD:-0}" = 1 ] && oldenv timeout 120 python3 scripts/counter_probe.py $pt 2>&1 | tee -a "$out/counter_old.md" | grep -E '^\||causal seqlen'
      timeout 120 python3 scripts/counter_probe.py $pt 2>&1 | tee -a "$out/counter_new.md" | grep -E '^\||causal seqlen'
      [ "${OLD:-0}" = 1 ] || break
    done
  done
  ;;
prof)
  # PROFS: profiles separated by ';', each "name:profile_fwd.py args" (--impl cudnn|fa2 for SDPA's kernel);
  # PROF_TIMEOUT: seconds per profile (default 150; SDPA's cuDNN backward at hd256 8k left no report under it,
  # cause not established: the limit is one candidate)
  mkdir -p /tmp/prof
  IFS=';' read -ra items <<< "${PROFS:-fg_hd128_c512:--dtype bf16 --head-dim 128 --causal --seqlen 512}"
  for item in "${items[@]}"; do prof "${item%%:*}" ${item#*:}; done
  (cd /tmp/prof && tar czf "$out/profiles.tgz" *.details.txt *.sass.csv)
  IFS=';' read -ra clocks <<< "${CLOCKS:-}"
  for c in "${clocks[@]}"; do timeout 60 python3 scripts/clock_probe.py $c 2>&1 | tee -a "$out/clocks.txt"; done
  ;;
sections)
  # the causal forward with the tile order's L2 sections overridden (SECTIONS: "default" = core's rule, or MiB
  # values with no cap on K/V heads; the first is the reference), each setting twice, alternated; SDPA peers in
  # every run; ratios to the first setting printed last
  g="--causal yes --dtypes ${DTYPES:-bf16} --seqlens ${SEQLENS:-512,1024,2048,4096,16384} --head-dims ${HEAD_DIMS:-64,128,256}"
  for r in 1 2; do
    for mb in ${SECTIONS:-32 16 8 4}; do
      ov=""; [ "$mb" = default ] || ov="--l2-section-mb $mb --l2-section-kv-heads 1000000"
      python3 scripts/regress_fwd.py run --label "s$mb" $ov --csv "$out/sec${mb}_$r.csv" $g 2>&1 | tail -1
    done
  done
  python3 scripts/section_table.py "$out" ${SECTIONS:-32 16 8 4} | tee "$out/sections.md"
  ;;
tailab)
  # the causal order's last L2 section (core.CAUSAL_TAIL_SECTIONS) A/B on the same kernels: 2 (new: the last two
  # sections as one) against 1 (old), alternated twice, SDPA peers in every run; new/old table last, then each
  # setting against the best SDPA backend (TESTS_K: GPU tests first, e.g. "causal_tile_claims or every_built")
  if [ -n "${TESTS_K:-}" ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_fwd_gpu.py -k "$TESTS_K" 2>&1 \
      | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  fi
  g="--causal yes --dtypes ${DTYPES:-bf16,fp16} --seqlens ${SEQLENS:-512,1024,2048} --head-dims ${HEAD_DIMS:-64,128,256}"
  for r in 1 2; do
    python3 scripts/regress_fwd.py run --label new --tail-sections 2 --csv "$out/new$r.csv" $g 2>&1 | tail -1
    python3 scripts/regress_fwd.py run --label old --tail-sections 1 --csv "$out/old$r.csv" $g 2>&1 | tail -1
  done
  python3 scripts/regress_fwd.py compare "$out"/new1.csv "$out"/old1.csv "$out"/new2.csv "$out"/old2.csv | tee "$out/regress.txt" | tail -22
  echo "== new (tail 2) against SDPA"; python3 scripts/regress_fwd.py peers "$out"/new1.csv "$out"/new2.csv | tee "$out/peers_new.txt" | tail -22
  echo "== old (tail 1) against SDPA"; python3 scripts/regress_fwd.py peers "$out"/old1.csv "$out"/old2.csv | tee "$out/peers_old.txt" | tail -22
  if [ "${F8:-0}" = 1 ]; then  # F8=1: the e4m3 causal forward the same way (fp8_bench.py kernel column, no cuDNN)
    for r in 1 2; do
      for n in 2 1; do
        echo "== e4m3 causal, tail sections $n, run $r"
        FLASHGEN_CAUSAL_TAIL_SECTIONS=$n timeout 120 python3 scripts/fp8_bench.py --causal yes --no-cudnn \
          --seqlens "${SEQLENS:-512,1024,2048}" --head-dims "${HEAD_DIMS:-64,128,256}" 2>&1 | grep '^|' | tail -9
      done
    done
  fi
  ;;
sanity)
  SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-200} OUT=$out bash scripts/sanitize.sh synccheck 2>&1 | grep --line-buffered -vE '^ok ' | tail -12
  SANITIZE_ONLY=${RACE:-bwd} SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-200} OUT=$out bash scripts/sanitize.sh racecheck 2>&1 \
    | grep --line-buffered -vE '^ok ' | tail -8
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --tb=line ${TESTS:-tests/gpu} 2>&1 | tee "$out/test.log" \
    | grep -E "FAILED|ERROR|passed|failed" | tail -15
  ;;
tests)
  # (its last line only: with a BUILD_FILTER that leaves out its non-causal hd128 variant it ends in MissingVariantError)
  python3 -c "from flashgen.bench import measure_overhead as m; print('host us/call', {k: round(v, 1) for k, v in m().items()})" 2>&1 | tail -1
  # (-v: the log names every test, so a run cut off by the call's limit shows how far it got; session 2026-12-05 (6)'s
  # cold H100 reached 48 % of the suite in the 600 s with -q, and its log could not say which files)
  timeout "$(cap "${TEST_TIMEOUT:-510}")" python3 -m pytest -v -p no:cacheprovider --tb=line ${TESTS_K:+-k "$TESTS_K"} \
    ${TESTS:-tests/gpu} 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -25
  # (cut by the timeout: no summary line; count what the -v log shows)
  echo "tests logged: $(grep -c ' PASSED' "$out/test.log") passed, $(grep -cE ' (FAILED|ERROR)' "$out/test.log") failed or errors"
  ;;
varlen)
  # the varlen kernels (core.Varlen; the backward's core.BwdVarlen, off by default until its tests pass). First the
  # sanitize_driver varlen cases alone (the forward's packed, a padded cache, cache_batch_idx + leftpad, pages; the
  # backward's three; each checked against the reference) under a short timeout, so that a hang costs 90 s, not
  # the call; then the GPU tests (-v into the log and a stack dump after 60 s in one test: a hang names its test),
  # then varlen_bench.py twice.
  echo "== smoke: sanitize_driver.py varlen cases"
  SANITIZE_ONLY=varlen timeout 90 python3 scripts/sanitize_driver.py 2>&1 | tee "$out/smoke.log" | tail -8
  echo "smoke rc ${PIPESTATUS[0]}"
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -v -p no:cacheprovider --tb=short -o faulthandler_timeout=60 \
    -k "${TESTS_K:-varlen_kernel or varlen_backward or packed_documents or cuda_graph}" tests/gpu > "$out/test.log" 2>&1
  rc=$?
  grep -E "FAILED|ERROR|Error|assert|passed|failed" "$out/test.log" | tail -25
  if [ "$rc" = 124 ]; then echo "pytest timed out; the last lines:"; tail -5 "$out/test.log"; fi
  for r in $(seq 1 "${BENCH:-2}"); do  # BENCH=0: the tests alone
    echo "== varlen_bench run $r"; timeout 150 python3 scripts/varlen_bench.py 2>&1 | tee "$out/varlen_bench_$r.md" | tail -19
  done
  if [ "${GPU_TIME:-0}" = 1 ]; then  # GPU time vs host time per call (profiler): scripts/varlen_gpu_time.py
    echo "== varlen_gpu_time"; (cd scripts && timeout 150 python3 varlen_gpu_time.py --n 10) 2>&1 | tee "$out/varlen_gpu_time.md" | tail -14
  fi
  if [ "${EQUAL:-0}" = 1 ]; then  # the varlen kernels against flash_attn_func at equal lengths: scripts/varlen_equal_bench.py
    echo "== varlen_equal_bench"; timeout 200 python3 scripts/varlen_equal_bench.py ${EQUAL_ARGS:-} 2>&1 \
      | tee "$out/varlen_equal.md" | grep -E '^\||geometric|Error'
  fi
  ;;
compare)
  test -d .base || { echo "no .base/: run scripts/make_base.sh here first and carry .base"; exit 2; }
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite ./.base 2>&1 | tail -2
  (cd .base && FLASHGEN_ROOT=$PWD PYTHONPATH=/tmp/oldsite python3 -m flashgen.cli build --filter 'fwd_e4m3*,bwd_bf16*,fwd_bf16*,quant*' -j "$(nproc)" 2>&1 | tail -1)
  if [ -n "${TESTS:-}" ]; then  # TESTS: GPU tests to pass first (correctness before timing)
    timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=line $TESTS 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  fi
  f8=${F8ARGS:---seqlens 4096,16384}; bw="--backward-only --seqlens 4096,16384 --head-dims 64,128,256 --dtypes bf16 --no-ablation"
  for r in 1 2; do
    echo "== old fp8 run $r"; oldenv python3 scripts/fp8_bench.py $f8 2>&1 | grep '^|' | tail -12
    echo "== new fp8 run $r"; python3 scripts/fp8_bench.py $f8 2>&1 | grep '^|' | tail -12
  done
  if [ -n "${VARIANTS:-}" ]; then  # VARIANTS: fp8_bench.py --variants arguments (every built e4m3 tile, this tree)
    python3 scripts/fp8_bench.py --variants $VARIANTS 2>&1 | tee "$out/fp8_variants.md" | grep '^|'
  fi
  if [ "${BWD:-1}" != 0 ]; then  # BWD=0: the e4m3 forward only
    echo "== old bwd"; oldenv python3 -m flashgen.cli bench $bw --csv "$out/bwd_old.csv" 2>&1 | tail -8
    echo "== new bwd"; python3 -m flashgen.cli bench $bw --csv "$out/bwd_new.csv" 2>&1 | tail -8
  fi
  ;;
bwdgrid)
  # the backward and feature GPU tests (TESTS_K), then the backward alone over the FA3 grid (bf16, hd 64/128/256,
  # 512-16k, causal and not; SEQLENS, HEAD_DIMS, BWD_ARGS) twice, SDPA cuDNN and FA2 in the same runs
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider --tb=line tests/gpu/test_bwd_gpu.py tests/gpu/test_features_gpu.py \
    -k "${TESTS_K:-determin or bwd or grad}" 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  for r in 1 2; do
    timeout ${BENCH_TIMEOUT:-300} python3 -m flashgen.cli bench --backward-only --no-ablation --no-overhead --no-combine \
      --seqlens "${SEQLENS:-512,1024,2048,4096,8192,16384}" --head-dims "${HEAD_DIMS:-64,128,256}" --dtypes bf16 ${BWD_ARGS:-} \
      --csv "$out/grid$r.csv" --png /tmp/g.png > "$out/grid$r.log" 2>&1
    echo "grid run $r: rc $?"; grep -A40 'backward TFLOP' "$out/grid$r.log" | tail -n +2
  done
  ;;
bwd)
  test -d .base || { echo "no .base/: run scripts/make_base.sh here first and carry .base"; exit 2; }
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite ./.base 2>&1 | tail -2
  (cd .base && FLASHGEN_ROOT=$PWD PYTHONPATH=/tmp/oldsite python3 -m flashgen.cli build --filter "${OLD_FILTER:-bwd_*,fwd_bf16*,fwd_fp16*}" -j "$(nproc)" 2>&1 | tail -1)
  if [ "${TESTS:-}" != none ]; then
    timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider --tb=line ${TESTS:-tests/gpu/test_bwd_gpu.py tests/gpu/test_features_gpu.py} \
      -k "${TESTS_K:-determin or bwd or grad}" 2>&1 \
      | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  fi
  bw="--backward-only --seqlens ${SEQLENS:-512,2048,16384} --head-dims ${HEAD_DIMS:-64,128,256} --dtypes ${DTYPES:-bf16} --no-ablation --no-overhead --no-combine ${BWD_ARGS:-}"
  for r in 1 2; do  # a hang shows as a timeout with the bench's last line in its log
    oldenv timeout ${BENCH_TIMEOUT:-200} python3 -m flashgen.cli bench $bw --csv "$out/bwd_old$r.csv" --png /tmp/o.png > "$out/bench_old$r.log" 2>&1
    echo "old run $r: rc $? $(tail -1 "$out/bench_old$r.log")"
    timeout ${BENCH_TIMEOUT:-200} python3 -m flashgen.cli bench $bw --csv "$out/bwd_new$r.csv" --png /tmp/n.png > "$out/bench_new$r.log" 2>&1
    echo "new run $r: rc $? $(tail -1 "$out/bench_new$r.log")"
  done
  if [ "${SPLIT:-0}" = 1 ]; then  # the time per kernel (pre, main, post), old then new, default and deterministic
    for det in "" --deterministic; do
      sp="--dtype ${DTYPES%%,*} $det --head-dims ${HEAD_DIMS:-64,128,256} --seqlens ${SEQLENS:-512,2048,16384}"
      oldenv timeout 200 python3 .base/scripts/bwd_split.py $sp 2>&1 | grep -E '^(\||backward)' | sed 's/^/old /' >> "$out/bwd_split.md"
      timeout 200 python3 scripts/bwd_split.py $sp 2>&1 | grep -E '^(\||backward)' | sed 's/^/new /' >> "$out/bwd_split.md"
    done
    cat "$out/bwd_split.md"
  fi
  python3 scripts/bwd_compare.py "$out"/bwd_old1_bwd.csv "$out"/bwd_new1_bwd.csv "$out"/bwd_old2_bwd.csv "$out"/bwd_new2_bwd.csv | tee "$out/bwd_compare.md"
  ;;
varlenab)
  # the varlen backward of .base/ and of this tree alternated (scripts/varlen_bwd_ab.py, both without a host read),
  # after the GPU tests matching TESTS_K (none when unset); the old/new table printed last
  old_build "${OLD_FILTER:-varlen}"
  if [ -n "${TESTS_K:-}" ]; then
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --tb=short -k "$TESTS_K" tests/gpu 2>&1 \
      | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  fi
  # (ROUNDS: old/new rounds, default 2; POINTS: varlen_bwd_ab.py --points, e.g. '128,16' for one point)
  for r in $(seq "${ROUNDS:-2}"); do
    oldenv timeout 150 python3 scripts/varlen_bwd_ab.py ${POINTS:+--points "$POINTS"} --json "$out/old$r.json" > "$out/old$r.log" 2>&1 || tail -3 "$out/old$r.log"
    timeout 150 python3 scripts/varlen_bwd_ab.py ${POINTS:+--points "$POINTS"} --json "$out/new$r.json" > "$out/new$r.log" 2>&1 || tail -3 "$out/new$r.log"
  done
  if [ "${GPU_TIME:-1}" = 1 ]; then  # profiler GPU time and host time per call, old then new (varlen_gpu_time.py)
    oldenv timeout 150 python3 scripts/varlen_gpu_time.py --n 10 > "$out/gpu_time_old.md" 2>&1
    timeout 150 python3 scripts/varlen_gpu_time.py --n 10 > "$out/gpu_time_new.md" 2>&1
    for f in old new; do echo "== gpu time, $f"; grep -E 'no host read|^GPU' "$out/gpu_time_$f.md" | cut -c1-150; done
  fi
  runs=(); for r in $(seq "${ROUNDS:-2}"); do runs+=("$out/old$r.json" "$out/new$r.json"); done
  python3 scripts/varlen_bwd_ab.py --compare "${runs[@]}" | tee "$out/varlen_bwd_ab.md"
  ;;
kvab)
  # the kvcache kernel A/B (carry .base): test_kvcache_gpu.py (TESTS_K: -k, default all), varlen_gpu_time.py
  # --decode-only (decode and prefill steps) of .base/ and this tree alternated old, new, old, new, then
  # compute-sanitizer memcheck over sanitize_driver.py's varlen_prep cases (MEMCHECK=0: none); the step rows last
  old_build "${OLD_FILTER:-varlen}"
  timeout "$(cap "${TEST_TIMEOUT:-200}")" python3 -m pytest -q -p no:cacheprovider --tb=short ${TESTS_K:+-k "$TESTS_K"} \
    tests/gpu/test_kvcache_gpu.py 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  for r in 1 2; do
    oldenv timeout 150 python3 scripts/varlen_gpu_time.py --decode-only --n 10 > "$out/kv_old$r.md" 2>&1
    timeout 150 python3 scripts/varlen_gpu_time.py --decode-only --n 10 > "$out/kv_new$r.md" 2>&1
  done
  if [ "${MEMCHECK:-1}" = 1 ]; then  # (last: a call cut by its limit loses this, not the timings)
    SANITIZE_ONLY=varlen_prep OUT="$out" timeout 200 bash scripts/sanitize.sh memcheck 2>&1 | tail -3
  fi
  for f in old1 new1 old2 new2; do
    echo "== $f"; grep -E '^\| (decode|prefill)|Error|error' "$out/kv_$f.md" | cut -c1-230
  done
  ;;
pagedab)
  # the paged K / V loads' A/B (carry .base; mask.cuh PageWalk): the sanitize_driver varlen cases (a paged cache among
  # them), the varlen kernel's GPU tests (TESTS_K, default "varlen_kernel": paged caches of 16 and 128 rows, split-KV),
  # then scripts/paged_decode.py (decode steps, pages of 16 / 64 / 256 against unpaged; PAGED_ARGS its arguments)
  # of .base/ and this tree alternated old, new, old, new; the tables last
  old_build "${OLD_FILTER:-varlen}"
  SANITIZE_ONLY=varlen timeout 90 python3 scripts/sanitize_driver.py 2>&1 | tee "$out/smoke.log" | tail -2
  timeout "$(cap "${TEST_TIMEOUT:-200}")" python3 -m pytest -q -p no:cacheprovider --tb=short -k "${TESTS_K:-varlen_kernel}" \
    tests/gpu 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  for r in 1 2; do
    oldenv timeout 120 python3 scripts/paged_decode.py ${PAGED_ARGS:-} > "$out/paged_old$r.md" 2>&1
    timeout 120 python3 scripts/paged_decode.py ${PAGED_ARGS:-} > "$out/paged_new$r.md" 2>&1
  done
  for f in old1 new1 old2 new2; do echo "== $f"; grep -E '^\| [0-9]|Error|error' "$out/paged_$f.md"; done
  ;;
fwdchange)
  old_build "${OLD_FILTER:-fwd_e4m3*,fwd_bf16*}"
  if [ -n "${TESTS_K:-}" ]; then  # the forward and FP8 GPU tests matching TESTS_K instead of every GPU test
    timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_fwd_gpu.py tests/gpu/test_fp8_gpu.py \
      -k "$TESTS_K" 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  elif [ "${GPU_TESTS:-1}" != 0 ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=line tests/gpu 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  fi
  table() { python3 -c "import torch, flashgen.tuning as t; print('$1 tune table:', t.find_table(torch.cuda.get_device_name())[0])"; }
  oldenv table old; table new
  [ "${F8ARGS:-}" = none ] || f8_alternate ${F8ARGS:---seqlens 2048,16384}
  g="${REGRESS_ARGS:---seqlens 512,2048,16384 --head-dims 64,128,256 --dtypes bf16}"
  for r in 1 2; do
    python3 scripts/regress_fwd.py run --label new $g --csv "$out/new$r.csv" 2>&1 | tail -1
    oldenv python3 scripts/regress_fwd.py run --label old $g --csv "$out/old$r.csv" 2>&1 | tail -1
  done
  python3 scripts/regress_fwd.py compare "$out"/new1.csv "$out"/old1.csv "$out"/new2.csv "$out"/old2.csv | tee "$out/regress.txt" | tail -25
  ;;
fp8ab)
  # e4m3 kernel A/B: the FP8 GPU tests (TESTS_K), then f8_alternate without the cuDNN column, tables off
  # (the default tiles) unless TABLES=on (each tree with its own tune tables)
  old_build 'fwd_e4m3_*,fwd_bf16_hd*_noncausal_m*,fwd_bf16_hd*_causal_m*,quant_*'
  timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_fp8_gpu.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | tee "$out/test_fp8.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  [ "${TABLES:-off}" = off ] && export FLASHGEN_TUNE_TABLE=off
  f8_alternate --no-cudnn ${F8ARGS:---seqlens 512,2048,16384}
  ;;
quantab)
  # quantize_fp8 A/B (carry .base; BUILD_FILTER='quant_*,fwd_e4m3_hd128*,fwd_bf16_hd128*' saves the full build): the
  # quant GPU tests, then scripts/quant_bench.py of .base and of this tree alternated twice (torch's e4m3 cast as a
  # reference row), then fp8_bench.py (F8ARGS, default hd128 non-causal at 512/2k/16k, no cuDNN column) alternated
  # twice: its "from bf16" column is quantize_fp8 + the attention; the old/new tables last
  old_build "${OLD_FILTER:-quant_*,fwd_e4m3_hd128*,fwd_bf16_hd128*}"
  timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_quant_gpu.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | tee "$out/test_quant.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  for r in 1 2; do
    oldenv timeout 120 python3 scripts/quant_bench.py > "$out/q_old$r.md" 2>&1
    timeout 120 python3 scripts/quant_bench.py > "$out/q_new$r.md" 2>&1
  done
  f8_alternate --no-cudnn ${F8ARGS:---seqlens 512,2048,16384 --head-dims 128 --causal no}
  for f in q_old1 q_new1 q_old2 q_new2; do echo "== $f"; grep -E 'host us|incoherent, block|torch cast' "$out/$f.md"; done
  ;;
perf)
  test -d .base || { echo "no .base/: run scripts/make_base.sh here first and carry .base"; exit 2; }
  timeout 240 python3 -m pytest -q -p no:cacheprovider -x --tb=line tests/gpu/test_fp8_gpu.py tests/gpu/test_api_gpu.py 2>&1 | tee "$out/test.log" | tail -8
  timeout 150 python3 scripts/fp8_bench.py --seqlens 1024,4096,16384 2>&1 | tee "$out/fp8_bench.md"
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite ./.base 2>&1 | tail -2
  (cd .base && FLASHGEN_ROOT=$PWD PYTHONPATH=/tmp/oldsite python3 -m flashgen.cli build --filter 'fwd_bf16*' -j "$(nproc)" 2>&1 | tail -1)
  g="--seqlens 512,2048,16384 --head-dims 64,128,256 --dtypes bf16"
  old() { oldenv python3 scripts/regress_fwd.py run --label old $g "$@"; }
  new() { python3 scripts/regress_fwd.py run --label new $g "$@"; }
  new --csv "$out/new1.csv" && old --csv "$out/old1.csv" && new --csv "$out/new2.csv" && old --csv "$out/old2.csv"
  python3 scripts/regress_fwd.py compare "$out"/new1.csv "$out"/old1.csv "$out"/new2.csv "$out"/old2.csv | tee "$out/regress.txt"
  ;;
trainhost)
  # a host-only change's A/B: the old package (.base) on this tree's kernels, so only the Python differs
  test -d "$BASE" || { echo "no $BASE/: run scripts/make_base.sh here first and carry it"; exit 2; }
  python3 -m pip install -q --no-deps --no-build-isolation --target "$OLDSITE" "./$BASE" 2>&1 | grep -v 'already exists' | tail -2
  if [ -n "${TESTS:-}" ]; then
    timeout "$(cap "${TEST_TIMEOUT:-400}")" python3 -m pytest -v -p no:cacheprovider --tb=line ${TESTS_K:+-k "$TESTS_K"} \
      $TESTS 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -25
    echo "tests logged: $(grep -c ' PASSED' "$out/test.log") passed, $(grep -cE ' (FAILED|ERROR)' "$out/test.log") failed or errors"
  fi
  echo "| tree | flashgen us / step | SDPA us / step | check | package |"
  for r in 1 2; do
    PYTHONPATH=$OLDSITE FLASHGEN_ROOT=$PWD/$BASE FLASHGEN_KERNEL_DIR=$PWD/build timeout 60 python3 scripts/train_host.py --label old
    timeout 60 python3 scripts/train_host.py --label new
  done 2>&1 | tee "$out/train_host.md"
  ;;
decode)
  timeout "$(cap 400)" python3 scripts/decode_splits.py ${DECODE_ARGS:-} > "$out/decode_splits.md" 2>&1
  echo "decode_splits rc $?"; grep -A40 "Each rule" "$out/decode_splits.md"; grep -E "Error|Traceback" "$out/decode_splits.md" | head -5
  ;;
grid)
  # every GPU test, then the forward grid twice (bf16 and fp16, SDPA cuDNN/FA2 in the same runs) and issue 11's ratio
  # table, the e4m3 forward at 16k, and the host overhead per call
  # (TUNE=1: `flashgen tune` first, its table under $OUT and read by the runs that follow)
  if [ -n "${TUNE:-}" ]; then
    slug=$(python3 -c "from flashgen import tune; print(tune.default_output(tune.gpu_name()).name)")
    # (TUNE_COMMIT: the commit to record: the device's copy of .git may not know the one sent)
    timeout 300 flashgen tune -o "$out/$slug" ${TUNE_COMMIT:+--commit "$TUNE_COMMIT"} > "$out/tune.log" 2>&1
    echo "tune: rc $? -> $out/$slug"
    export FLASHGEN_TUNE_TABLE="$out/$slug"
  fi
  if [ "${GPU_TESTS:-1}" != 0 ]; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=line tests/gpu 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  fi
  # (GRID_RUNS: which grid runs, default "1 2"; GPU_TESTS=0: no tests)
  fwd_grid_runs ${REGRESS_ARGS:-}
  timeout 90 python3 scripts/fp8_bench.py --seqlens 16384 2>&1 | grep '^|' | tail -8
  python3 -c "from flashgen.bench import measure_overhead as m; print('host us/call', {k: round(v, 1) for k, v in m(n=1000).items()})"
  python3 scripts/regress_fwd.py peers "$out"/grid*.csv | tee "$out/peers.txt"
  ;;
splitkv)
  timeout "$(cap "${TEST_TIMEOUT:-200}")" python3 -m pytest -q -p no:cacheprovider -rs --tb=short tests/gpu/test_packgqa_gpu.py \
    ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed|SKIP" | tail -15
  # the varlen / kvcache split path (its merge: combine.prepare_combine since session 23)
  timeout "$(cap "${TEST_TIMEOUT:-200}")" python3 -m pytest -q -p no:cacheprovider -rs --tb=short \
    tests/gpu/test_kvcache_gpu.py tests/gpu/test_features_gpu.py -k "split_kv or varlen_kernel_forward" 2>&1 \
    | tee "$out/test_varlen_split.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  if [ "${PDLAB:-0}" = 1 ]; then
    # the combine as a programmatic dependent of the split forward: the same build with FLASHGEN_PDL 0 (plain
    # stream order) and 1 alternated twice, then the public combine's tests (a pdl kernel after any kernel)
    timeout "$(cap 120)" python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_combine_gpu.py 2>&1 \
      | tee "$out/test_combine.log" | grep -E "FAILED|ERROR|passed|failed" | tail -5
    split_alternate FLASHGEN_PDL pdl ${SPLIT_ARGS:-}
    python3 scripts/split_ab.py "$out" pdl0 pdl1 --labels "PDL off,on"
  else
    for r in 1 2; do
      timeout "${SPLIT_TIMEOUT:-200}" python3 scripts/split_bench.py ${SPLIT_ARGS:-} --csv "$out/split$r.csv" > "$out/split$r.md" 2>&1
      echo "split_bench run $r rc $?"
    done
    cat "$out/split1.md"; tail -n +4 "$out/split2.md" | cut -d"|" -f2-17
  fi
  ;;
envab)
  # a runtime switch (ENV_VAR 0 / 1) on one build: tests, then split_bench.py per argument set of SPLIT_SETS
  if [ -n "${TESTS:-}" ]; then
    timeout "$(cap "${TEST_TIMEOUT:-240}")" python3 -m pytest -q -p no:cacheprovider -rs --tb=short $TESTS \
      ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  fi
  i=0
  IFS=';' read -ra sets <<< "${SPLIT_SETS:?set SPLIT_SETS}"
  for args in "${sets[@]}"; do
    i=$((i + 1))
    # (word splitting of the set's arguments is wanted here)
    # shellcheck disable=SC2086
    split_alternate "${ENV_VAR:?set ENV_VAR}" "set${i}_" $args
  done
  for j in $(seq 1 "$i"); do
    echo "== set $j: ${sets[$((j - 1))]}"
    python3 scripts/split_ab.py "$out" "set${j}_0" "set${j}_1" --columns unsplit_us,split_us --labels "$ENV_VAR=0,1"
  done
  ;;
decodeab)
  # the one-warpgroup PackGQA decode tile (core.DECODE_WG1, one build): test_packgqa_gpu.py (its decode tile tests,
  # hd64, hd128 and hd256) and test_kvcache_gpu.py (decode steps on the varlen tiles) with it on, then scripts/split_bench.py
  # (DECODE_ARGS: num_splits 1 and 0, SDPA peers) and scripts/paged_decode.py (pages 0 and 16) with
  # FLASHGEN_DECODE_WG1 0 / 1 alternated twice; the off / on tables last
  FLASHGEN_DECODE_WG1=1 timeout "$(cap "${TEST_TIMEOUT:-150}")" python3 -m pytest -q -p no:cacheprovider -rs --tb=short \
    tests/gpu/test_packgqa_gpu.py tests/gpu/test_kvcache_gpu.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  SPLIT_TIMEOUT=${SPLIT_TIMEOUT:-100} split_alternate FLASHGEN_DECODE_WG1 wg1_ ${DECODE_ARGS:---shapes \
    1:8:1:4096,4:8:1:1024,16:8:1:2048,16:4:1:8192,1:8:1:32768,8:8:4:4096,2:8:8:12000,64:8:1:2048}
  for r in 1 2; do
    for w in 0 1; do
      FLASHGEN_DECODE_WG1=$w timeout 60 python3 scripts/paged_decode.py ${PAGED_ARGS:---pages 0,16} --rounds 1 > "$out/paged_${w}_$r.md" 2>&1
    done
  done
  for f in 0_1 1_1 0_2 1_2; do echo "== paged, FLASHGEN_DECODE_WG1 run: $f"; grep -E '^\| [0-9]|rror' "$out/paged_$f.md"; done
  python3 scripts/split_ab.py "$out" wg1_0 wg1_1 --columns unsplit_us,split_us --labels "128-row tile,wg1"
  ;;
cfgab)
  # a config A/B on one machine, one build tree: side a is this tree's CFG_FILE (default configs/fwd.yaml), side b the
  # same file through CFG_SED (a sed expression); CFG_FILTER's variants rebuilt for each side (from the cache after
  # the first round); scripts/split_bench.py (DECODE_ARGS) on a and b alternated twice, with FLASHGEN_DECODE_WG1=0
  # too (CFG_OFF=1: the 128-row decode tile, once per round); the a / b (and off / a) tables last
  cfg=${CFG_FILE:-configs/fwd.yaml}
  cp "$cfg" "$out/cfg_a.yaml"
  sed "${CFG_SED:?set CFG_SED}" "$out/cfg_a.yaml" > "$out/cfg_b.yaml"
  diff "$out/cfg_a.yaml" "$out/cfg_b.yaml" | head -3
  for r in 1 2; do
    for side in a b; do
      cp "$out/cfg_$side.yaml" "$cfg"
      flashgen build --filter "${CFG_FILTER:?set CFG_FILTER}" -j "$(nproc)" 2>&1 | tail -1
      timeout "${SPLIT_TIMEOUT:-100}" python3 scripts/split_bench.py $DECODE_ARGS --csv "$out/cfg_${side}_$r.csv" \
        > "$out/cfg_${side}_$r.md" 2>&1
      echo "split_bench side $side run $r rc $?"
    done
    if [ -n "${CFG_OFF:-}" ]; then
      FLASHGEN_DECODE_WG1=0 timeout "${SPLIT_TIMEOUT:-100}" python3 scripts/split_bench.py $DECODE_ARGS \
        --csv "$out/cfg_off_$r.csv" > "$out/cfg_off_$r.md" 2>&1
      echo "split_bench FLASHGEN_DECODE_WG1=0 run $r rc $?"
    fi
  done
  cp "$out/cfg_a.yaml" "$cfg"
  [ -n "${CFG_OFF:-}" ] && python3 scripts/split_ab.py "$out" cfg_off cfg_a --columns unsplit_us,split_us --labels "wg1 off,a"
  python3 scripts/split_ab.py "$out" cfg_a cfg_b --columns unsplit_us,split_us --labels "a,b"
  ;;
packgqaab)
  old_build "${OLD_FILTER:-fwd_bf16_hd64*}"
  timeout "$(cap "${TEST_TIMEOUT:-200}")" python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_packgqa_gpu.py \
    2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
  for r in 1 2; do
    oldenv timeout 150 python3 scripts/packgqa_bench.py ${PACKGQA_ARGS:---head-dim 64} --csv "$out/packgqa_old$r.csv" > "$out/packgqa_old$r.md" 2>&1
    timeout 150 python3 scripts/packgqa_bench.py ${PACKGQA_ARGS:---head-dim 64} --csv "$out/packgqa_new$r.csv" > "$out/packgqa_new$r.md" 2>&1
  done
  python3 - "$out" <<'PY'
import csv, sys
d = sys.argv[1]
runs = {n: list(csv.DictReader(open(f"{d}/packgqa_{n}.csv"))) for n in ("old1", "new1", "old2", "new2")}
print("| seqlen_q | seqlen_k | group | causal | rule old / new | flashgen us old r1 / r2 | new r1 / r2 | old / new |")
print("|---|---|---|---|---|---|---|---|")
for i, r in enumerate(runs["old1"]):
    us = {n: float(runs[n][i]["packed_us" if runs[n][i]["rule"] == "pack" else "unpacked_us"]) for n in runs}
    print(f"| {r['seqlen_q']} | {r['seqlen_k']} | {r['group']} | {r['causal']} | {r['rule']} / {runs['new1'][i]['rule']} | "
          f"{us['old1']:.1f} / {us['old2']:.1f} | {us['new1']:.1f} / {us['new2']:.1f} | "
          f"{min(us['old1'], us['old2']) / min(us['new1'], us['new2']):.3f} |")
PY
  ;;
tuneab)
  flashgen build --all --filter "${TUNE_FILTER:-fwd_bf16_hd64_causal_m*,fwd_fp16_hd64_causal_m*}" -j "$(nproc)" 2>&1 | tail -1
  slug=$(python3 -c "from flashgen import tune; print(tune.default_output(tune.gpu_name()).name)")
  cp "configs/tune/$slug" "$out/$slug"
  timeout 300 flashgen tune --merge -o "$out/$slug" --rounds 3 \
    ${TUNE_KEYS:---dtypes bf16,fp16 --head-dims 64 --causal true --seqlens 512,1024,2048} 2>&1 \
    | tee "$out/tune.log" | grep -E '^\| (bf16|fp16|e4m3)|wrote|rror' | tail -20
  g="${REGRESS_ARGS:---dtypes bf16,fp16 --head-dims 64 --causal yes --seqlens 512,1024,2048}"
  for r in 1 2; do
    FLASHGEN_TUNE_TABLE="configs/tune/$slug" python3 scripts/regress_fwd.py run --label old --csv "$out/old$r.csv" $g 2>&1 | tail -1
    FLASHGEN_TUNE_TABLE="$out/$slug" python3 scripts/regress_fwd.py run --label new --csv "$out/new$r.csv" $g 2>&1 | tail -1
  done
  python3 scripts/regress_fwd.py compare "$out"/new1.csv "$out"/old1.csv "$out"/new2.csv "$out"/old2.csv | tee "$out/regress.txt" | tail -16
  python3 scripts/regress_fwd.py peers "$out"/new*.csv | tee "$out/peers_new.txt" | tail -16
  python3 scripts/regress_fwd.py peers "$out"/old*.csv | tee "$out/peers_old.txt" | tail -16
  if [ "${GRID:-0}" = 1 ]; then  # GRID=1: then the whole forward grid twice with the new table (no rebuild: a default
    # build here would drop the candidates' fatbins that the new table may name), SDPA peers in every run
    FLASHGEN_TUNE_TABLE="$out/$slug" fwd_grid_runs
    python3 scripts/regress_fwd.py peers "$out"/grid*.csv | tee "$out/peers_grid.txt" | tail -16
  fi
  ;;
regress)
  test -d .base || { echo "no .base/: run scripts/make_base.sh here first and carry .base"; exit 2; }
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite ./.base 2>&1 | tail -2
  (cd .base && FLASHGEN_ROOT=$PWD PYTHONPATH=/tmp/oldsite python3 -m flashgen.cli build -j "$(nproc)" 2>&1 | tail -1)
  if [ "${GPU_TESTS:-0}" != 0 ]; then  # GPU_TESTS=1 (0 or unset: none): every GPU test first (correctness before timing)
    timeout 330 python3 -m pytest -q -p no:cacheprovider --tb=line --durations=5 tests/gpu 2>&1 | tee "$out/test.log" | grep -E "FAILED|ERROR|passed|failed|s call" | tail -25
  fi
  # REGRESS_ARGS: a sub-grid, e.g. "--dtypes bf16 --head-dims 128,256"
  old() { oldenv python3 scripts/regress_fwd.py run --label old ${REGRESS_ARGS:-} "$@"; }
  new() { python3 scripts/regress_fwd.py run --label new ${REGRESS_ARGS:-} "$@"; }
  new --csv "$out/new1.csv" && old --csv "$out/old1.csv" && new --csv "$out/new2.csv" && old --csv "$out/old2.csv"
  if [ -n "${FP8:-}" ]; then  # FP8=1: the e4m3 forward at 4k/16k too, old, new, old, new
    for r in 1 2; do
      echo "== old fp8 run $r"; oldenv python3 scripts/fp8_bench.py --seqlens 4096,16384 2>&1 | grep '^|' | tail -12
      echo "== new fp8 run $r"; python3 scripts/fp8_bench.py --seqlens 4096,16384 2>&1 | grep '^|' | tail -12
    done
  fi
  python3 scripts/regress_fwd.py compare "$out"/new1.csv "$out"/old1.csv "$out"/new2.csv "$out"/old2.csv | tee "$out/regress.txt"
  ;;
esac
rc=$?
# The device tool brings back at most 8 files of $OUT (in name order): with more, they also go into one
# archive whose name sorts first (a-all.tgz), so that nothing is lost (seen 2026-12-01: the old side's CSVs
# and the test log of a `bwd` call were left out). The script's status stays the mode's.
n=$(find "$out" -type f | wc -l)
if [ "$n" -gt 7 ]; then
  (cd "$out" && tar czf /tmp/a-all.tgz . && mv /tmp/a-all.tgz a-all.tgz) && echo "outputs: $n files, all of them also in a-all.tgz"
fi
exit $rc
