#!/usr/bin/env bash
# Make the browser tests (tests/ui) runnable: Debian's chromium plus Playwright in .venv.
# Playwright's own browser download (`playwright install`) needs the internet, so the tests
# drive the distribution's chromium instead. Safe to rerun; does nothing when already set up.
set -euo pipefail
cd "$(dirname "$0")/.."
chromium=${RETROLOG_CHROMIUM:-/usr/bin/chromium}

cannot_install() {
  cat >&2 <<EOF
setup_browser.sh: $chromium is missing and cannot be installed here ($1). The browser tests
need Chromium: as root on Debian/Ubuntu run
  apt-get update && apt-get install -y --no-install-recommends chromium
(or install Chromium some other way and set RETROLOG_CHROMIUM to its executable), then rerun
  bash scripts/setup_browser.sh
EOF
  exit 1
}

if [ ! -x "$chromium" ]; then
  if [ -n "${RETROLOG_CHROMIUM:-}" ]; then
    echo "setup_browser.sh: RETROLOG_CHROMIUM=$chromium is not an executable file." >&2
    exit 1
  fi
  command -v apt-get >/dev/null || cannot_install "no apt-get"
  if [ "$(id -u)" -eq 0 ]; then
    sudo=()
  elif command -v sudo >/dev/null; then
    sudo=(sudo)
  else
    cannot_install "not root and no sudo"
  fi
  echo "== installing chromium with apt-get (about 100 MB)"
  "${sudo[@]}" apt-get update -qq || cannot_install "apt-get update failed"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends chromium \
    || cannot_install "apt-get install failed"
  [ -x "$chromium" ] || cannot_install "apt-get installed chromium but not at $chromium"
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup_browser.sh: no .venv; run \`bash scripts/setup.sh\` first, then rerun this." >&2
  exit 1
fi
if ! .venv/bin/python -c "import playwright" 2>/dev/null; then
  cat >&2 <<'EOF'
setup_browser.sh: chromium is installed, but the Python package `playwright` is not in .venv.
It comes with the `dev` extra: run `bash scripts/setup.sh` (or, by hand,
`.venv/bin/pip install 'playwright>=1.45'`). Do not run `playwright install`: the tests use
the system chromium, not Playwright's download.
EOF
  exit 1
fi
echo "browser tests ready: $("$chromium" --version 2>/dev/null || echo "$chromium"), playwright" \
  "$(.venv/bin/python -c 'from importlib.metadata import version; print(version("playwright"))')"
