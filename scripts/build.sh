#!/usr/bin/env bash
# Configures and builds dmuon (Release) into ${DMUON_BUILD_DIR:-build}.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${DMUON_BUILD_DIR:-build}"
JOBS="${DMUON_JOBS:-$(nproc)}"
# ccache keys on paths relative to the checkout, so another clone of it (CI) reuses the cache
export CCACHE_BASEDIR="$PWD"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
