#!/usr/bin/env bash
# FlashInfer for a GPU machine that cannot reach a package registry, built here.
#
# Downloads FlashInfer 0.5.3 and CUDA 13.0's compiler from PyPI, compiles ahead of
# time, for the GPU architecture asked, the kernels the FlashInfer attention backend
# calls (batch decode, FA2 batch prefill and the mask packing, for the dtypes and
# head dims asked) and FlashInfer's rotary, and writes a folder of Python packages
# to put on the GPU machine's PYTHONPATH: FlashInfer with its compiled kernels (its
# CUTLASS sources left out), apache-tvm-ffi for that machine's Python, FlashInfer's
# small pure-Python dependencies, and Liger's Triton kernels (the GPU-day check times
# both libraries' norm and rotary beside the engine's). No GPU is needed here;
# downloads and compiles are cached.
#
#   scripts/pack_flashinfer.sh [OUTDIR]      # default .flashinfer (git-ignored)
#
# Environment: PAGEDTREE_FI_ARCH (default "9.0a": H100/H200), PAGEDTREE_FI_DTYPES
# (default "bf16"), PAGEDTREE_FI_HEAD_DIMS (default "128 64"), PAGEDTREE_FI_PYTHON
# (the GPU machine's Python, default 3.12), PAGEDTREE_CACHE (default ~/.cache/pagedtree).
# scripts/gpu_day.sh puts .flashinfer/site (the default OUTDIR) on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    sed -n '2,19s/^# \{0,1\}//p' "$0"
    exit 0
  fi
done
out="${1:-.flashinfer}"
arch="${PAGEDTREE_FI_ARCH:-9.0a}"
dtypes="${PAGEDTREE_FI_DTYPES:-bf16}"
head_dims="${PAGEDTREE_FI_HEAD_DIMS:-128 64}"
target_python="${PAGEDTREE_FI_PYTHON:-3.12}"
version=0.5.3
tvm_ffi=0.1.15.post2
cache="${PAGEDTREE_CACHE:-$HOME/.cache/pagedtree}/flashinfer-$version"
python=.venv/bin/python
[ -x "$python" ] || python=python3
mkdir -p "$cache/wheels" "$cache/cuda-wheels"

echo "== downloads (cached in $cache)"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$python" -m pip download -q --no-deps --only-binary=:all: -d "$cache/cuda-wheels" "${platforms[@]}" \
  "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" \
  "nvidia-cuda-crt==13.0.*"
# FlashInfer's imports beyond torch and numpy (a GPU image has those two), and Liger's
# Triton kernels (pure Python), which the GPU-day check also times beside the engine's.
pure=("flashinfer-python==$version" einops tabulate nvidia-ml-py click packaging requests urllib3 idna certifi
      charset-normalizer tqdm "liger-kernel==0.8.5")

echo "== CUDA 13.0's compiler"
cuda="$cache/cuda"
if [ ! -x "$cuda/nvidia/cu13/bin/nvcc" ]; then
  rm -rf "$cuda" && mkdir -p "$cuda"
  for wheel in "$cache"/cuda-wheels/*.whl; do "$python" -m zipfile -e "$wheel" "$cuda"; done
  chmod +x "$cuda"/nvidia/cu13/bin/* "$cuda"/nvidia/cu13/nvvm/bin/*
fi
cuda_home="$cuda/nvidia/cu13"
ln -sfn lib "$cuda_home/lib64"
ln -sf libcudart.so.13 "$cuda_home/lib/libcudart.so"
if [ ! -e "$cuda_home/lib/stubs/libcuda.so" ]; then
  # The driver's library is the GPU machine's; linking needs only its name.
  mkdir -p "$cuda_home/lib/stubs"
  echo "" > "$cache/empty.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda_home/lib/stubs/libcuda.so" "$cache/empty.c"
fi

echo "== FlashInfer $version for the build (this machine's Python)"
build_site="$cache/build-site"
if [ ! -d "$build_site/flashinfer" ]; then
  "$python" -m pip install -q --no-deps --target "$build_site" "${pure[@]}" "apache-tvm-ffi==$tvm_ffi"
fi

echo "== compiling for sm_$arch: dtypes $dtypes, head dims $head_dims (a minute or two each, cached)"
CUDA_HOME="$cuda_home" PATH="$cuda_home/bin:$PATH" FLASHINFER_CUDA_ARCH_LIST="$arch" \
  FLASHINFER_WORKSPACE_BASE="$cache/workspace" PYTHONPATH="$build_site" \
  PAGEDTREE_FI_DTYPES="$dtypes" PAGEDTREE_FI_HEAD_DIMS="$head_dims" \
  "$python" - <<'EOF'
import os, time

import torch
from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
from flashinfer.jit.quantization import gen_quantization_module
from flashinfer.jit.rope import gen_rope_module

dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The mask packing the prefill plan calls, and the rotary the GPU-day check times
# beside the engine's own kernel. (FlashInfer's norm module includes cuBLASLt's
# headers, whose wheel is half a gigabyte: not built here.)
specs = [gen_quantization_module(), gen_rope_module()]
for name in os.environ["PAGEDTREE_FI_DTYPES"].split():
    dtype = dtypes[name]
    for head_dim in (int(d) for d in os.environ["PAGEDTREE_FI_HEAD_DIMS"].split()):
        # The arguments FlashInfer's wrappers derive from the backend's plans: int32
        # indices, no rotary, no sliding window, no soft cap, fp32 QK reduction.
        specs.append(gen_batch_decode_module(dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False))
        specs.append(gen_batch_prefill_module("fa2", dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0,
                                              False, False, False))
for spec in specs:
    start = time.time()
    spec.build(verbose=False)
    print(f"  {spec.name}: {time.time() - start:.0f} s", flush=True)
with open(os.path.join(os.environ["FLASHINFER_WORKSPACE_BASE"], "modules.txt"), "w") as f:
    f.write("\n".join(spec.name for spec in specs) + "\n")
EOF

echo "== packing $out/site for Python $target_python"
rm -rf "$out" && mkdir -p "$out/site"
"$python" -m pip install -q --no-deps --only-binary=:all: --python-version "$target_python" --implementation cp \
  "${platforms[@]}" --target "$out/site" "${pure[@]}" "apache-tvm-ffi==$tvm_ffi"
# Without its headers FlashInfer compiles nothing there (the folder must stay small
# beside the checkout): the kernels used are in data/aot, where it looks first. Its
# csrc stays: it reads its templates from there even for the kernels built here.
rm -rf "$out/site/flashinfer/data/cutlass" "$out/site/flashinfer/data/spdlog" \
  "$out/site/flashinfer/data/include" "$out/site/bin" "$out/site/tvm_ffi/3rdparty" "$out/site/tvm_ffi/src"
find "$out/site" -name __pycache__ -prune -exec rm -rf {} +
built="$cache/workspace/.cache/flashinfer/$version/${arch//./}/cached_ops"
while read -r name; do
  mkdir -p "$out/site/flashinfer/data/aot/$name"
  cp "$built/$name/$name.so" "$out/site/flashinfer/data/aot/$name/"
done < "$cache/workspace/modules.txt"
du -sh "$out"
echo "on the GPU machine: export PYTHONPATH=$out/site:\$PYTHONPATH (scripts/gpu_day.sh does it)"
