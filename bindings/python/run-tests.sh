#!/usr/bin/env bash
# Tests of the Python binding, as CI runs them:
#   1. a virtualenv (bindings/python/.venv, or $FENCE_PY_VENV), created if missing;
#   2. `pip install` of this package (its build generates the gRPC stubs from proto/) and of
#      the test requirements;
#   3. pytest against the real server binary: $FENCED_BIN, else <repo>/target/debug/fenced
#      (built with cargo first if it is missing and FENCED_BIN is not set).
# Exits with pytest's exit code; "no tests collected" (5) is reported and fails too.
# Extra arguments are passed to pytest.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${FENCE_PY_VENV:-$HERE/.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "run-tests.sh: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

echo "run-tests.sh: installing fence-client and test requirements"
"$PY" -m pip install --quiet -r "$HERE/requirements-test.txt" "$HERE"
# A path requirement of an unchanged version may be left as is: reinstall the package itself
# so the tests always run the current sources and freshly generated stubs.
"$PY" -m pip install --quiet --force-reinstall --no-deps "$HERE"

if [ -z "${FENCED_BIN:-}" ] && [ ! -x "$REPO/target/debug/fenced" ]; then
  if command -v cargo >/dev/null 2>&1; then
    echo "run-tests.sh: $REPO/target/debug/fenced missing; building it"
    (cd "$REPO" && cargo build -p fence-server --bin fenced)
  fi
fi
# The MCP gateway's tests run the real fence-mcp binary too.
if [ -z "${FENCE_MCP_BIN:-}" ] && [ ! -x "$REPO/target/debug/fence-mcp" ]; then
  if command -v cargo >/dev/null 2>&1; then
    echo "run-tests.sh: $REPO/target/debug/fence-mcp missing; building it"
    (cd "$REPO" && cargo build -p fence-mcp --bin fence-mcp)
  fi
fi

cd "$HERE"
set +e
"$PY" -m pytest "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "run-tests.sh: pytest collected no tests: failing" >&2
fi
exit "$code"
