#!/usr/bin/env bash
# The wheels a GPU machine's image lacks for pagedtree, downloaded here for that
# machine's Python (no GPU needed), to carry over with the checkout.
#
# A GPU image brings its own torch, Triton, transformers, NumPy, numba, ONNX Runtime,
# aiohttp, pytest and hypothesis (the nvidia-h200 image: Python 3.12, torch 2.11,
# Triton 3.6), but not gguf, xgrammar and jsonschema, nor what xgrammar and
# jsonschema need (pydantic, apache-tvm-ffi, referencing, rpds-py): without them the
# structured-output tests cannot even be collected there. Nor the clients the serving
# tests drive (openai, text-generation, and what they need). This writes those wheels
# to OUTDIR; on the GPU machine they install beside its own packages, none of them
# replaced:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site OUTDIR/*.whl
#   export PYTHONPATH=/tmp/site
#
#   scripts/pack_gpu_wheels.sh [OUTDIR]      # default .whl (git-ignored)
#
# Environment: PAGEDTREE_GPU_PYTHON (the GPU machine's Python, default 3.12),
# PAGEDTREE_GPU_WHEELS (the requirements, default below: the versions tested here).
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    sed -n '2,19s/^# \{0,1\}//p' "$0"
    exit 0
  fi
done
out="${1:-.whl}"
target_python="${PAGEDTREE_GPU_PYTHON:-3.12}"
wheels="${PAGEDTREE_GPU_WHEELS:-gguf==0.19.0 xgrammar==0.2.9 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
referencing==0.37.0 rpds-py==2026.9.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
typing-inspection==0.4.5 apache-tvm-ffi==0.1.15.post2 openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2
httpcore2==2.16.2 truststore==0.10.5 text-generation==0.7.0}"
python=.venv/bin/python
[ -x "$python" ] || python=python3
tag="${target_python/./}"
mkdir -p "$out"
# One version of each project: an older wheel of a project beside a newer one makes
# the install on the GPU machine refuse both.
for requirement in $wheels; do
  name="${requirement%%[=<>]*}"
  find "$out" -maxdepth 1 -iname "$(echo "$name" | tr - _)-*.whl" ! -iname "$(echo "$requirement" | tr - _ | sed 's/==/-/')-*.whl" -delete
done
# shellcheck disable=SC2086
"$python" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
  --python-version "$target_python" --implementation cp --abi "cp$tag" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$out" $wheels
echo "[pack_gpu_wheels] $(find "$out" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$out" | cut -f1), in $out"
