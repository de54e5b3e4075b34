#!/usr/bin/env bash
# One prepared run on a GPU machine (the H200 one: Python 3.12, torch 2.11.0+cu130, nvcc 13.0, no
# internet, only this checkout): builds pagedgen._C, runs the CUDA tests, the kernel benchmark and the
# end-to-end benchmark, and writes results (JSON + text + logs) to $OUT (default ./gpu_results).
# A failing stage is reported and the next stages still run; the exit status is 1 if any failed.
#
#   bash scripts/gpu_check.sh --prepare   # dev machine, BEFORE the device call: copies what the
#                                         # end-to-end benchmark reads from ../shared (ShareGPT
#                                         # prompts and lengths, the gpt2 tokenizer; TinyStories and
#                                         # stories260K when present, ~9 MB) into .gpu_assets/, the
#                                         # names benchmarks/_workload.py looks for (git-ignored: carry it)
#   bash scripts/gpu_check.sh --dry-run   # prints the stages it would run, exits 0
#   bash scripts/gpu_check.sh             # GPU machine
#   bash scripts/gpu_check.sh --tests [FILE...]  # the tests stage alone (default: the CUDA test files)
#
# Tests: one pytest process runs the test files; when it dies inside a test (a segfault, an abort),
# that test is recorded as CRASHED and a new process runs the rest (the tests already done
# deselected), until every test has run. $OUT/tests.txt lists each test's outcome (passed, failed,
# skipped, error, CRASHED); the log names each crash.
#
# With this workplace's device tool: run(command="bash scripts/gpu_check.sh", carry=[".gpu_assets"]).
# The whole run stays under GPU_CHECK_SECONDS (default 450 s): each stage gets at most its own cap
# and never more than what is left. $OUT receives few files (the device tool brings back at most 8):
# summary.txt, gpu_check.log, tests.txt, kernels.json, kernels.txt, plus what the end-to-end
# benchmark writes there.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-./gpu_results}
BUDGET=${GPU_CHECK_SECONDS:-450}
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
GPU_TESTS="tests/test_ops_cuda.py"
[ -f tests/test_gpu_engine.py ] && GPU_TESTS="$GPU_TESTS tests/test_gpu_engine.py"
THROUGHPUT_CMD="benchmarks/throughput.py --device cuda --dtype bfloat16 --model random-1b --workload sharegpt --num-prompts 1000 --systems pagedgen --repeats 1 --out $OUT_DIR"

# name, cap in seconds, command (run by bash -c; exit status 99 = skipped, not failed)
STAGES=(
  "env|30|nvidia-smi; \$PYTHON -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))'; nvcc --version | tail -n 2"
  "build|240|TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=\$(nproc) \$PYTHON setup.py build_ext --inplace && \$PYTHON -c 'import pagedgen.ops as o; assert o.extension_available(\"cuda\"), o.extension_error(\"cuda\"); print(\"pagedgen._C has CUDA kernels\")'"
  "tests|180|run_tests $OUT_DIR/tests.txt $GPU_TESTS"
  "kernels|150|\$PYTHON benchmarks/kernels.py --out $OUT_DIR"
  "end-to-end|150|run_end_to_end"
)

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
  echo "gpu_check: would run these stages (results to $OUT_DIR, at most $BUDGET s in all):"
  for stage in "${STAGES[@]}"; do
    IFS='|' read -r name cap cmd <<< "$stage"
    [ "$cmd" = run_end_to_end ] && cmd="$THROUGHPUT_CMD (only if benchmarks/throughput.py exists and its --help lists --device; needs the sharegpt assets)"
    printf '  %-11s <= %4ss  %s\n' "$name" "$cap" "$cmd"
  done
  local entry name rel need
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

# The end-to-end benchmark is written elsewhere; run it only once it takes --device.
run_end_to_end() {
  if [ ! -f benchmarks/throughput.py ] || ! timeout 60 "$PYTHON" benchmarks/throughput.py --help 2>/dev/null | grep -q -- '--device'; then
    echo "skipped: benchmarks/throughput.py is missing or does not support --device"
    return 99  # SKIPPED
  fi
  local name
  for name in sharegpt_lengths.csv sharegpt_prompts.json gpt2-tokenizer; do
    if [ ! -e ".gpu_assets/$name" ]; then
      echo ".gpu_assets/$name missing: run 'bash scripts/gpu_check.sh --prepare' before the device call and carry .gpu_assets"
      return 1
    fi
  done
  # shellcheck disable=SC2086
  "$PYTHON" $THROUGHPUT_CMD
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
export PYTHON SHAREGPT
export PAGEDGEN_SHAREGPT_LENGTHS=$PWD/$SHAREGPT  # for the end-to-end benchmark, if it wants it
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout's pagedgen, with its in-place _C
export PYTHONUNBUFFERED=1
export -f run_end_to_end run_tests
export THROUGHPUT_CMD PYTEST_PROGRESS
mkdir -p "$OUT_DIR"
if [ "$tests_only" -eq 1 ]; then
  # shellcheck disable=SC2086
  run_tests "$OUT_DIR/tests.txt" $GPU_TESTS 2>&1 | tee "$OUT_DIR/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
LOG=$OUT_DIR/gpu_check.log
: > "$LOG"
deadline=$(( $(date +%s) + BUDGET ))
summary=()
failed=0
for stage in "${STAGES[@]}"; do
  IFS='|' read -r name cap cmd <<< "$stage"
  left=$(( deadline - $(date +%s) ))
  limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 10 ]; then
    summary+=("$(printf '%-11s FAILED: out of time (%s s left)' "$name" "$left")")
    failed=1
    continue
  fi
  echo "=== [$name] (limit ${limit}s) $cmd" | tee -a "$LOG"
  start=$(date +%s)
  timeout --kill-after=10 "$limit" bash -c "$cmd" 2>&1 | tee -a "$LOG"
  rc=$?
  took=$(( $(date +%s) - start ))
  if [ "$rc" -eq 0 ]; then
    summary+=("$(printf '%-11s ok (%s s)' "$name" "$took")")
  elif [ "$rc" -eq 99 ]; then
    summary+=("$(printf '%-11s skipped (see the log)' "$name")")
  else
    [ "$rc" -eq 124 ] && why="timed out" || why="rc=$rc"
    summary+=("$(printf '%-11s FAILED: %s (%s s)' "$name" "$why" "$took")")
    failed=1
  fi
done

{
  echo "gpu_check summary ($(date -u +%FT%TZ), results in $OUT_DIR)"
  printf '  %s\n' "${summary[@]}"
  [ -f "$OUT_DIR/kernels.txt" ] && cat "$OUT_DIR/kernels.txt"
} | tee "$OUT_DIR/summary.txt"
exit "$failed"
