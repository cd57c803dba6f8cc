// Test support: N ranks as threads of one process, Gloo on 127.0.0.1 over a fresh FileStore (or,
// without Gloo, dmuon's store backend over one shared in-memory HashStore).
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>

#include "dmuon/bootstrap.h"
#include "dmuon/process_group.h"
#include "support/temp_dir.h"  // fresh_temp_dir

namespace dmuon::testing {

// The message of the std::exception `fn` throws ("" when it throws none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Throws std::runtime_error(what) unless ok (checks inside rank threads, which run_ranks reports).
inline void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}


struct RankContext {
  int rank = 0;
  int world = 1;
  StorePtr store;     // the FileStore all ranks share
  CommPtr pg;         // a Gloo world group
  ProcessGroupFactory factory;  // what the rank's meshes build their groups with
  at::Device device{at::kCPU};  // where the groups' tensors live
};

// Runs fn on `world` threads, one per rank, each with its own Gloo group over one fresh FileStore.
// Rethrows the first failure as a std::runtime_error prefixed with the rank. Collective timeouts
// are `timeout` so a broken test fails instead of hanging. With `loopback`, every group (the world
// and the meshes') is dmuon's loopback backend on loopback->device instead (one in-memory store).
void run_ranks(int world, const std::function<void(RankContext&)>& fn,
               std::chrono::milliseconds timeout = std::chrono::seconds(60),
               const std::optional<LoopbackOptions>& loopback = std::nullopt);

// run_ranks, returning what fn returned on rank 0.
template <typename T>
T rank0_result(int world, const std::function<T(RankContext&)>& fn) {
  T out;
  std::mutex mu;
  run_ranks(world, [&](RankContext& ctx) {
    T mine = fn(ctx);
    if (ctx.rank != 0) return;
    std::lock_guard<std::mutex> g(mu);
    out = std::move(mine);
  });
  return out;
}

}  // namespace dmuon::testing
