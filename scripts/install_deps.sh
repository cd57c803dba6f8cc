#!/usr/bin/env bash
# Installs everything dmuon needs on a fresh Debian 12 machine (idempotent).
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
PKGS=(cmake g++ make git ca-certificates
      libtorch-dev libgloo-dev           # LibTorch 1.13 (CPU) + Gloo headers for ProcessGroupGloo
      libopenblas0-pthread               # optimised BLAS behind LibTorch's CPU matmul (netlib is ~10x slower)
      nlohmann-json3-dev libcli11-dev libgtest-dev
      ccache fortunes-min                # fortunes-min: the default training text of `dmuon train`
      iproute2)                          # ip netns / veth: tests/multihost_test.sh's hosts
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "[dmuon] installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
