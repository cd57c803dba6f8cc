#!/usr/bin/env bash
# One command on a fresh Debian 12 machine: install dependencies, build, run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
BUILD_DIR="${DMUON_BUILD_DIR:-build}"
if [ -x "$BUILD_DIR/apps/dmuon" ] && "$BUILD_DIR/apps/dmuon" train --help >/dev/null 2>&1; then
  exec "$BUILD_DIR/apps/dmuon" train --out "${DMUON_OUT:-runs/default}" "$@"
fi
exec "$BUILD_DIR/bench/ns_bench" "$@"
