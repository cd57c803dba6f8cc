#!/usr/bin/env bash
# The second CI build: PyPI's LibTorch 2.x (a CUDA build: CUDA 13 wheels matching the installed CUDA
# 13.0 toolkit) in a virtual environment, dmuon configured with CUDA and NCCL, every target compiled
# and linked, and the test suite run on the CPU. The wheel has no Gloo headers, so CPU process groups
# are dmuon's store backend here (multi-rank tests included); CUDA tests skip (no GPU).
#   DMUON_TORCH2_VERSION (default 2.11.0: the GPU machine's series), DMUON_TORCH2_VENV (default
#   /opt/dmuon-torch2, reused when it already holds that version), DMUON_TORCH2_BUILD_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${DMUON_TORCH2_VERSION:-2.11.0}"
VENV="${DMUON_TORCH2_VENV:-/opt/dmuon-torch2}"
BUILD_DIR="${DMUON_TORCH2_BUILD_DIR:-build-torch2}"
JOBS="${DMUON_JOBS:-$(nproc)}"

have() { "$VENV/bin/python" -c "import torch,sys; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null; }
if ! have; then
  echo "[dmuon] installing torch==$VERSION from PyPI into $VENV (several GB with its nvidia-* wheels; pip caches them)"
  python3 -m venv "$VENV"
  if ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$VERSION"; then
    echo "[dmuon] error: 'pip install torch==$VERSION' failed: PyPI could not be reached or refused the download" \
         "(see pip's message above). The LibTorch 2.x build needs it; retry when the registry answers, or set" \
         "DMUON_TORCH2_VENV to a virtual environment that already has torch $VERSION." >&2
    exit 1
  fi
fi
# Python's side of the interop tests (tests/interop_test.cpp): transformers and safetensors read
# what dmuon writes and write what dmuon reads; torchrun (from the torch wheel) launches dmuon. The
# same build makes the Python package (python/, -DDMUON_BUILD_PYTHON=ON: dmuon._C against this torch).
# pytest runs the tests of `import dmuon` (tests/python, ctest's python_test).
INTEROP_PKGS=("safetensors==${DMUON_SAFETENSORS_VERSION:-0.8.0}" "transformers==${DMUON_TRANSFORMERS_VERSION:-5.24.0}"
              "pytest==${DMUON_PYTEST_VERSION:-9.2.0}")
if ! "$VENV/bin/python" -c "import safetensors, transformers, pytest" 2>/dev/null; then
  echo "[dmuon] installing ${INTEROP_PKGS[*]} from PyPI into $VENV (interop tests)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${INTEROP_PKGS[@]}" || {
    echo "[dmuon] error: 'pip install ${INTEROP_PKGS[*]}' failed (see pip's message above); the interop tests" \
         "need them. Retry when PyPI answers." >&2
    exit 1
  }
fi
TORCH_PREFIX="$("$VENV/bin/python" -c 'import torch,os;print(os.path.dirname(torch.__file__))')"
echo "[dmuon] LibTorch $("$VENV/bin/python" -c 'import torch;print(torch.__version__)') at $TORCH_PREFIX"
config_log="$(mktemp)"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
  -DDMUON_PYTHON="$VENV/bin/python" -DDMUON_BUILD_PYTHON=ON >"$config_log" 2>&1 ||
  { cat "$config_log"; exit 1; }
grep -E "dmuon: (Torch|NCCL)" "$config_log"
grep -q "dmuon: Torch 2\..*, CUDA=1, Gloo=OFF" "$config_log" ||
  { echo "[dmuon] error: the LibTorch 2.x build is not configured with CUDA (expected 'CUDA=1, Gloo=OFF')" >&2; exit 1; }
rm -f "$config_log"
export CCACHE_BASEDIR="$PWD"
cmake --build "$BUILD_DIR" -j "$JOBS"
(cd "$BUILD_DIR" && ctest --output-on-failure --timeout 900 -j "${DMUON_TEST_JOBS:-1}")
# pip install --no-build-isolation . from the tree just built (the core is not compiled a third time)
bash scripts/pip_check.sh "$VENV" "$BUILD_DIR"
