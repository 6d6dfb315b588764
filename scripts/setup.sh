#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks to build Fence: libclang (bindgen, for RocksDB's
# bindings) and a C++ toolchain. Idempotent; needs root (or sudo) only when something is missing.
set -euo pipefail

need=()
dpkg -s libclang-dev >/dev/null 2>&1 || need+=(libclang-dev)
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v make >/dev/null 2>&1 || need+=(make)

if ((${#need[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

command -v cargo >/dev/null 2>&1 || {
  echo "setup: cargo not found; install Rust (stable) first" >&2
  exit 1
}
