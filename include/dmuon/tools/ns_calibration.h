// ns_calibration.h -- measure, on this device, what `dmuon plan` and the owner planner's "profiled"
// cost model price: Newton-Schulz time per matrix shape (alone and batched, the way Muon::step runs
// it), the dense matmul rate and the memory bandwidth. `dmuon plan --calibrate FILE` writes them as a
// hardware description (step_simulator.h) holding an NS profile (ns_profile.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dmuon/newton_schulz.h"
#include "dmuon/ns_profile.h"

namespace dmuon {

struct NsShape {
  int64_t rows = 0, cols = 0;
  int64_t elem_bytes = 4;  // the parameter's dtype: 2 = bf16, 4 = fp32, 8 = fp64
};

struct NsCalibrationOptions {
  at::Device device = at::kCPU;
  int batch = 8;             // matrices in the batched measurement of a shape that stacks
  int reps = 5;              // timed repetitions (median), after one warm-up call
  double max_shape_s = 2.0;  // a shape whose single call takes longer is timed once, not batched
  int ns_steps = kDefaultNsSteps;
  std::string backend = "gram";
};

// One timing per distinct shape (orientation-free) and element size, in the order first seen, of the
// NS Muon::step runs: finite check off, through NsGraphs (CUDA graphs on CUDA). The batched figure is
// `batch` matrices stacked into one call where ns_stacking_pays on this device; elsewhere the shape
// has no batched figure (k matrices cost k single calls).
NsProfile measure_ns_profile(const std::vector<NsShape>& shapes, const NsCalibrationOptions& opts = {});

struct DeviceRates {
  double matmul_tflops = 0;          // fp32 (CPU) / bf16 (CUDA) square GEMM, median of reps
  double memory_bandwidth_GBps = 0;  // an element-wise a = b + c over 3 x 64 MiB
  std::string describe;              // what was measured, one line
};
DeviceRates measure_device_rates(const at::Device& device, int reps = 5);

}  // namespace dmuon
