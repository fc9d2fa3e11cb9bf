#!/usr/bin/env bash
# Build (once, then from a cached wheel) and install ggml for .venv's Python: llama.cpp's
# kernels, the "ggml" weight format.
#   scripts/build_ggml.sh [--isa native|avx2] [--target DIR]
# The Python bindings are ggml-python's; the ggml under them is the one llama-cpp-python
# 0.3.36 vendors (ggml 0.25: its K-quant GEMM prefills prompts about 1.2x faster than the
# ggml 0.15 that ggml-python vendors), both sdists from PyPI. Without OpenMP ggml runs
# its own thread pool, whose threads sleep between products while torch's OpenMP
# threads work. --isa native (the default) compiles for this CPU (-march=native, so
# pip's cache never holds it); --isa avx2 for AVX2, FMA and F16C without AVX-512, what
# scripts/emulate_avx2.sh runs. Under a minute on 2 cores, once per CPU, Python and ISA:
# the wheel is kept under ~/.cache/pagedtree/ggml-wheels keyed by all three. --target
# installs into DIR (pip's --target) instead of .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

isa=native
target=""
while [ $# -gt 0 ]; do
  case "$1" in
    --isa) isa="$2"; shift 2 ;;
    --target) target="$2"; shift 2 ;;
    -h|--help) sed -n '2,14s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "build_ggml.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$isa" in
  native) cmake_isa="-DGGML_NATIVE=ON"; suffix="" ;;
  avx2) cmake_isa="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF"
        suffix="-avx2" ;;
  *) echo "build_ggml.sh: --isa is native or avx2, not $isa" >&2; exit 2 ;;
esac

GGML_PYTHON=0.0.45
GGML_FROM=llama-cpp-python==0.3.36
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
key="$(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-16)-$(.venv/bin/python -c 'import sys; print("py%d%d" % sys.version_info[:2])')-ggml-from-${GGML_FROM#*==}$suffix"
if [ -n "$target" ]; then
  PIP+=(--target "$target" --upgrade)
  marker="$target/.ggml-cpu"
  installed() { [ -d "$target/ggml" ]; }
else
  PIP+=(--force-reinstall)
  marker=.venv/.ggml-cpu
  installed() { .venv/bin/python -c "import ggml" 2>/dev/null; }
fi
if installed && [ "$(cat "$marker" 2>/dev/null)" = "$key" ]; then
  exit 0
fi
wheels="${XDG_CACHE_HOME:-$HOME/.cache}/pagedtree/ggml-wheels/ggml-python-$GGML_PYTHON-$key"
if ! ls "$wheels"/ggml_python-*.whl >/dev/null 2>&1 || ! "${PIP[@]}" --no-deps "$wheels"/ggml_python-*.whl; then
  echo "[setup] building ggml-python==$GGML_PYTHON over the ggml of $GGML_FROM ($isa; under a minute)"
  rm -rf "$wheels"
  build="$(mktemp -d)"
  trap 'rm -rf "$build"' EXIT
  .venv/bin/python -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
    -d "$build/src" "ggml-python==$GGML_PYTHON" "$GGML_FROM"
  tar xzf "$build"/src/ggml_python-*.tar.gz -C "$build"
  tar xzf "$build"/src/llama_cpp_python-*.tar.gz -C "$build" --wildcards '*/vendor/llama.cpp/ggml'
  rm -rf "$build/ggml_python-$GGML_PYTHON/vendor/ggml"
  mv "$build"/llama_cpp_python-*/vendor/llama.cpp/ggml "$build/ggml_python-$GGML_PYTHON/vendor/ggml"
  CMAKE_ARGS="$cmake_isa -DGGML_OPENMP=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc 2>/dev/null || echo 2)" \
    .venv/bin/python -m pip wheel --disable-pip-version-check -q --no-cache-dir --no-deps -w "$wheels" \
    "$build/ggml_python-$GGML_PYTHON"
  "${PIP[@]}" --no-deps "$wheels"/ggml_python-*.whl
fi
echo "$key" > "$marker"
