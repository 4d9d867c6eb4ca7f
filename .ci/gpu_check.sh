#!/usr/bin/env bash
# `make gpu-check`: the GPU suite (tests/gpu) and benchmarks/gpu.py on a CUDA machine as it is — its own
# python (torch >= 2.11, triton >= 3.6), nothing installed, the package from this checkout. Writes one report
# file (default gpu-report.txt): versions, the pytest summary with the slowest tests, the measured error figures
# of the kernel tests (DBR_GPU_STATS) and the benchmark tables with each section's time. Exits non-zero if a test
# or a benchmark section failed or ran out of time.
#
# Time: everything within GPU_CHECK_BUDGET seconds (default 540: one 600-second device call with a margin for
# the start). The tests get at most GPU_TEST_TIMEOUT (default 300) and are then interrupted (SIGINT: pytest still
# prints its summary); the benchmark gets what is left and stops each section at its own limit (gpu.py --budget-s).
set -u
PY=${1:-python3}
REPORT=${2:-gpu-report.txt}
BUDGET=${GPU_CHECK_BUDGET:-540}
TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-300}
STATS=$(mktemp)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DBR_GPU_STATS=$STATS
{
  echo "# dbr_quant gpu-check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
} | tee "$REPORT"
echo "## tests/gpu (at most ${TEST_TIMEOUT} s)" | tee -a "$REPORT"
timeout -s INT -k 20 "$TEST_TIMEOUT" "$PY" -m pytest tests/gpu -m gpu -q -ra --durations=15 -p no:cacheprovider \
  ${GPU_PYTEST_ARGS:-} 2>&1 | tee -a "$REPORT"
tests=${PIPESTATUS[0]}
[ "$tests" -eq 124 ] && echo "tests/gpu: interrupted at ${TEST_TIMEOUT} s" | tee -a "$REPORT"
echo "## tests/gpu took ${SECONDS} s; measured kernel errors (DBR_GPU_STATS)" | tee -a "$REPORT"
sort "$STATS" | tee -a "$REPORT"
left=$((BUDGET - SECONDS))
[ "$left" -lt 30 ] && left=30  # the benchmark's own minimum: a section or two (timeout 0 would mean none)
echo "## benchmarks/gpu.py (${left} s left of ${BUDGET})" | tee -a "$REPORT"
timeout -s INT -k 20 $((left + 30)) "$PY" benchmarks/gpu.py --budget-s "$left" ${GPU_BENCH_ARGS:-} 2>&1 \
  | tee -a "$REPORT"
bench=${PIPESTATUS[0]}
rm -f "$STATS"
echo "gpu-check: tests exit $tests, benchmark exit $bench, ${SECONDS} s in all; report in $REPORT" | tee -a "$REPORT"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
