// plan_cmd.h -- `dmuon plan`: the offline owner planner as a command (LibTorch-free).
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace dmuon::cli {

// Runs `dmuon plan <args...>` (args = the arguments after "plan"). Writes the report (or, with
// --json, the whole plan as JSON) to `out`. Never throws: a bad argument or input prints one line
// "error: ..." naming the offending value to `err` and returns non-zero (2 for command-line usage
// errors, 1 for bad input files or values); --help prints usage to `out` and returns 0.
// See docs/PLAN_TOOL.md for the flags and the JSON schema.
int run_plan_command(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace dmuon::cli

// The same function at namespace dmuon (what apps/main.cpp calls).
namespace dmuon {
using cli::run_plan_command;
}
