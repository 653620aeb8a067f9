#!/usr/bin/env bash
# Set everything up, then lint and run the whole test suite (what CI runs).
#
#   bash scripts/test.sh [pytest arguments]          # the full lane: every test
#   bash scripts/test.sh --fast [pytest arguments]   # no servers, no browser, no slow tests
#
# The fast lane leaves out the tests marked slow, services or browser (docs/testing.md),
# and so starts neither the test servers nor needs chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
bash scripts/setup.sh
if [ "$fast" = 0 ]; then
  bash scripts/setup_browser.sh
  # The servers the team-backend tests use, on loopback; stopped however the run ends.
  bash scripts/services.sh start
  trap 'bash scripts/services.sh stop' EXIT
fi
.venv/bin/ruff check src tests bench examples
.venv/bin/ruff format --check src tests bench examples
.venv/bin/mypy
lane=()
if [ "$fast" = 1 ]; then
  lane=(-m "not slow and not services and not browser")
fi
# One pytest process per core (at most 4); a file's tests stay in one process, so its
# module fixtures (recorded runs) are built once. Files go out in collection order, which
# tests/conftest.py makes slow files first, not pytest-xdist's most-tests-first.
.venv/bin/python -m pytest -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder \
  "${lane[@]}" "$@"
