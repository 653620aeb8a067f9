#!/usr/bin/env bash
# Set everything up, then lint and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_browser.sh
# The servers the team-backend tests use, on loopback; stopped however the run ends.
bash scripts/services.sh start
trap 'bash scripts/services.sh stop' EXIT
.venv/bin/ruff check src tests bench examples
.venv/bin/ruff format --check src tests bench examples
.venv/bin/mypy
# One pytest process per core (at most 4); a file's tests stay in one process, so its
# module fixtures (recorded runs) are built once.
.venv/bin/python -m pytest -n auto --maxprocesses 4 --dist loadfile "$@"
