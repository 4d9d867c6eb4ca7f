#!/usr/bin/env bash
# `make gpu-check`: the GPU suite (tests/gpu) and benchmarks/gpu.py on a CUDA machine as it is — its own
# python (torch >= 2.11, triton >= 3.6), nothing installed, the package from this checkout. Writes one report
# file (default gpu-report.txt): versions, the pytest summary, the measured error figures of the kernel tests
# (DBR_GPU_STATS) and the benchmark tables. Exits non-zero if a test or a benchmark section failed.
set -u
PY=${1:-python3}
REPORT=${2:-gpu-report.txt}
STATS=$(mktemp)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DBR_GPU_STATS=$STATS
{
  echo "# dbr_quant gpu-check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
} | tee "$REPORT"
echo "## tests/gpu" | tee -a "$REPORT"
"$PY" -m pytest tests/gpu -m gpu -q -ra -p no:cacheprovider ${GPU_PYTEST_ARGS:-} 2>&1 | tee -a "$REPORT"
tests=${PIPESTATUS[0]}
echo "## measured kernel errors (tests/gpu/test_gpu_kernels.py)" | tee -a "$REPORT"
sort "$STATS" | tee -a "$REPORT"
echo "## benchmarks/gpu.py" | tee -a "$REPORT"
"$PY" benchmarks/gpu.py ${GPU_BENCH_ARGS:-} 2>&1 | tee -a "$REPORT"
bench=${PIPESTATUS[0]}
rm -f "$STATS"
echo "gpu-check: tests exit $tests, benchmark exit $bench; report in $REPORT" | tee -a "$REPORT"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
