#!/usr/bin/env bash
# The GPU-day check: the Triton kernels against a float64 reference, CUDA graphs
# against eager steps, greedy tree speculation against plain decoding, syncs per
# speculative step and tree/decode kernel times, printed as one table; exit status 1
# when any check fails, 2 on bad arguments.
#
#   scripts/gpu_check.sh                          # on a GPU: the full matrix
#   scripts/gpu_check.sh --quick --json out.json  # a reduced matrix, and the table as JSON
#   scripts/gpu_check.sh --device cpu --quick     # the same checks under the Triton interpreter
#
# It sets nothing up: it runs $PAGEDTREE_PYTHON if set, else .venv/bin/python when the
# checkout has one (scripts/setup.sh makes it), else python3 (e.g. a GPU machine's own
# PyTorch). Same as `pagedtree doctor --gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PAGEDTREE_PYTHON:-}" ]; then
  python="$PAGEDTREE_PYTHON"
elif [ -x .venv/bin/python ]; then
  python=.venv/bin/python
else
  python=python3
fi
for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    sed -n '2,13s/^# \{0,1\}//p' "$0"
    echo
    break
  fi
done
exec "$python" -m pagedtree.diagnostics.gpu_check "$@"
