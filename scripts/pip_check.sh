#!/usr/bin/env bash
# `pip install --no-build-isolation .` as a user runs it, checked inside CI without compiling the core a
# third time: scikit-build-core drives the project's CMake in the LibTorch 2.x build tree that
# scripts/test_torch2.sh has just built (same options, so every target is up to date and only the wheel is
# packed), installs the wheel into that virtual environment, then, from outside the source and build
# trees, imports the installed package and runs the Newton-Schulz tests against it (real Gloo groups).
# The package is uninstalled again at the end: the test suite uses the build tree's copy.
#   scripts/pip_check.sh VENV BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$1"
BUILD_DIR="$(cd "$2" && pwd)"
PY="$VENV/bin/python"
SKBUILD_VERSION="${DMUON_SKBUILD_VERSION:-1.1.2}"
if ! "$PY" -c "import scikit_build_core" 2>/dev/null; then
  echo "[dmuon] installing scikit-build-core==$SKBUILD_VERSION into $VENV (pip install of dmuon)"
  "$PY" -m pip install --quiet --disable-pip-version-check "scikit-build-core==$SKBUILD_VERSION" || {
    echo "[dmuon] error: 'pip install scikit-build-core' failed (see pip's message above); retry when PyPI answers." >&2
    exit 1
  }
fi
trap '"$PY" -m pip uninstall --quiet --yes dmuon >/dev/null 2>&1 || true' EXIT
echo "[dmuon] pip install --no-build-isolation . (build tree $BUILD_DIR)"
# the options the tree was configured with (pyproject.toml's defaults are a user's: no tests), its generator
CMAKE_GENERATOR="$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$BUILD_DIR/CMakeCache.txt")" \
  "$PY" -m pip install --no-build-isolation --no-deps --quiet --disable-pip-version-check \
  -C build-dir="$BUILD_DIR" -C cmake.define.DMUON_BUILD_TESTS=ON -C cmake.define.DMUON_BUILD_BENCHMARKS=ON \
  -C cmake.define.DMUON_BUILD_CLI=ON -C cmake.define.DMUON_INSTALL=ON .
tests="$PWD/tests/python"
cd "$(mktemp -d)"
env -u PYTHONPATH "$PY" - <<'PY'
import os, sys
import dmuon
site = os.path.dirname(os.path.dirname(dmuon.__file__))
assert "site-packages" in site, f"dmuon imported from {dmuon.__file__}, not the installed package"
print(f"[dmuon] installed: dmuon {dmuon.__version__} at {os.path.dirname(dmuon.__file__)}, NS backend {dmuon.get_ns_backend()}")
PY
PYTHONPATH="$tests" OMP_NUM_THREADS=1 "$PY" -m pytest -q -p no:cacheprovider "$tests/test_newton_schulz.py"
