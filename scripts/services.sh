#!/usr/bin/env bash
# Start or stop the servers the team-backend tests run against, on loopback only:
#
#   bash scripts/services.sh start   # idempotent; writes .services/env
#   bash scripts/services.sh stop
#   bash scripts/services.sh status
#
# An S3-compatible server: moto's server mode (from the dev extra, in .venv), keeping its
# buckets in memory; docs/checkpoint-storage.md says which S3 behaviours it reproduces and
# which it does not. A one-node Ray cluster (the ray extra, in .venv) with 2 CPUs, for
# replays on Ray (docs/replay-on-ray.md). PostgreSQL from Debian's packages (installed
# with apt-get when missing and this is root), a cluster initdb'd into a temporary
# directory and started by pg_ctl on a loopback port, password authentication only
# (docs/metadata-backends.md). .services/env holds what the tests read
# (RETROLOG_TEST_S3_ENDPOINT, RETROLOG_TEST_RAY_ADDRESS, RETROLOG_TEST_DATABASE_URL);
# tests/conftest.py reads it when the variables are not set. Nothing here needs the
# network beyond loopback, except apt-get's package registry when it installs PostgreSQL.
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

# Ray on loopback only. Ray swaps 127.0.0.1 for the machine's network address unless told
# it is a one-machine cluster, which RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 does (on Linux
# too); a driver connecting to it needs the same (the tests set it).
ray_env() { env RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 "$@"; }

port_answers() {
  "$python" -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 2)' \
    "$1" 2>/dev/null
}

# Stop this cluster's processes: each names its temp dir on its command line (the workers
# are the raylet's children). Only these: `ray stop` would stop every Ray cluster on the
# machine. SIGTERM, then SIGKILL what is left after 5 s; prints how many there were.
kill_ray() {
  "$python" - "$1" <<'EOF'
import os, signal, sys, time

def cluster(directory):
    mine, found, parents = os.getpid(), set(), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents[int(pid)] = ppid
        if int(pid) != mine and directory in cmdline:
            found.add(int(pid))
    return found | {pid for pid, ppid in parents.items() if ppid in found}

def signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

pids = cluster(sys.argv[1])
signal_all(pids, signal.SIGTERM)
deadline = time.monotonic() + 5
while pids and time.monotonic() < deadline:
    time.sleep(0.1)
    pids = {pid for pid in pids if os.path.exists(f"/proc/{pid}")}
signal_all(pids, signal.SIGKILL)
print(len(pids))
EOF
}

# The nodes read the object store with their own settings, as a team's nodes do (~/.aws
# or AWS_* where `ray start` runs): here, the test S3 server's address and the
# credentials tests/conftest.py uses. A cluster started for another S3 server is restarted.
start_ray() {
  local portfile=$state/ray.port dirfile=$state/ray.dir s3file=$state/ray.s3
  local endpoint=http://127.0.0.1:$(cat "$state/moto.port")
  if [ -f "$portfile" ] && port_answers "$(cat "$portfile")"; then
    if [ "$(cat "$s3file" 2>/dev/null)" = "$endpoint" ]; then
      return 0
    fi
    stop_ray
  fi
  if [ ! -x .venv/bin/ray ]; then
    echo "services.sh: .venv/bin/ray is missing: run bash scripts/setup.sh first" \
      "(it installs the dev extra, which has ray)." >&2
    exit 1
  fi
  local port dir
  port=$(free_port)
  # Short and outside the work tree: Ray's unix sockets live under it (a 107-byte limit).
  dir=$(mktemp -d /tmp/retrolog-ray-XXXXXX)
  echo "$port" >"$portfile"
  echo "$dir" >"$dirfile"
  echo "$endpoint" >"$s3file"
  if ! ray_env AWS_ENDPOINT_URL="$endpoint" AWS_ACCESS_KEY_ID=retrolog-tests \
    AWS_SECRET_ACCESS_KEY=retrolog-tests AWS_DEFAULT_REGION=us-east-1 \
    .venv/bin/ray start --head --node-ip-address 127.0.0.1 --port "$port" \
    --num-cpus 2 --num-gpus 0 --object-store-memory 200000000 --include-dashboard=false \
    --disable-usage-stats --temp-dir "$dir" >"$state/ray.log" 2>&1; then
    echo "services.sh: ray start failed; its log:" >&2
    tail -n 20 "$state/ray.log" >&2 || true
    exit 1
  fi
  for _ in $(seq 1 100); do
    if port_answers "$port"; then
      echo "== Ray head on 127.0.0.1:$port (2 CPUs), temp dir $dir"
      return 0
    fi
    sleep 0.2
  done
  echo "services.sh: the Ray head did not answer on 127.0.0.1:$port; its log:" >&2
  tail -n 20 "$state/ray.log" >&2 || true
  exit 1
}

stop_ray() {
  local dirfile=$state/ray.dir dir
  [ -f "$dirfile" ] || return 0
  dir=$(cat "$dirfile")
  kill_ray "$dir" >/dev/null
  echo "== stopped ray"
  case "$dir" in /tmp/retrolog-ray-*) rm -rf "$dir" ;; esac
  rm -f "$dirfile" "$state/ray.port" "$state/ray.s3"
}

# -- PostgreSQL ------------------------------------------------------------------------

