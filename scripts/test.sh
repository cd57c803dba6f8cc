#!/usr/bin/env bash
# One command on a fresh Debian 12 machine: install dependencies, build, run the whole test suite,
# twice: against Debian's LibTorch 1.13 (CPU, Gloo), then against PyPI's LibTorch 2.x (CUDA build:
# compiled and linked with CUDA and NCCL, tests on the CPU; scripts/test_torch2.sh).
# DMUON_SKIP_TORCH2=1 runs the first build only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
(cd "${DMUON_BUILD_DIR:-build}" && ctest --output-on-failure --timeout 900 -j "${DMUON_TEST_JOBS:-1}")
if [ "${DMUON_SKIP_TORCH2:-0}" != 1 ]; then
  bash scripts/test_torch2.sh
fi
