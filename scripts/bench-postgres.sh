#!/usr/bin/env bash
# The Postgres peer of the load benchmark: installs PostgreSQL from Debian's packages, creates
# a throwaway cluster on the same disk as the Fence data (default /var/tmp/fence-bench-pg; the
# whole machine is one disk here), starts it on 127.0.0.1:$PGBENCH_PORT (default 54329) with
# synchronous_commit=on and fsync=on (both are Postgres' defaults; stated explicitly), and
# creates the idempotency-key table. Prints the connection URL on stdout.
#
#   scripts/bench-postgres.sh start   # install if needed, (re)create, start; prints the URL
#   scripts/bench-postgres.sh stop    # stop and remove the cluster
set -euo pipefail

DIR=${PGBENCH_DIR:-/var/tmp/fence-bench-pg}
PORT=${PGBENCH_PORT:-54329}
URL="postgres://bench@127.0.0.1:${PORT}/bench"
cmd=${1:-start}

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

pg_bin() {
  ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1
}

as_postgres() {
  if [ "$(id -un)" = postgres ]; then "$@"; else $sudo runuser -u postgres -- "$@"; fi
}

case "$cmd" in
start)
  if [ -z "$(pg_bin)" ]; then
    echo "bench-postgres: installing postgresql" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq postgresql >/dev/null
  fi
  BIN=$(pg_bin)
  # The package may start its default cluster; it would only compete for the two cores.
  $sudo service postgresql stop >/dev/null 2>&1 || true
  if [ -f "$DIR/data/postmaster.pid" ]; then
    as_postgres "$BIN/pg_ctl" -D "$DIR/data" -m fast stop >/dev/null 2>&1 || true
  fi
  $sudo rm -rf "$DIR"
  $sudo mkdir -p "$DIR"
  $sudo chown postgres:postgres "$DIR"
  as_postgres "$BIN/initdb" -D "$DIR/data" -U bench -A trust -E UTF8 >"$DIR/initdb.log" 2>&1 || {
    cat "$DIR/initdb.log" >&2
    exit 1
  }
  cat <<CONF | as_postgres tee -a "$DIR/data/postgresql.conf" >/dev/null
# fence bench: durable commits, as Fence's WAL sync (these are the defaults, stated).
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$DIR'
fsync = on
synchronous_commit = on
full_page_writes = on
max_connections = 300
shared_buffers = 256MB
CONF
  as_postgres "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/postgres.log" -w start >/dev/null
  as_postgres "$BIN/createdb" -h 127.0.0.1 -p "$PORT" -U bench bench
  as_postgres "$BIN/psql" -q -h 127.0.0.1 -p "$PORT" -U bench -d bench -v ON_ERROR_STOP=1 <<'SQL'
CREATE TABLE IF NOT EXISTS effects (
    tenant text NOT NULL,
    run_id text NOT NULL,
    step_key text NOT NULL,
    intent_fp bytea NOT NULL,
    arguments text NOT NULL,
    state smallint NOT NULL,
    result bytea,
    lease_expires_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, run_id, step_key)
);
SQL
  echo "$URL"
  ;;
stop)
  BIN=$(pg_bin)
  if [ -n "$BIN" ] && [ -f "$DIR/data/postmaster.pid" ]; then
    as_postgres "$BIN/pg_ctl" -D "$DIR/data" -m fast stop >/dev/null
  fi
  $sudo rm -rf "$DIR"
  ;;
*)
  echo "usage: $0 start|stop" >&2
  exit 2
  ;;
esac
