#!/usr/bin/env bash
# One prepared run on a GPU machine (the H200 one: Python 3.12, torch 2.11.0+cu130, transformers 5.17,
# nvcc 13.0, no internet, only this checkout), the run issues 31 and 35 need, in at most 540 s:
#   env         the GPU, torch, nvcc
#   build       pagedgen._C for sm_90 (TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS=nproc; 57 s on 2026-12-04) and
#               the CPU kernels of the avx2 level only (PAGEDGEN_CPU_LEVELS=avx2: every x86-64 host runs
#               it, and a level's two compilation units cannot use 16 cores; the CPU side is not measured here);
#               then random-1b's checkpoint is built in the background (39 s; nice), ready for the
#               profile and end-to-end stages
#   tests       tests/ops/test_ops_cuda.py, tests/project/test_gpu_engine.py and tests/sample/test_sampler_device.py, resumed after a crash (below)
#   kernels     benchmarks/kernels.py: the decode grid and the prefill cases, paged vs SDPA
#   profile     benchmarks/gpu_profile.py: torch.profiler over 8 decode steps of pagedgen on the
#               end-to-end workload (GPU-busy share of a step, top kernels, host gaps)
#   end-to-end  benchmarks/throughput.py, issue 35's workload: random-1b bf16, 512 ShareGPT requests,
#               greedy, ignore_eos; pagedgen, transformers static batching (batch 256) and transformers
#               generate_batch (continuous batching), in that order, under --time-limit: a system that
#               runs out of time is reported as timed out and the others keep their figures
# Stages run in that order (the most valuable first), each under its own cap (--dry-run prints the
# caps and their total) and never longer than what is left of GPU_CHECK_SECONDS (default: the caps'
# sum); the last stage, the end-to-end run, also gets the seconds the others left unused (the
# 2026-12-04 run needed 244 s for pagedgen and static alone). A failing stage is reported and the
# next stages still run; the exit status is 1 if any failed.
#
#   bash scripts/gpu_check.sh --prepare   # dev machine, BEFORE the device call: copies what the
#                                         # profile and end-to-end stages read from ../shared (ShareGPT
#                                         # prompts and lengths, the gpt2 tokenizer; TinyStories and
#                                         # stories260K when present, ~9 MB) into .gpu_assets/, the
#                                         # names benchmarks/_workload.py looks for (git-ignored: carry it)
#   bash scripts/gpu_check.sh --dry-run   # prints the stages with their caps and the total, exits 0
#   bash scripts/gpu_check.sh             # GPU machine
#   bash scripts/gpu_check.sh --tests [FILE...]  # the tests stage alone (default: the CUDA test files);
#                                         # writes tests.txt and gpu_check.log straight into $OUT
#
# Tests: one pytest process runs the test files; when it dies inside a test (a segfault, an abort),
# that test is recorded as CRASHED and a new process runs the rest (the tests already done
# deselected), until every test has run. tests.txt lists each test's outcome (passed, failed,
# skipped, error, CRASHED); the log names each crash.
#
# Results: the raw outputs (gpu_check.log, tests.txt, kernels.json/.txt, gpu_profile.json/.txt,
# throughput.json/.txt, the runners' logs under logs/, model_build.log) are written to .gpu_check/
# (git-ignored) and packed after every stage into $OUT/gpu_check.tar.gz; $OUT/summary.txt (also
# rewritten after every stage, so a run cut short still leaves one) holds the stage results and the
# kernel, profile and throughput tables. $OUT defaults to ./gpu_results. Two files: the device tool
# brings back at most 8.
#
# With this workplace's device tool, after --prepare here:
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu_assets"], timeout_s=600)
# then copy the two files into the repository (FILES = the reply's files_at):
#   d=benchmarks/results/h200/$(date -u +%F); mkdir -p $d && tar -xzf FILES/gpu_check.tar.gz -C $d && cp FILES/summary.txt $d/
# and commit that folder (benchmarks/README.md, "GPU runs").
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-./gpu_results}
RAW=.gpu_check  # the raw outputs, packed into $OUT_DIR/gpu_check.tar.gz after every stage
SHARED=${PAGEDGEN_SHARED:-../shared}
SHAREGPT=.gpu_assets/sharegpt_lengths.csv
# .gpu_assets/<name> <- $SHARED/<path>: "name|path|required" (benchmarks/_workload.py's asset() names)
ASSETS=(
  "sharegpt_lengths.csv|data/sharegpt_lengths_sarathi/sharegpt_8k_filtered_stats_llama2_tokenizer.csv|required"
  "sharegpt_prompts.json|data/sharegpt_prompts_mlenergy/ShareGPT_V3_filtered_1000.json|required"
  "gpt2-tokenizer|models/gpt2-tokenizer|required"
  "tinystories_valid_first1000.jsonl|data/tinystories_valid_first1000/tinystories_valid_first1000.jsonl|optional"
  "stories260K|models/stories260K|optional"
)
GPU_TESTS="tests/ops/test_ops_cuda.py"
[ -f tests/project/test_gpu_engine.py ] && GPU_TESTS="$GPU_TESTS tests/project/test_gpu_engine.py"
# the device sampler against the host one with the logits on the GPU (its cuda cases), grammar
# candidates included; no llguidance needed (not on the H200 image)
[ -f tests/sample/test_sampler_device.py ] && GPU_TESTS="$GPU_TESTS tests/sample/test_sampler_device.py"
MODEL=random-1b
WORKLOAD="--model $MODEL --dtype bfloat16 --device cuda --workload sharegpt --num-prompts 512"
PROFILE_CMD="benchmarks/gpu_profile.py $WORKLOAD --steps 8 --out $RAW"
# --time-limit is added at run time: the stage's limit less 15 s (throughput.py then writes its report)
THROUGHPUT_CMD="benchmarks/throughput.py $WORKLOAD --systems pagedgen,static,generate_batch --static-batch-sizes 256 --cb-attn paged|sdpa --repeats 1 --roofline-runs 3 --out $RAW"

