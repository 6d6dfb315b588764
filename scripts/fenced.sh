#!/usr/bin/env bash
# Starts the Fence service (release build) with its embedded default data dir ./fence-data.
# Extra arguments go to fenced, e.g. `scripts/fenced.sh --listen 0.0.0.0:50051`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec cargo run --release --locked -p fence-server --bin fenced -- "$@"
