#!/usr/bin/env bash
# Set everything up, then lint and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_browser.sh
.venv/bin/ruff check src tests bench examples
.venv/bin/ruff format --check src tests bench examples
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