# name, cap in seconds, command (run by bash -c with STAGE_LIMIT = its limit; exit status 99 = skipped,
# not failed). The caps add up to 540 s (tests/project/test_gpu_check.py checks it): one device call of 9 minutes.
STAGES=(
  "env|15|nvidia-smi; \$PYTHON -c 'import sys, torch, transformers; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0), \"transformers\", transformers.__version__)'; nvcc --version | tail -n 2"
  "build|85|TORCH_CUDA_ARCH_LIST=9.0 PAGEDGEN_CPU_LEVELS=avx2 MAX_JOBS=\$(nproc) \$PYTHON setup.py build_ext --inplace && \$PYTHON -c 'import pagedgen.ops as o; assert o.extension_available(\"cuda\"), o.extension_error(\"cuda\"); print(\"pagedgen._C has CUDA kernels\")'"
  "tests|75|run_tests $RAW/tests.txt $GPU_TESTS"
  "kernels|40|\$PYTHON benchmarks/kernels.py --out $RAW"
  "profile|60|run_profile"
  "end-to-end|265|run_end_to_end"
)
CAPS_TOTAL=0
for stage in "${STAGES[@]}"; do IFS='|' read -r _ cap _ <<< "$stage"; CAPS_TOTAL=$((CAPS_TOTAL + cap)); done
BUDGET=${GPU_CHECK_SECONDS:-$CAPS_TOTAL}

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

prepare() {
  local entry name rel need missing=0
  for entry in "${ASSETS[@]}"; do
    IFS='|' read -r name rel need <<< "$entry"
    if [ ! -e "$SHARED/$rel" ] && [ "$need" = required ]; then
      echo "gpu_check --prepare: $SHARED/$rel not found (set PAGEDGEN_SHARED to the shared folder)" >&2
      missing=1
    fi
  done
  [ "$missing" -eq 0 ] || return 1
  mkdir -p .gpu_assets
  for entry in "${ASSETS[@]}"; do
    IFS='|' read -r name rel need <<< "$entry"
    [ -e "$SHARED/$rel" ] || { echo "gpu_check --prepare: $SHARED/$rel not found, skipped (optional)"; continue; }
    rm -rf ".gpu_assets/$name" && cp -r "$SHARED/$rel" ".gpu_assets/$name"
    echo "gpu_check --prepare: $SHARED/$rel -> .gpu_assets/$name ($(du -sh ".gpu_assets/$name" | cut -f1))"
  done
  echo "gpu_check --prepare: done (.gpu_assets is git-ignored: carry it)"
}

