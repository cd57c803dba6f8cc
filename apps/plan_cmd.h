// plan_cmd.h -- `dmuon plan`: the offline owner planner as a command (LibTorch-free).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "dmuon/ns_profile.h"

namespace dmuon::cli {

// `dmuon plan --calibrate FILE`: what to measure, and what was measured. The measurement needs
// LibTorch, so the full tool passes it in (apps/cli_calibrate.cpp); the plan-only build has none.
struct CalibrationRequest {
  std::vector<std::array<int64_t, 3>> shapes;  // (rows, cols, elem_bytes) of the model's Muon targets
  std::string device = "cpu";
  int reps = 5, batch = 8, ns_steps = 5, threads = 0;  // threads 0: LibTorch's default
};
struct CalibrationResult {
  NsProfile profile;
  double matmul_tflops = 0, memory_bandwidth_GBps = 0;
  std::string describe;  // the rates, one line
};
using CalibrateFn = std::function<CalibrationResult(const CalibrationRequest&, std::ostream& log)>;

// Runs `dmuon plan <args...>` (args = the arguments after "plan"). Writes the report (or, with
// --json, the whole plan as JSON) to `out`. Never throws: a bad argument or input prints one line
// "error: ..." naming the offending value to `err` and returns non-zero (2 for command-line usage
// errors, 1 for bad input files or values); --help prints usage to `out` and returns 0.
// See docs/PLAN_TOOL.md for the flags and the JSON schema.
// `calibrate` runs --calibrate (null: the option is an error naming the full build).
int run_plan_command(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
                     const CalibrateFn& calibrate = nullptr);

}  // namespace dmuon::cli

// The same function at namespace dmuon (what apps/main.cpp calls).
namespace dmuon {
using cli::run_plan_command;
}
