#!/usr/bin/env bash
# Start or stop the servers the team-backend tests run against, on loopback only:
#
#   bash scripts/services.sh start   # idempotent; writes .services/env
#   bash scripts/services.sh stop
#   bash scripts/services.sh status
#
# Today that is one S3-compatible server: moto's server mode (from the dev extra, in .venv),
# keeping its buckets in memory. docs/checkpoint-storage.md says which S3 behaviours it
# reproduces and which it does not. .services/env holds what the tests read
# (RETROLOG_TEST_S3_ENDPOINT); tests/conftest.py reads it when the variable is not set.
# Nothing here needs the network beyond loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
state=.services
python=.venv/bin/python

usage() {
  echo "usage: bash scripts/services.sh start|stop|status" >&2
  exit 2
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Whether an HTTP server answers on 127.0.0.1:$1 (any status: moto answers / with 200).
answers() {
  "$python" - "$1" <<'EOF'
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/", timeout=2)
except urllib.error.HTTPError:
    pass
except OSError:
    sys.exit(1)
EOF
}

free_port() {
  "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_s3() {
  local pidfile=$state/moto.pid portfile=$state/moto.port
  if alive "$pidfile" && answers "$(cat "$portfile")"; then
    return 0
  fi
  if [ ! -x .venv/bin/moto_server ]; then
    echo "services.sh: .venv/bin/moto_server is missing: run bash scripts/setup.sh first" \
      "(it installs the dev extra, which has moto[server])." >&2
    exit 1
  fi
  local port
  port=$(free_port)
  nohup .venv/bin/moto_server -H 127.0.0.1 -p "$port" >"$state/moto.log" 2>&1 &
  echo $! >"$pidfile"
  echo "$port" >"$portfile"
  for _ in $(seq 1 100); do
    if answers "$port"; then
      echo "== S3-compatible server (moto) on 127.0.0.1:$port, pid $(cat "$pidfile")"
      return 0
    fi
    if ! alive "$pidfile"; then
      break
    fi
    sleep 0.2
  done
  echo "services.sh: moto_server did not answer on 127.0.0.1:$port; its log:" >&2
  tail -n 20 "$state/moto.log" >&2 || true
  exit 1
}

stop_one() {
  local pidfile=$state/$1.pid
  if alive "$pidfile"; then
    kill "$(cat "$pidfile")" 2>/dev/null || true
    for _ in $(seq 1 50); do
      alive "$pidfile" || break
      sleep 0.1
    done
    alive "$pidfile" && kill -9 "$(cat "$pidfile")" 2>/dev/null || true
    echo "== stopped $1"
  fi
  rm -f "$pidfile"
}

case "${1:-}" in
  start)
    mkdir -p "$state"
    start_s3
    {
      echo "RETROLOG_TEST_S3_ENDPOINT=http://127.0.0.1:$(cat $state/moto.port)"
    } >"$state/env"
    ;;
  stop)
    stop_one moto
    rm -f "$state/env" "$state/moto.port"
    ;;
  status)
    if alive "$state/moto.pid" && answers "$(cat $state/moto.port)"; then
      echo "moto: running on 127.0.0.1:$(cat $state/moto.port), pid $(cat $state/moto.pid)"
    else
      echo "moto: not running"
      exit 1
    fi
    ;;
  *) usage ;;
esac
