#!/usr/bin/env bash
# Set everything up, then run the whole test suite (slow cases are skipped; add -m slow for them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --models test
.venv/bin/python -m pytest "$@"
