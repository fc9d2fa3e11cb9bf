#!/usr/bin/env bash
# A GPU machine's whole measurement in one command (under 10 minutes on an H100):
# the GPU-day check (quick matrix: dense kernels' bits and speed, graphs vs eager,
# speculation vs plain, syncs, attention kernel times), then benchmarks/gpu_bench.py,
# then the product kernel's tile sweep (benchmarks/dense_sweep.py), the attention
# kernel's tile sweep (benchmarks/attention_sweep.py) and the tests with compiled
# kernels (PAGEDTREE_TEST_CUDA=1), each for a bounded time. Reports go to OUTDIR
# (default ./gpu_day): check.json, check.txt, bench.json, bench.txt, sweep.json,
# sweep.txt, attention.json, attention.txt, tests.txt. Exit status: the check's.
#
#   scripts/gpu_day.sh [OUTDIR]
#
# Python: $PAGEDTREE_PYTHON if set, else .venv/bin/python when the checkout has one,
# else python3 (a GPU machine's own PyTorch). PAGEDTREE_CHECK_SECONDS,
# PAGEDTREE_BENCH_SECONDS, PAGEDTREE_SWEEP_SECONDS, PAGEDTREE_ATTENTION_SECONDS and
# PAGEDTREE_TEST_SECONDS bound each part (default 300, 330, 90, 120 and 120; 0 skips
# a sweep or the tests). PAGEDTREE_TEST_PATHS: what the tests run (default
# "tests/kernels tests/worker/test_cuda_graphs.py"; "tests" for the whole suite, which
# wants PAGEDTREE_TEST_SECONDS of 600 or so). A .flashinfer/site folder (scripts/pack_flashinfer.sh, carried
# to a machine without a registry) goes on PYTHONPATH: the attention sweep then times
# FlashInfer's kernels beside the tiles.
set -uo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    sed -n '2,23s/^# \{0,1\}//p' "$0"
    exit 0
  fi
done
out="${1:-gpu_day}"
mkdir -p "$out"
if [ -n "${PAGEDTREE_PYTHON:-}" ]; then
  python="$PAGEDTREE_PYTHON"
elif [ -x .venv/bin/python ]; then
  python=.venv/bin/python
else
  python=python3
fi
export PYTHONUNBUFFERED=1
if [ -d .flashinfer/site ]; then
  # Last on the path: the machine's own packages win; FlashInfer and what it lacks come from here.
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/.flashinfer/site"
  "$python" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || echo "flashinfer: does not import"
fi
"$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout "${PAGEDTREE_CHECK_SECONDS:-300}" "$python" -m pagedtree.diagnostics.gpu_check --quick --no-progress \
  --checks dense,graphs,speculation,syncs,bench --json "$out/check.json" 2>&1 | tee "$out/check.txt"
status=${PIPESTATUS[0]}
timeout "${PAGEDTREE_BENCH_SECONDS:-330}" "$python" benchmarks/gpu_bench.py --no-progress --json "$out/bench.json" \
  2>&1 | tee "$out/bench.txt"
sweep="${PAGEDTREE_SWEEP_SECONDS:-90}"
if [ "$sweep" != "0" ]; then
  timeout "$sweep" "$python" benchmarks/dense_sweep.py --json "$out/sweep.json" 2>&1 | tee "$out/sweep.txt"
fi
attention="${PAGEDTREE_ATTENTION_SECONDS:-120}"
if [ "$attention" != "0" ]; then
  timeout "$attention" "$python" benchmarks/attention_sweep.py --no-progress --json "$out/attention.json" 2>&1 \
    | tee "$out/attention.txt"
fi
seconds="${PAGEDTREE_TEST_SECONDS:-120}"
if [ "$seconds" != "0" ]; then
  # Compiles dominate a fresh machine's test run: spread them over processes where
  # pytest-xdist is installed (GPU images usually have it).
  workers=()
  if "$python" -c "import xdist" 2>/dev/null; then workers=(-n "$(( $(nproc) < 8 ? $(nproc) : 8 ))"); fi
  read -r -a test_paths <<< "${PAGEDTREE_TEST_PATHS:-tests/kernels tests/worker/test_cuda_graphs.py}"
  PAGEDTREE_TEST_CUDA=1 timeout "$seconds" "$python" -m pytest -rfE --maxfail=20 \
    ${workers[@]+"${workers[@]}"} "${test_paths[@]}" > "$out/tests.txt" 2>&1
  echo "tests (PAGEDTREE_TEST_CUDA=1, ${seconds} s at most): exit $?; $(tail -1 "$out/tests.txt")"
fi
exit "$status"
