// ns_profile.h -- measured Newton-Schulz times per matrix shape on one device (pure C++, no
// LibTorch): what the owner planner balances by under owner_cost_model = "profiled", instead of the
// FLOP formula that misjudges small and skinny matrices (their time is per-call overhead, not
// multiply-adds). `dmuon plan --calibrate` measures one (tools/ns_calibration.h); the file can be given
// on its own or inside a hardware description ("ns_profile" key, tools/step_simulator.h).
//
// Time model of k matrices of one shape on one owner, the way Muon::step runs them on that device
// (one stacked NS call where stacking pays, else one call each):
//     t(k) = fixed_us + per_matrix_us * k,
// from two measurements per shape: one matrix alone (single_us) and `batch` matrices (batch_us):
// per_matrix_us = (batch_us - single_us) / (batch - 1), fixed_us = single_us - per_matrix_us (both
// clamped at 0). A shape that is not measured is priced by a least-squares fit of single_us
// against the shape's Newton-Schulz multiply-adds over the measured shapes (no batching gain).
//
// JSON: {"device": "cpu", "source": "...", "ns_steps": 5,
//        "timings": [{"rows": 32, "cols": 32, "elem_bytes": 4, "batch": 8,
//                     "single_us": 61.0, "batch_us": 290.0}, ...]}
// Shapes are matched without orientation ((rows, cols) and (cols, rows) are one shape, as NS
// transposes tall matrices), by elem_bytes first, else the same shape at any elem_bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dmuon {

struct NsTiming {
  int64_t rows = 0, cols = 0;
  int64_t elem_bytes = 4;  // the parameter's element size (bf16 = 2, fp32 = 4, fp64 = 8)
  int batch = 1;           // matrices in the batched measurement (>= 2, or 1 = no batched figure)
  double single_us = 0;    // one matrix, one NS call
  double batch_us = 0;     // `batch` matrices as Muon::step runs them
};

struct NsCost {
  double fixed_us = 0;       // paid once per (owner, shape): launches, stacking
  double per_matrix_us = 0;  // each matrix of the shape on that owner
  bool measured = false;     // false: from the fit over the measured shapes
  double of(int64_t k) const { return k > 0 ? fixed_us + per_matrix_us * static_cast<double>(k) : 0.0; }
};

struct NsProfile {
  std::string device = "cpu";
  std::string source;
  int ns_steps = 5;
  std::vector<NsTiming> timings;

  // The cost of matrices of this shape. Throws std::invalid_argument when the profile is empty.
  NsCost cost_of(int64_t rows, int64_t cols, int64_t elem_bytes) const;
  // Stable 64-bit hash of every field that changes a cost (part of the plan fingerprint, so ranks
  // that read different profiles fail with a fingerprint mismatch, not a hang).
  uint64_t digest() const;
};

// Throws std::invalid_argument naming `source` and the bad entry: ns_steps < 1, no timings, a side,
// element size or batch < 1, a time that is not finite and > 0.
void validate_ns_profile(const NsProfile& profile, const std::string& source);
// Parse / write the JSON above. Errors name `source` and the bad entry (index, field).
NsProfile ns_profile_from_json(const std::string& json_text, const std::string& source);
std::string ns_profile_to_json(const NsProfile& profile);
// A profile file, or a hardware description JSON holding one under "ns_profile".
NsProfile load_ns_profile(const std::string& path);

}  // namespace dmuon
