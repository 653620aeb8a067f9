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
two_phases=1
if [ "$fast" = 1 ]; then two_phases=0; fi
case " $* " in *" -m "* | *" -m="* | *" -n "* | *" -p "*) two_phases=0 ;; esac
# What the run started, undone however it ends.
mypy_pid="" typed="" lock_dir="" services=0
cleanup() {
  if [ -n "$mypy_pid" ]; then kill "$mypy_pid" 2>/dev/null || true; fi
  rm -rf "$typed" "$lock_dir"
  if [ "$services" = 1 ]; then bash scripts/services.sh stop; fi
}
trap cleanup EXIT
bash scripts/setup.sh
if [ "$two_phases" = 1 ]; then
  # mypy (tens of seconds on one core without its cache) runs in the background from here:
  # beside the browser's and the servers' set-up (apt-get's downloads on a fresh machine),
  # then beside the first phase, whose tests leave part of the cores idle while they wait.
  # Its verdict comes before the second phase.
  typed=$(mktemp -t retrolog-mypy-XXXXXX)
  .venv/bin/mypy >"$typed" 2>&1 &
  mypy_pid=$!
fi
if [ "$fast" = 0 ]; then
  bash scripts/setup_browser.sh
  # The servers the team-backend tests use, on loopback; stopped however the run ends.
  services=1
  bash scripts/services.sh start
fi
.venv/bin/ruff check src tests bench examples
.venv/bin/ruff format --check src tests bench examples
if [ "$two_phases" = 0 ]; then
  .venv/bin/mypy
fi
# A file's tests stay in one process, so its module fixtures (recorded runs) are built
# once. Files go out in collection order, which tests/conftest.py makes slow files first,
# not pytest-xdist's most-tests-first.
xdist=(--dist loadfile --no-loadscope-reorder)
per_core=(-n auto --maxprocesses 4 "${xdist[@]}")  # one pytest process per core, at most 4
# Where tests share the machine, OpenMP's idle threads sleep rather than spin
# (docs/testing.md): how they wait, not what they compute.
if [ "$fast" = 1 ]; then
  OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m pytest "${per_core[@]}" \
    -m "not slow and not services and not browser" "$@"
  exit 0
fi
if [ "$two_phases" = 0 ]; then
  # Your own selection or distribution: one pytest run, as you asked; whole_machine
  # tests then take the machine lock in turn (tests/conftest.py).
  .venv/bin/python -m pytest "${per_core[@]}" "$@"
  exit 0
fi
# Two phases, sharing the session's recorded runs (their directory): first every test
# that shares the machine, one process per core (at most 4); then the whole_machine
# tests, which train at torch's default threads, one at a time in one process, as a user
# trains one run per machine.
lock_dir=$(mktemp -d -t pytest-machine-XXXXXX)
export PYTEST_MACHINE_LOCK_DIR=$lock_dir
# The first phase's tests wait much of their time for what they start (a script's imports,
# git, a server), so it runs one process more than there are cores (at most 5).
cores=$(nproc)
shared=$(( cores < 4 ? cores + 1 : 5 ))
status=0
OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m pytest -n "$shared" "${xdist[@]}" -m "not whole_machine" "$@" \
  || status=$?
typing=0
wait "$mypy_pid" || typing=$?
mypy_pid=""
cat "$typed"
if [ "$typing" != 0 ]; then exit "$typing"; fi
# 2: interrupted (Ctrl-C), which pytest turns into an exit status: stop here.
if [ "$status" = 2 ]; then exit 2; fi
alone=0
.venv/bin/python -m pytest -m whole_machine "$@" || alone=$?
# 5: no test selected (a -k that matches none of them)
if [ "$status" = 5 ] && [ "$alone" = 5 ]; then exit 5; fi
if [ "$status" != 0 ] && [ "$status" != 5 ]; then exit "$status"; fi
if [ "$alone" != 0 ] && [ "$alone" != 5 ]; then exit "$alone"; fi
exit 0
