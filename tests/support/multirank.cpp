#include "support/multirank.h"

#include <atomic>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <condition_variable>
#include <thread>
#include <vector>

#include <c10/core/AutogradState.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "dmuon/bootstrap.h"
#include "dmuon/env.h"

namespace dmuon::testing {

void run_ranks(int world, const std::function<void(RankContext&)>& fn, std::chrono::milliseconds timeout,
               const std::optional<LoopbackOptions>& loopback) {
  const std::string dir = fresh_temp_dir("dmuon-store");
  const std::string path = dir + "/store";
  // dmuon's store backend (no Gloo in this LibTorch, or DMUON_CPU_BACKEND=store) moves every payload
  // through the store: one in-memory HashStore shared by the rank threads keeps that fast.
  const StorePtr shared = gloo_available() && env::cpu_backend() != "store" && !loopback
                             ? StorePtr()
                             : StorePtr(c10::make_intrusive<c10d::HashStore>());
  std::vector<std::thread> threads;
  std::mutex mu;
  std::string first_error;
  // No rank destroys its process group before every rank is done: Gloo closes the pairs with the
  // group, and a peer still connecting (or reading) would see "Connection closed by peer".
  std::mutex done_mu;
  std::condition_variable done_cv;
  int done = 0;
  auto arrive_and_wait = [&] {
    std::unique_lock<std::mutex> l(done_mu);
    ++done;
    done_cv.notify_all();
    done_cv.wait(l, [&] { return done == world; });
  };
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      RankContext ctx;
      try {
        ctx.rank = r;
        ctx.world = world;
        ctx.store = shared ? shared : make_file_store(path, world);
        if (loopback) {
#if DMUON_TORCH_AT_LEAST(2, 0)
          // ranks as threads on one GPU: every rank's CUDA backward would run on the autograd engine's
          // one worker thread for that device, where a hook of one rank waiting for a peer's
          // collective blocks the peer's hook behind it. Each rank runs its backward on its own thread.
          if (!loopback->device.is_cpu()) c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
#endif
          ctx.pg = make_loopback_process_group(ctx.store, r, world, *loopback, timeout);
          ctx.factory = loopback_process_group_factory(*loopback);
          ctx.device = loopback->device;
        } else {
          ctx.pg = make_process_group(ctx.store, r, world, c10::DeviceType::CPU, timeout);
          ctx.factory = process_group_factory(c10::DeviceType::CPU);
        }
        fn(ctx);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> g(mu);
        if (first_error.empty()) first_error = "rank " + std::to_string(r) + ": " + e.what();
      }
      arrive_and_wait();
    });
  }
  for (auto& t : threads) t.join();
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  if (!first_error.empty()) throw std::runtime_error(first_error);
}

}  // namespace dmuon::testing
