#!/usr/bin/env bash
# Prepares .gpu-deps/ (git-ignored): the header-only and static C++ dependencies the GPU machine's
# image lacks (nlohmann-json, CLI11, GoogleTest), copied from this machine's Debian packages as a
# CMake prefix, and the training text (Debian's fortunes, which that image lacks too) as
# .gpu-deps/share/fortunes.txt. Pass it to the device tool's `carry` together with the checkout; gpu_check.sh finds it.
#   usage: bash scripts/gpu_deps.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
D=.gpu-deps
rm -rf "$D"
# the same layout as Debian's (the packages' CMake configs find their files relative to themselves)
mkdir -p "$D/include" "$D/share/cmake" "$D/lib/x86_64-linux-gnu/cmake"
cp -r /usr/include/nlohmann /usr/include/CLI /usr/include/gtest /usr/include/gmock "$D/include/"
cp -r /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 "$D/share/cmake/"
cp /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a \
   /usr/lib/x86_64-linux-gnu/libgmock.a /usr/lib/x86_64-linux-gnu/libgmock_main.a "$D/lib/x86_64-linux-gnu/"
cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest "$D/lib/x86_64-linux-gnu/cmake/"
mkdir -p "$D/share"
cat /usr/share/games/fortunes/fortunes /usr/share/games/fortunes/literature /usr/share/games/fortunes/riddles \
  >"$D/share/fortunes.txt"
du -sh "$D"