dry_run() {
  echo "gpu_check: would run these stages (raw outputs in $RAW/, packed into $OUT_DIR/gpu_check.tar.gz beside $OUT_DIR/summary.txt):"
  local stage name cap cmd
  for stage in "${STAGES[@]}"; do
    IFS='|' read -r name cap cmd <<< "$stage"
    case "$cmd" in
      run_profile) cmd="$PYTHON $PROFILE_CMD (after the background build of $MODEL; needs the sharegpt assets)" ;;
      run_end_to_end) cmd="$PYTHON $THROUGHPUT_CMD --time-limit <its limit - 15> (needs the sharegpt assets)" ;;
      *) cmd=${cmd//\$PYTHON/$PYTHON} ;;
    esac
    printf '  %-11s <= %4ss  %s\n' "$name" "$cap" "$cmd"
    [ "$name" = build ] && printf '  %-11s           then in the background: %s\n' "" "$MODEL's checkpoint (benchmarks/.models/, nice; $RAW/model_build.log)"
  done
  printf '  %-11s           (the last stage also gets what the others leave unused)\n' ""
  printf '  %-11s <= %4ss  (the caps%s)\n' "total" "$CAPS_TOTAL" "$([ "$BUDGET" != "$CAPS_TOTAL" ] && echo "; GPU_CHECK_SECONDS=$BUDGET bounds the run")"
  local entry rel need
  for entry in "${ASSETS[@]}"; do
    IFS='|' read -r name rel need <<< "$entry"
    if [ -e ".gpu_assets/$name" ]; then echo "asset .gpu_assets/$name: present"; else echo "asset .gpu_assets/$name: missing ($need; run --prepare first)"; fi
  done
}

# pytest with a plugin that writes the running test's id to argv[1] (emptied when the test ends) and
# each outcome to argv[2], both at once: what a dead process leaves names its test. A failure's
# traceback is printed as it happens (and again in pytest's summary, if no crash cuts it off).
PYTEST_PROGRESS='
import sys

import pytest

current, results = sys.argv[1], sys.argv[2]


class Progress:
    def pytest_runtest_logstart(self, nodeid, location):
        with open(current, "w") as f:
            f.write(nodeid)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            outcome = "error" if report.when != "call" and report.failed else report.outcome
            with open(results, "a") as f:
                f.write(f"{outcome} {report.nodeid}\n")
            if report.failed:  # now, not in the end-of-session summary a later crash would lose
                print(f"\n{outcome.upper()} {report.nodeid} ({report.when})\n{report.longreprtext}", flush=True)

    def pytest_runtest_logfinish(self, nodeid, location):
        open(current, "w").close()


sys.exit(pytest.main(sys.argv[3:], plugins=[Progress()]))
'

# run_tests RESULTS FILE...: pytest over FILE..., resumed after each test that kills the process
# (see the header); RESULTS gets "outcome test-id" lines. Fails if a test failed or crashed.
run_tests() {
  local results=$1 current rc round=0 line crashed=()
  shift
  current=$(mktemp)
  : > "$results"
  while [ "$round" -lt 100 ]; do
    round=$((round + 1))
    local deselect=()
    while read -r _ line; do deselect+=(--deselect "$line"); done < "$results"
    : > "$current"
    "$PYTHON" -c "$PYTEST_PROGRESS" "$current" "$results" -q --tb=short -p no:cacheprovider "$@" "${deselect[@]}"
    rc=$?
    [ -s "$current" ] || break
    line=$(cat "$current")
    echo "CRASHED $line" >> "$results"
    crashed+=("$line")
    echo "[tests] the pytest process died (rc=$rc) in $line; running the remaining tests in a new one"
  done
  rm -f "$current"
  local passed failed skipped
  passed=$(grep -c '^passed ' "$results")
  failed=$(grep -c -E '^(failed|error) ' "$results")
  skipped=$(grep -c '^skipped ' "$results")
  echo "[tests] $passed passed, $failed failed, $skipped skipped, ${#crashed[@]} crashed the process (rounds: $round)"
  for line in "${crashed[@]}"; do echo "[tests] CRASHED $line"; done
  grep -E '^(failed|error) ' "$results" | sed 's/^/[tests] /'
  # pytest's own status: 0 all passed, 1 some failed, 5 nothing left to run (the last test crashed)
  [ "${#crashed[@]}" -eq 0 ] && [ "$failed" -eq 0 ] && { [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]; }
}

need_assets() {
  local name
  for name in sharegpt_lengths.csv sharegpt_prompts.json gpt2-tokenizer; do
    if [ ! -e ".gpu_assets/$name" ]; then
      echo ".gpu_assets/$name missing: run 'bash scripts/gpu_check.sh --prepare' before the device call and carry .gpu_assets"
      return 1
    fi
  done
}

# random-1b's checkpoint, built once in the background after the build stage (the profile and
# end-to-end stages wait for it; were it to fail, they build it themselves).
build_model() {
  nice -n 10 "$PYTHON" -c "import sys; sys.path.insert(0, 'benchmarks'); import _workload; print(_workload.ensure_random_model('$MODEL', 'bfloat16'))" \
    > "$RAW/model_build.log" 2>&1
  echo "exit status $?" > "$RAW/model_build.done"
}

