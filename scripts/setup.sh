#!/usr/bin/env bash
# Make .venv with retrolog (editable), CPU PyTorch and the dev tools. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.retrolog-setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  # Pinned: on our machines this version is the CPU build on local disk; an unpinned `torch`
  # would download a multi-GB CUDA build.
  .venv/bin/python -m pip install --quiet "torch==${RETROLOG_TORCH_VERSION:-2.13.0}"
  .venv/bin/python -m pip install --quiet -e ".[dev,torch,ui,team]"
  touch "$stamp"
fi
# Compile retrolog's modules, as pip does for a package it installs but not for an
# editable one: where PYTHONDONTWRITEBYTECODE is set, every process that imports retrolog
# (each run, each command, each replay worker) would otherwise compile them again.
# Python checks each file's timestamp, so an edited module is compiled from its source.
.venv/bin/python -m compileall -q src
