#!/usr/bin/env bash
# Run a command on an AVX-512 machine as on an AVX2-only one (no AVX-512, no VNNI, no
# native bf16), as far as the libraries let a process choose: ggml built for AVX2
# (scripts/build_ggml.sh --isa avx2, installed under .venv/avx2-site and put first on
# PYTHONPATH), torch's kernels (ATEN_CPU_CAPABILITY=avx2), oneDNN's
# (ONEDNN_MAX_CPU_ISA=AVX2: no bf16 inner product), NumPy's dispatch, numba's target
# (haswell), and the engine's own reading of the CPU (PAGEDTREE_HIDE_CPU_FLAGS, so
# dtype="auto" takes fp32 and costs are cached apart). ONNX Runtime's MLAS (the q4/q8
# formats) picks its kernels from cpuid and cannot be held back: it still runs its
# AVX-512 ones. Timings under it are not an AVX2 machine's; what it shows is whether
# the code and the tests hold on AVX2 kernels.
#
#   scripts/emulate_avx2.sh COMMAND [ARG...]
#   scripts/emulate_avx2.sh .venv/bin/python -m pytest        # the suite on AVX2 kernels
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,14s/^# \{0,1\}//p' "$0"
  exit 0
fi
bash scripts/build_ggml.sh --isa avx2 --target .venv/avx2-site
export PYTHONPATH="$PWD/.venv/avx2-site${PYTHONPATH:+:$PYTHONPATH}"
export ATEN_CPU_CAPABILITY=avx2
export ONEDNN_MAX_CPU_ISA=AVX2
export NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"
export NUMBA_CPU_NAME=haswell
export PAGEDTREE_HIDE_CPU_FLAGS="avx512*,amx*,avx_vnni*"
exec "$@"
