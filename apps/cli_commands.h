// cli_commands.h -- the LibTorch subcommands of the dmuon tool.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace dmuon::cli {

// `dmuon train ...`: trains a small GPT on N local ranks (or as one rank under a launcher).
int run_train_command(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);
// `dmuon bench step ...`: step time and bytes of DMuon Z2/Z3 against the designs users would pick.
int run_bench_command(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace dmuon::cli
