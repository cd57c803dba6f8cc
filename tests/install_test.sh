#!/usr/bin/env bash
# Installs the build tree into a temporary prefix and builds a small consumer project against it
# with find_package(dmuon): the package config, exported targets and headers must work as shipped.
set -euo pipefail
BUILD_DIR="$1"
SRC_DIR="$2"
EXTRA_PREFIX="${3:-}"  # the build's CMAKE_PREFIX_PATH (e.g. a pip LibTorch)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$BUILD_DIR" --prefix "$work/prefix" >/dev/null
mkdir -p "$work/consumer"
cat > "$work/consumer/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.18)
project(consumer CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(dmuon REQUIRED)
add_executable(consumer main.cpp)
target_link_libraries(consumer PRIVATE dmuon::dmuon)
CM
cat > "$work/consumer/main.cpp" <<'CPP'
#include <dmuon/newton_schulz.h>
#include <dmuon/owner_plan.h>
#include <iostream>
int main() {
  at::Tensor w = dmuon::newton_schulz(at::zeros({8, 16}));
  auto plan = dmuon::plan_owners({{"layers.0.q.weight", {16, 16}}}, 2, 1);
  if (w.abs().sum().item<double>() != 0.0 || plan.owners.size() != 1) return 1;
  std::cout << "consumer OK: " << dmuon::get_ns_backend() << "\n";
  return 0;
}
CPP
cmake -S "$work/consumer" -B "$work/consumer/b" -DCMAKE_PREFIX_PATH="$work/prefix${EXTRA_PREFIX:+;$EXTRA_PREFIX}" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/consumer/b" >/dev/null
"$work/consumer/b/consumer"
