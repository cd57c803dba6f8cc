// torch_version.h -- which LibTorch dmuon is compiled against, as one macro for the version tests.
//
// DMUON_TORCH_AT_LEAST(2, 4) is true when building against LibTorch 2.4 or later. Every version
// test in dmuon's sources goes through it, so a test of "which LibTorch has X" reads the same
// everywhere (LIBTORCH.md lists what differs between 1.13 and 2.x).
#pragma once

#include <torch/version.h>

#define DMUON_TORCH_AT_LEAST(maj, min) \
  (TORCH_VERSION_MAJOR > (maj) || (TORCH_VERSION_MAJOR == (maj) && TORCH_VERSION_MINOR >= (min)))