# The directory of initdb and pg_ctl: on PATH, else Debian's versioned directory.
pg_bin() {
  local found d
  found=$(command -v initdb 2>/dev/null || true)
  for d in ${found:+"$(dirname "$(readlink -f "$found")")"} /usr/lib/postgresql/*/bin; do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then
      echo "$d"
      return 0
    fi
  done
  return 1
}

install_postgres() {
  pg_bin >/dev/null && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "services.sh: PostgreSQL is not installed (no initdb or pg_ctl). Install Debian's" \
      "postgresql package (sudo apt-get install postgresql), or your system's, and run" \
      "this again." >&2
    exit 1
  fi
  echo "== installing PostgreSQL from Debian's packages (apt-get)"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      postgresql; } >"$state/apt.log" 2>&1; then
    echo "services.sh: apt-get could not install postgresql; its output:" >&2
    tail -n 20 "$state/apt.log" >&2 || true
    exit 1
  fi
}

# PostgreSQL refuses to run as root: as root the cluster belongs to the postgres user
# (the package creates it), in a directory outside the work tree that user can reach.
as_pg_owner() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

pg_running() {
  local dir
  [ -f "$state/pg.dir" ] || return 1
  dir=$(cat "$state/pg.dir")
  [ -d "$dir/data" ] && as_pg_owner "$(pg_bin)/pg_ctl" status -D "$dir/data" >/dev/null 2>&1
}

start_postgres() {
  if pg_running && [ -f "$state/pg.url" ]; then
    return 0
  fi
  stop_postgres >/dev/null
  install_postgres
  local bin dir port password
  bin=$(pg_bin)
  port=$(free_port)
  dir=$(mktemp -d /tmp/retrolog-pg-XXXXXX)
  password=$("$python" -c 'import secrets; print(secrets.token_hex(16))')
  (umask 077 && echo "$password" >"$dir/password")
  [ "$(id -u)" = 0 ] && chown -R postgres: "$dir"
  echo "$dir" >"$state/pg.dir"
  # Password (scram) over TCP, and the unix socket (in $dir, for no one else) trusted.
  if ! as_pg_owner "$bin/initdb" -D "$dir/data" -U retrolog --pwfile="$dir/password" \
    --auth-host=scram-sha-256 --auth-local=trust -E UTF8 --locale=C.UTF-8 \
    >"$state/pg.log" 2>&1; then
    echo "services.sh: initdb failed; its output:" >&2
    tail -n 20 "$state/pg.log" >&2 || true
    exit 1
  fi
  if ! as_pg_owner "$bin/pg_ctl" start -D "$dir/data" -w -t 60 -l "$dir/server.log" \
    -o "-c listen_addresses=127.0.0.1 -p $port -c unix_socket_directories=$dir" \
    >>"$state/pg.log" 2>&1; then
    echo "services.sh: pg_ctl could not start PostgreSQL; its log:" >&2
    tail -n 20 "$dir/server.log" >&2 || true
    exit 1
  fi
  as_pg_owner "$bin/createdb" -h "$dir" -p "$port" -U retrolog retrolog >>"$state/pg.log" 2>&1
  (umask 077 && echo "postgresql://retrolog:$password@127.0.0.1:$port/retrolog" >"$state/pg.url")
  echo "== PostgreSQL ($("$bin/postgres" --version | awk '{print $3}')) on 127.0.0.1:$port," \
    "data in $dir"
}

stop_postgres() {
  local dir
  [ -f "$state/pg.dir" ] || return 0
  dir=$(cat "$state/pg.dir")
  if [ -d "$dir/data" ] && pg_bin >/dev/null; then
    as_pg_owner "$(pg_bin)/pg_ctl" stop -D "$dir/data" -m fast -w >/dev/null 2>&1 || true
    echo "== stopped postgresql"
  fi
  case "$dir" in /tmp/retrolog-pg-*) rm -rf "$dir" ;; esac
  rm -f "$state/pg.dir" "$state/pg.url"
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
    start_ray
    start_postgres
    rm -f "$state/env"
    (
      umask 077  # the database URL holds the test server's password
      {
        echo "RETROLOG_TEST_S3_ENDPOINT=http://127.0.0.1:$(cat $state/moto.port)"
        echo "RETROLOG_TEST_RAY_ADDRESS=127.0.0.1:$(cat $state/ray.port)"
        echo "RETROLOG_TEST_DATABASE_URL=$(cat $state/pg.url)"
      } >"$state/env"
    )
    ;;
  stop)
    stop_one moto
    stop_ray
    stop_postgres
    rm -f "$state/env" "$state/moto.port"
    ;;
  status)
    down=0
    if alive "$state/moto.pid" && answers "$(cat $state/moto.port)"; then
      echo "moto: running on 127.0.0.1:$(cat $state/moto.port), pid $(cat $state/moto.pid)"
    else
      echo "moto: not running"
      down=1
    fi
    if [ -f "$state/ray.port" ] && port_answers "$(cat $state/ray.port)"; then
      echo "ray: head running on 127.0.0.1:$(cat $state/ray.port), temp dir $(cat $state/ray.dir)"
    else
      echo "ray: not running"
      down=1
    fi
    if pg_running; then
      echo "postgresql: running, data in $(cat $state/pg.dir)"
    else
      echo "postgresql: not running"
      down=1
    fi
    exit $down
    ;;
  *) usage ;;
esac
