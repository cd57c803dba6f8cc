// cli_commands.h -- the LibTorch subcommands of the dmuon tool.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "plan_cmd.h"

namespace dmuon::cli {

// `dmuon plan --calibrate`'s measurement (NS per shape, matmul rate, memory bandwidth on one device).
CalibrationResult calibrate_device(const CalibrationRequest& req, std::ostream& log);

// `dmuon train ...`: trains a small GPT on N local ranks (or as one rank under a launcher).
int run_train_command(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);
// `dmuon bench step ...`: step time and bytes of DMuon Z2/Z3 against the designs users would pick.
int run_bench_command(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace dmuon::cli
