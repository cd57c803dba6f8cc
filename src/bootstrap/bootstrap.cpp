// The only code that names a concrete backend: Gloo (CPU tensors) and NCCL (CUDA tensors).
#include "dmuon/bootstrap.h"

#include "dmuon/env.h"
#include "comm/error_text.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <stdexcept>
#include <thread>
#include <vector>

// Gloo only where CMake allowed it (DMUON_WITH_GLOO: gloo headers that match this LibTorch's gloo,
// i.e. Debian's 1.13) AND this LibTorch was built with it AND the headers are here.
#if DMUON_USE_GLOO && defined(USE_C10D_GLOO) && __has_include(<gloo/algorithm.h>)
#define DMUON_HAVE_GLOO 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#else
#define DMUON_HAVE_GLOO 0
#endif

#if DMUON_WITH_CUDA && defined(USE_C10D_NCCL)
#define DMUON_HAVE_NCCL 1
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#else
#define DMUON_HAVE_NCCL 0
#endif

namespace dmuon {

namespace {
int parse_int(const char* var, const std::string& v) {
  try {
    size_t pos = 0;
    const int x = std::stoi(v, &pos);
    if (pos != v.size()) throw std::invalid_argument("trailing characters");
    return x;
  } catch (const std::exception&) {
    throw std::invalid_argument(std::string(var) + "='" + v + "' is not an integer");
  }
}
std::string getenv_str(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}
}  // namespace

std::optional<LaunchEnv> LaunchEnv::from_environment() {
  const std::string rank = getenv_str("RANK"), world = getenv_str("WORLD_SIZE");
  if (rank.empty() && world.empty()) return std::nullopt;
  if (rank.empty() || world.empty())
    throw std::invalid_argument("RANK and WORLD_SIZE must be set together (got RANK='" + rank + "', WORLD_SIZE='" +
                                world + "'); a launcher such as torchrun sets both");
  LaunchEnv e;
  e.rank = parse_int("RANK", rank);
  e.world_size = parse_int("WORLD_SIZE", world);
  if (e.world_size < 1) throw std::invalid_argument("WORLD_SIZE=" + world + " must be >= 1");
  if (e.rank < 0 || e.rank >= e.world_size)
    throw std::invalid_argument("RANK=" + rank + " is outside [0, WORLD_SIZE=" + world + ")");
  const std::string lr = getenv_str("LOCAL_RANK");
  e.local_rank = lr.empty() ? e.rank : parse_int("LOCAL_RANK", lr);
  const std::string addr = getenv_str("MASTER_ADDR");
  if (!addr.empty()) e.master_addr = addr;
  const std::string port = getenv_str("MASTER_PORT");
  if (!port.empty()) e.master_port = parse_int("MASTER_PORT", port);
  if (e.master_port < 1 || e.master_port > 65535)
    throw std::invalid_argument("MASTER_PORT=" + port + " is outside [1, 65535]");
  const std::string agent = getenv_str("TORCHELASTIC_USE_AGENT_STORE");
  e.agent_store = agent == "True" || agent == "true" || agent == "1";
  const std::string restarts = getenv_str("TORCHELASTIC_RESTART_COUNT");
  e.restart_count = restarts.empty() ? 0 : parse_int("TORCHELASTIC_RESTART_COUNT", restarts);
  return e;
}

StorePtr make_tcp_store(const std::string& host, int port, int rank, int world_size,
                        std::chrono::milliseconds timeout, bool serve) {
  c10d::TCPStoreOptions o;  // set field by field: the struct grew fields in 2.x
  o.port = static_cast<uint16_t>(port);
  o.isServer = serve && rank == 0;
  o.numWorkers = static_cast<size_t>(world_size);
  // the server does not wait for its workers here: bootstrap_from_environment's check-in does, and
  // names the ranks that never came
  o.waitWorkers = false;
  o.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, o);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", rank, ": could not ", (rank == 0 ? "serve" : "reach"), " the TCPStore at ", host,
                ":", port, " (", e.what(), "). ",
                (rank == 0 && serve ? "Is the port already in use? Pick another MASTER_PORT."
                 : serve ? "Is rank 0 running and MASTER_ADDR/MASTER_PORT the same on every rank?"
                         : "Is the launcher's store (torchrun agent) at MASTER_ADDR:MASTER_PORT running?"));
  }
}

