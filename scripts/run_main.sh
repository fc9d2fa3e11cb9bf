#!/usr/bin/env bash
# Set everything up, then run the main job: tree speculative decoding on the embedded
# Qwen2.5-Coder 1.5B target with the 0.5B draft; prints the text, tokens/s, the mean
# acceptance length and the speed-up over plain decoding measured in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --models all
exec .venv/bin/python examples/tree_speculation.py "$@"
