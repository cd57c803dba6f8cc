// cli_launch.h -- starting N local ranks as child processes (or running as one rank under any
// launcher that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT).
#pragma once

#include <exception>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "dmuon/communicator.h"
#include "dmuon/process_group.h"

namespace CLI {
class App;
}

namespace dmuon::cli {

// A free TCP port on 127.0.0.1 (bound and released), or throws.
int pick_free_port();
// True when `port` can be bound on 127.0.0.1 right now.
bool port_available(int port);

struct LaunchOptions {
  int ranks = 4;
  int port = 0;                 // 0: pick a free one
  std::vector<std::string> args;  // the subcommand's own arguments (re-passed to every child)
  std::string subcommand;         // "train" | "bench"
};

// Parent side: runs `/proc/self/exe <subcommand> <args...>` once per rank with the torchrun
// variables set. Children die with the parent (PR_SET_PDEATHSIG); if one child fails the others
// are stopped; SIGINT/SIGTERM stop all children. Returns the exit status for the parent (0 when
// every rank succeeded).
int launch_local_ranks(const LaunchOptions& opts, std::ostream& err);

// Child side: whether this process was started by launch_local_ranks (or any launcher).
bool launched_as_rank();

// Parses `args` into `app`. Returns an exit code when the command should stop here (0 after --help,
// 2 after a parse error, with the message on `err`), nullopt to go on.
std::optional<int> parse_args(CLI::App& app, std::vector<std::string> args, std::ostream& out,
                              std::ostream& err);

// collective: every rank of `group` leaves together. Rank 0 hosts the store, and a rank that exits
// while a peer is still inside a collective with it resets the peer's connections ("Connection
// reset by peer" after a finished run): so all pass a barrier, then rank 0 waits (up to timeout_s)
// until every rank has marked `who` done in the store before it exits.
void leave_together(Communicator& group, const StorePtr& store, const std::string& who, double timeout_s);

// What the CLI prints for a failure: the message without a C++ backtrace (c10::Error's frames and
// "Exception raised from ..." lines are for developers, not for the user who passed a bad flag).
std::string error_text(const std::exception& e);

// Writes `content` to `path` atomically (dmuon::write_file_atomically).
void write_file_atomic(const std::string& path, const std::string& content);

}  // namespace dmuon::cli
