#!/usr/bin/env bash
# Runs the whole test suite: every Rust test (unit, property, end-to-end, crash), the client
# examples against a live server, and the Python binding's tests against the real binary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

cargo build --locked --workspace --all-targets
cargo test --locked --workspace --all-targets
# Doc examples compile (they need no server).
cargo test --locked --workspace --doc

if [ -x bindings/python/run-tests.sh ]; then
  FENCED_BIN="$PWD/target/debug/fenced" bindings/python/run-tests.sh
fi
