#!/usr/bin/env bash
# Builds the libFuzzer targets with coverage instrumentation (stable Rust, no cargo-fuzz needed)
# and runs each for SECONDS (default 30). Saved regressions in fuzz/regressions/<target> run
# first; a crash fails the script and leaves its input in fuzz/artifacts/<target>.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds="${1:-30}"
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
  -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
  -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
# An explicit --target keeps RUSTFLAGS off build scripts and proc macros (as cargo-fuzz does).
triple="$(rustc -vV | sed -n 's/^host: //p')"
cargo build --release --locked --bins --target "$triple"
for target in canonical ledger service; do
  mkdir -p "corpus/$target" "artifacts/$target" "regressions/$target"
  echo "fuzz: $target for ${seconds}s"
  "target/$triple/release/$target" -max_total_time="$seconds" -print_final_stats=1 \
    -artifact_prefix="artifacts/$target/" "corpus/$target" "regressions/$target"
done
