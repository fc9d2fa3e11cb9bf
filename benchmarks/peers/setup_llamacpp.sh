#!/usr/bin/env bash
# Create the llama.cpp peer environment at .venv-llamacpp (never a dependency of pagedtree itself).
#   bash benchmarks/peers/setup_llamacpp.sh [VENV_DIR]
# Builds llama-cpp-python 0.3.36 (and the llama.cpp it vendors) from source for this CPU:
# about 7-15 minutes on 2 cores, no GPU, no torch. benchmarks/compare.py drives it as the
# single-stream `llamacpp` engine on the GGUF file itself (see benchmarks/README.md).
# Pitfalls handled here:
#  * -DGGML_NATIVE=ON compiles for this machine's own instruction set (AVX2/AVX-512/VNNI as
#    present), as a local `cmake` build of llama.cpp does; the venv is not portable to another CPU.
#  * -DLLAMA_CURL=OFF: no libcurl headers are needed (models are read from local files only).
#  * tests and examples are not built, which keeps the build to the library.
#  * CMAKE_BUILD_PARALLEL_LEVEL defaults to the number of cores (set it lower on a busy machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/peer_venv.sh
peer_venv llamacpp "${1:-.venv-llamacpp}"
"${PIP[@]}" --upgrade pip setuptools wheel
# numpy is llama-cpp-python's one heavy dependency; tqdm for scripts run in this venv.
# (scikit-build-core and cmake, its build requirements, come into pip's build env on their own.)
"${PIP[@]}" numpy tqdm
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}"
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}"
echo "[llamacpp] building llama-cpp-python==0.3.36 from source (7-15 minutes on 2 cores)"
echo "[llamacpp]   CMAKE_ARGS=$CMAKE_ARGS CMAKE_BUILD_PARALLEL_LEVEL=$CMAKE_BUILD_PARALLEL_LEVEL"
"${PIP[@]}" --no-binary llama-cpp-python --no-cache-dir "llama-cpp-python==0.3.36"
"$VENV/bin/python" - <<'PY'
import llama_cpp
print(f"[llamacpp] ok: llama-cpp-python {llama_cpp.__version__}")
PY
