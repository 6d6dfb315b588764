#!/usr/bin/env bash
# Fence benchmarks, each in one command. Everything runs from the release build, made once
# with `cargo build --release --workspace --bins` (the first build compiles RocksDB at -O:
# about 15 minutes on two cores).
#
#   scripts/bench.sh faults [flags]   fault-injection benchmark, 100,000 faults by default
#                                      (fence-faults --help for the flags: --seed, --faults...)
#   scripts/bench.sh load [flags]      the fdatasync floor, Fence and the Postgres peer at
#                                      concurrency 1..256 (starts Postgres with bench-postgres.sh)
#   scripts/bench.sh scale [flags]     latency and RSS of Fence at 0, 1M and 10M stored effects
#   scripts/bench.sh cost [flags]      noise-free cost: fenced's CPU us per effect (from /proc)
#                                      at concurrency 1 and 64, and instructions per effect of
#                                      the ledger alone under callgrind (RocksDB and in-memory)
#   scripts/bench.sh micro [filter]    criterion micro-benchmarks (canonicalisation, a ledger
#                                      decision, a durable store write)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

what=${1:-faults}
shift || true

release() {
  cargo build --release --workspace --bins
}
bin=${CARGO_TARGET_DIR:-target}/release

# Instructions per effect of `fence-load ledger "$@"` counted inside measured_effects only.
instructions_per_effect() {
  local effects=$1 out
  shift
  out=$(mktemp)
  valgrind --tool=callgrind --callgrind-out-file="$out" --collect-atstart=no \
    --toggle-collect='*measured_effects*' "$bin/fence-load" ledger --effects "$effects" "$@" \
    >/dev/null 2>&1
  awk -v n="$effects" '/^(summary|totals):/ { printf "%.0f\n", $2 / n; exit }' "$out"
  rm -f "$out"
}

case "$what" in
faults)
  release
  has_faults=0
  for a in "$@"; do [[ "$a" == --faults* ]] && has_faults=1; done
  if [ "$has_faults" -eq 0 ]; then set -- --faults 100000 "$@"; fi
  exec "$bin/fence-faults" "$@"
  ;;
load)
  release
  url=$(scripts/bench-postgres.sh start)
  trap 'scripts/bench-postgres.sh stop' EXIT
  "$bin/fence-load" compare --postgres "$url" "$@"
  ;;
scale)
  release
  exec "$bin/fence-load" scale "$@"
  ;;
cost)
  release
  echo "## unary calls"
  "$bin/fence-load" cost --concurrency 1,64 "$@"
  echo
  echo "## each worker's calls on a Session stream"
  "$bin/fence-load" cost --concurrency 1,64 --session "$@"
  echo
  echo "## the whole server's instructions per effect and per empty Session message (callgrind)"
  "$bin/fence-load" cost --concurrency 1 --effects 2000 --session --callgrind |
    sed -n '/instructions per effect/,/callgrind dumps/p'
  echo
  echo "| ledger in process, no gRPC | instructions per effect (callgrind) |"
  echo "|---|---:|"
  echo "| RocksDB, every write synced | $(instructions_per_effect 1000) |"
  echo "| in-memory store | $(instructions_per_effect 2000 --mem) |"
  ;;
micro)
  exec cargo bench -p fence-bench -- "$@"
  ;;
*)
  echo "usage: $0 faults|load|scale|cost|micro [flags]" >&2
  exit 2
  ;;
esac