StorePtr make_launch_store(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  if (!env.agent_store) return make_tcp_store(env.master_addr, env.master_port, env.rank, env.world_size, timeout);
  // torchrun's agent serves the store; its workers use the attempt's prefix, as torch.distributed does
  StorePtr tcp = make_tcp_store(env.master_addr, env.master_port, env.rank, env.world_size, timeout, /*serve=*/false);
  return c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(env.restart_count), tcp);
}

StorePtr make_file_store(const std::string& path, int world_size) {
  return c10::make_intrusive<c10d::FileStore>(path, world_size);
}

bool gloo_available() { return DMUON_HAVE_GLOO != 0; }

bool process_group_available(c10::DeviceType device) {
  if (device == c10::DeviceType::CPU) return true;  // Gloo, or the store backend
  if (device == c10::DeviceType::CUDA) return DMUON_HAVE_NCCL != 0;
  return false;
}

#if DMUON_HAVE_GLOO
namespace {
bool is_loopback(const std::string& host) {
  return host.empty() || host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}
// The interface Gloo listens on: GLOO_SOCKET_IFNAME's (as torch.distributed), else `hostname`; the
// default loopback becomes this host's own address when MASTER_ADDR names another host (a
// multi-host job), so peers on other hosts can reach it.
std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& hostname, int rank) {
  const std::string ifname = getenv_str("GLOO_SOCKET_IFNAME");
  try {
    if (!ifname.empty()) return c10d::ProcessGroupGloo::createDeviceForInterface(ifname.substr(0, ifname.find(',')));
    if (is_loopback(hostname) && !is_loopback(getenv_str("MASTER_ADDR")))
      return c10d::ProcessGroupGloo::createDefaultDevice();
    return c10d::ProcessGroupGloo::createDeviceForHostname(hostname);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", rank, ": Gloo cannot listen on ",
                ifname.empty() ? "host '" + hostname + "'" : "interface '" + ifname + "' (GLOO_SOCKET_IFNAME)", ": ",
                e.what(), ". Set GLOO_SOCKET_IFNAME to an interface this host's peers reach (see `ip addr`).");
  }
}
}  // namespace
#endif

namespace {
// DMUON_CPU_BACKEND, checked: "" (Gloo where this build has it, else the store backend), "gloo" or "store".
std::string cpu_backend_choice(int rank) {
  const std::string choice = env::cpu_backend();
  TORCH_CHECK_VALUE(choice.empty() || choice == "gloo" || choice == "store", "rank ", rank, ": DMUON_CPU_BACKEND='",
                    choice, "' is not a CPU backend; use \"gloo\" or \"store\" (or leave it unset).");
  TORCH_CHECK_VALUE(choice != "gloo" || DMUON_HAVE_GLOO, "rank ", rank, ": DMUON_CPU_BACKEND=gloo, but this dmuon "
                    "build has no Gloo (this LibTorch ships no gloo headers, e.g. a PyPI wheel). Unset it to use "
                    "dmuon's store backend, or build against Debian's libtorch-dev + libgloo-dev.");
  return choice;
}
}  // namespace

CommPtr make_process_group(const StorePtr& store, int rank, int size, c10::DeviceType device,
                           std::chrono::milliseconds timeout, const std::string& hostname, StreamPriority priority) {
  if (device == c10::DeviceType::CPU) {
    const std::string choice = cpu_backend_choice(rank);
#if DMUON_HAVE_GLOO
    if (choice != "store") {
      auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
      opts->devices.push_back(gloo_device(hostname, rank));
      opts->threads = 2;
      return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
    }
#endif
    (void)hostname;
    return make_store_process_group(store, rank, size, timeout);
  }
  if (device == c10::DeviceType::CUDA) {
#if DMUON_HAVE_NCCL
    // NCCL runs every collective on the group's own stream (high priority for the broadcasts and
    // reduces on the critical path), makes it wait for the issuing stream with an event, and records
    // that stream on the tensors so the caching allocator keeps them until the collective is done.
    // a collective past the timeout: the watchdog aborts the communicators and the waiting work
    // throws (CleanUpOnly), so dmuon reports it; torch's default (3, SkipCleanUp) would end the
    // process without a word. A value the caller set is kept (docs/GPU.md).
    ::setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", /*overwrite=*/0);
    auto opts = c10d::ProcessGroupNCCL::Options::create(priority == StreamPriority::High);
    opts->timeout = timeout;
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
    // bound to this rank's GPU (the barrier and eager init use it instead of guessing from the rank)
    // and connected now: every rank creates its groups in the same order, so this is the
    // communicators' one creation order, at setup
    const at::Device gpu(at::kCUDA, c10::cuda::current_device());
    pg->setBoundDeviceId(gpu);
    pg->eagerConnectSingleDevice(gpu);
    return pg;
#else
    (void)priority;
    TORCH_CHECK(false, "rank ", rank, ": this dmuon build has no NCCL; CUDA tensors cannot be communicated. Build "
                "against a CUDA LibTorch with NCCL headers on the include path.");
#endif
  }
  TORCH_CHECK(false, "rank ", rank, ": no process group for device type ", device, "; dmuon supports CPU (Gloo) "
              "and CUDA (NCCL).");
}

