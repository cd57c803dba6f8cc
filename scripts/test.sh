#!/usr/bin/env bash
# One command on a fresh Debian 12 machine: install dependencies, build, run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
cd "${DMUON_BUILD_DIR:-build}"
ctest --output-on-failure --timeout 900 -j "${DMUON_TEST_JOBS:-1}"
