// dmuon: the command-line tool. Subcommands: plan (offline owner planner), train (the main job),
// bench (measurement programs), version.
#include <iostream>
#include <string>
#include <vector>

#include "plan_cmd.h"
#ifndef DMUON_CLI_PLAN_ONLY
#include "cli_commands.h"
#define DMUON_CLI_FULL 1
#endif

namespace {
void usage(std::ostream& o) {
  o << "usage: dmuon <command> [options]\n\n"
       "commands:\n"
       "  plan    plan Muon matrix owners for a model and cluster, offline (dmuon plan --help)\n"
#ifdef DMUON_CLI_FULL
       "  train   train a small GPT on N local ranks with dedicated-ownership Muon (dmuon train --help)\n"
       "  bench   measurement programs: `dmuon bench step` (dmuon bench --help)\n"
#endif
       "  version print the version\n";
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage(std::cerr);
    return 2;
  }
  const std::string cmd = argv[1];
  std::vector<std::string> rest(argv + 2, argv + argc);
#ifdef DMUON_CLI_FULL
  if (cmd == "plan") return dmuon::cli::run_plan_command(rest, std::cout, std::cerr, &dmuon::cli::calibrate_device);
#else
  if (cmd == "plan") return dmuon::cli::run_plan_command(rest, std::cout, std::cerr);
#endif
#ifdef DMUON_CLI_FULL
  if (cmd == "train") return dmuon::cli::run_train_command(rest, std::cout, std::cerr);
  if (cmd == "bench") return dmuon::cli::run_bench_command(rest, std::cout, std::cerr);
#endif
  if (cmd == "version" || cmd == "--version") {
    std::cout << "dmuon 0.1.0\n";
    return 0;
  }
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    usage(std::cout);
    return 0;
  }
  std::cerr << "error: unknown command '" << cmd << "'\n";
  usage(std::cerr);
  return 2;
}
