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

case "$what" in
faults)
  release
  has_faults=0
  for a in "$@"; do [[ "$a" == --faults* ]] && has_faults=1; done
  if [ "$has_faults" -eq 0 ]; then set -- --faults 100000 "$@"; fi
  exec target/release/fence-faults "$@"
  ;;
load)
  release
  url=$(scripts/bench-postgres.sh start)
  trap 'scripts/bench-postgres.sh stop' EXIT
  target/release/fence-load compare --postgres "$url" "$@"
  ;;
scale)
  release
  exec target/release/fence-load scale "$@"
  ;;
micro)
  exec cargo bench -p fence-bench -- "$@"
  ;;
*)
  echo "usage: $0 faults|load|scale|micro [flags]" >&2
  exit 2
  ;;
esac