wait_model() {
  local waited=0
  while [ ! -e "$RAW/model_build.done" ] && [ -e "$RAW/model_build.started" ]; do sleep 1; waited=$((waited + 1)); done
  [ "$waited" -gt 0 ] && echo "waited ${waited} s for the background build of $MODEL ($(cat "$RAW/model_build.done"))"
  return 0
}

run_profile() {
  need_assets || return 1
  wait_model
  # shellcheck disable=SC2086
  "$PYTHON" $PROFILE_CMD
}

run_end_to_end() {
  need_assets || return 1
  wait_model
  local IFS=' '
  # shellcheck disable=SC2086
  "$PYTHON" $THROUGHPUT_CMD --time-limit $((STAGE_LIMIT - 15))
}

# summary.txt: the stage results so far, then the tables the stages wrote
write_summary() {
  {
    echo "gpu_check summary ($(date -u +%FT%TZ); raw outputs in gpu_check.tar.gz)"
    printf '  %s\n' "${summary[@]}"
    [ -f "$RAW/kernels.txt" ] && cat "$RAW/kernels.txt"
    [ -f "$RAW/gpu_profile.txt" ] && cat "$RAW/gpu_profile.txt"
    [ -f "$RAW/throughput.txt" ] && sed -n '/^system /,$p' "$RAW/throughput.txt"
  } > "$OUT_DIR/summary.txt"
  tar -czf "$OUT_DIR/gpu_check.tar.gz" -C "$RAW" .
}

tests_only=0
case "${1:-}" in
  --prepare) prepare; exit $? ;;
  --dry-run) dry_run; exit 0 ;;
  --tests) tests_only=1; shift; [ $# -gt 0 ] && GPU_TESTS="$*" ;;
  -h|--help) usage; exit 0 ;;
  "") ;;
  *) echo "gpu_check: unknown argument $1" >&2; usage >&2; exit 2 ;;
esac

# The CUDA toolkit: setup.py finds it (CUDA_HOME if set, else the nvcc on the PATH, /usr/local/cuda*).
export PYTHON SHAREGPT RAW MODEL
export PAGEDGEN_SHAREGPT_LENGTHS=$PWD/$SHAREGPT  # for the end-to-end benchmark, if it wants it
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout's pagedgen, with its in-place _C
export PYTHONUNBUFFERED=1
export -f run_end_to_end run_profile run_tests need_assets wait_model
export THROUGHPUT_CMD PROFILE_CMD PYTEST_PROGRESS
mkdir -p "$OUT_DIR"
if [ "$tests_only" -eq 1 ]; then
  # shellcheck disable=SC2086
  run_tests "$OUT_DIR/tests.txt" $GPU_TESTS 2>&1 | tee "$OUT_DIR/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
rm -rf "$RAW" && mkdir -p "$RAW"
LOG=$RAW/gpu_check.log
: > "$LOG"
deadline=$(( $(date +%s) + BUDGET ))
summary=()
failed=0
for stage in "${STAGES[@]}"; do
  IFS='|' read -r name cap cmd <<< "$stage"
  left=$(( deadline - $(date +%s) ))
  limit=$(( cap < left ? cap : left ))
  [ "$stage" = "${STAGES[-1]}" ] && limit=$left  # the last stage also gets what the others left unused
  if [ "$limit" -lt 10 ]; then
    summary+=("$(printf '%-11s FAILED: out of time (%s s left)' "$name" "$left")")
    failed=1
    write_summary
    continue
  fi
  echo "=== [$name] (limit ${limit}s) $cmd" | tee -a "$LOG"
  start=$(date +%s)
  STAGE_LIMIT=$limit timeout --kill-after=5 "$limit" bash -c "$cmd" 2>&1 | tee -a "$LOG"
  rc=$?
  took=$(( $(date +%s) - start ))
  if [ "$rc" -eq 0 ]; then
    summary+=("$(printf '%-11s ok (%s s of %s)' "$name" "$took" "$limit")")
  elif [ "$rc" -eq 99 ]; then
    summary+=("$(printf '%-11s skipped (see the log)' "$name")")
  else
    [ "$rc" -eq 124 ] && why="timed out" || why="rc=$rc"
    summary+=("$(printf '%-11s FAILED: %s (%s s of %s)' "$name" "$why" "$took" "$limit")")
    failed=1
  fi
  if [ "$name" = build ]; then  # random-1b for the profile and end-to-end stages, while the tests run
    touch "$RAW/model_build.started"
    build_model &
  fi
  write_summary
done
wait  # the background model build, if it still runs
write_summary
cat "$OUT_DIR/summary.txt"
echo "gpu_check: $OUT_DIR/summary.txt and $OUT_DIR/gpu_check.tar.gz (copy both to benchmarks/results/h200/<date>/: see the header)"
exit "$failed"
