#!/usr/bin/env bash
# Set everything up, then run the main job: generation on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --models all
exec .venv/bin/python examples/offline_generate.py "$@"