ProcessGroupFactory process_group_factory(c10::DeviceType device, const std::string& hostname,
                                          StreamPriority priority) {
  return [device, hostname, priority](const StorePtr& store, int rank, int size, std::chrono::milliseconds timeout) {
    return make_process_group(store, rank, size, device, timeout, hostname, priority);
  };
}

namespace {
// Every rank announces itself under a key of its own, then waits until all have, polling until
// `deadline` (no blocking Store::wait: a TCPStore client holds its lock through one). A rank that
// never arrives is named, with the phase.
void check_in(const StorePtr& store, int rank, int world, std::chrono::steady_clock::time_point deadline,
              const std::string& phase) {
  auto key = [&](int r) { return "dmuon/check-in/" + phase + "/" + std::to_string(r); };
  store->set(key(rank), std::vector<uint8_t>{1});
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back(key(r));
  auto pause = std::chrono::microseconds(100);
  while (!store->check(keys)) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::string missing;
      for (int r = 0; r < world; ++r)
        if (!store->check({keys[static_cast<size_t>(r)]})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      TORCH_CHECK(false, "rank ", rank, ": setup phase '", phase, "': rank(s) ", missing, " of ", world,
                  " did not answer within the timeout (stopped, crashed, or started with other RANK/WORLD_SIZE/"
                  "MASTER_ADDR/MASTER_PORT?)");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
}
}  // namespace

Bootstrap bootstrap_from_environment(c10::DeviceType device, std::chrono::milliseconds timeout) {
  Bootstrap b;
  const auto env = LaunchEnv::from_environment();
  // a malformed backend choice is this rank's own mistake: said before connecting (not as a failed setup)
  if (device == c10::DeviceType::CPU) (void)cpu_backend_choice(env ? env->rank : 0);
  if (env) {
    b.rank = env->rank;
    b.world_size = env->world_size;
    b.local_rank = env->local_rank;
#if DMUON_HAVE_NCCL
    if (device == c10::DeviceType::CUDA) {  // one GPU per local rank: cuda:LOCAL_RANK
      const int gpus = static_cast<int>(c10::cuda::device_count());
      TORCH_CHECK(b.local_rank < gpus, "rank ", b.rank, ": LOCAL_RANK=", b.local_rank, " but this machine has ", gpus,
                  " CUDA device(s); dmuon uses one GPU per local rank, so start at most ", gpus,
                  " rank(s) per machine (torchrun --nproc-per-node ", gpus, ").");
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(b.local_rank));
    }
#endif
    const auto deadline = std::chrono::steady_clock::now() + timeout;  // one budget for the whole setup
    b.store = make_launch_store(*env, timeout);
    check_in(b.store, b.rank, b.world_size, deadline, "connecting to the store");
  } else {
    // one process: an in-memory store (nothing on disk for a run to leave behind)
    b.store = c10::make_intrusive<c10d::HashStore>();
  }
  try {
    b.world = make_process_group(b.store, b.rank, b.world_size, device, timeout);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", b.rank, ": setup phase 'connecting the world process group': ", detail::error_text(e), " (a rank stopped, crashed or unreachable after it "
                "checked in; every rank waits at most ", timeout.count(), " ms)");
  }
  return b;
}

}  // namespace dmuon
