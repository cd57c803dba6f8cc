// bootstrap.h -- creating stores and concrete process groups (Gloo for CPU tensors, NCCL for CUDA
// tensors). This is the only dmuon code that names a concrete backend; it is a separate library
// (dmuon::dmuon_bootstrap) so the core builds where Gloo's headers are missing (pip LibTorch 2.x).
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "dmuon/mesh.h"
#include "dmuon/process_group.h"

namespace dmuon {

// torchrun-style launch variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // torchrun (elastic agent) with TORCHELASTIC_USE_AGENT_STORE=True: the agent already serves the
  // TCPStore at MASTER_ADDR:MASTER_PORT, every rank connects as a client and works under the prefix
  // "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>" (a restarted job starts from fresh keys).
  bool agent_store = false;
  int restart_count = 0;
  // nullopt when RANK/WORLD_SIZE are unset; throws std::invalid_argument naming the variable when
  // a value is malformed (non-numeric, rank outside [0, world), port outside [1, 65535]).
  static std::optional<LaunchEnv> from_environment();
};

// TCPStore: rank 0 serves, the others connect (retrying until `timeout`); with `serve = false`
// every rank connects (a launcher serves it).
StorePtr make_tcp_store(const std::string& host, int port, int rank, int world_size,
                        std::chrono::milliseconds timeout = kDefaultCollectiveTimeout, bool serve = true);
// The store a launch environment describes: the TCPStore at MASTER_ADDR:MASTER_PORT, served by rank
// 0 or (agent_store) by torchrun's agent under its attempt prefix.
StorePtr make_launch_store(const LaunchEnv& env, std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);
// FileStore at `path` (use a fresh path per job: a file left by a crashed run reads as live state).
StorePtr make_file_store(const std::string& path, int world_size);

// Whether this build can create a group for the device type (CPU: always, Gloo or the store
// backend; CUDA: NCCL).
bool process_group_available(c10::DeviceType device);
// Whether CPU groups can be Gloo: this LibTorch has Gloo and its headers were found at build time
// (Debian's libtorch-dev + libgloo-dev; not PyPI's wheels).
bool gloo_available();
// dmuon's store backend: the collectives dmuon uses, exchanged through `store`, executed in issue
// order on one worker thread per group. For CPU tensors where Gloo is missing; correct and
// deterministic (rank-order sums), not fast. make_process_group(CPU) uses it when Gloo is not
// available or DMUON_CPU_BACKEND=store.
CommPtr make_store_process_group(const StorePtr& store, int rank, int size,
                                 std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);
// dmuon's loopback backend, for ranks that are threads of one process (tests; one GPU proving the
// multi-rank code): the ranks' tensors are copied and summed directly on `device` (sums in rank order,
// bit-identical on every rank). On CUDA it runs each collective on the group's own stream after the
// issuing ranks' streams (events), sleeps `sleep_cycles` (at::cuda::sleep) before each copy when
// asked, so a result read without a wait is wrong, holds the tensors until wait(), and its
// Work::wait() is a stream dependency (with a timeout: a host wait too), as NCCL's. Tensors of
// another device are refused. Every rank of a group creates it over the same store, in one process.
struct LoopbackOptions {
  at::Device device{at::kCPU};
  int64_t sleep_cycles = 0;  // CUDA only
};
CommPtr make_loopback_process_group(const StorePtr& store, int rank, int size, const LoopbackOptions& opts,
                                    std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);
ProcessGroupFactory loopback_process_group_factory(const LoopbackOptions& opts);
// CUDA: the priority of the group's NCCL stream. Collectives run on the group's own stream, ordered
// against compute by events (Pending::wait makes the current stream wait; the host blocks only in
// Pending::wait_host, where it must: host reads of a result, barriers, checkpoint I/O).
enum class StreamPriority { High, Normal };
// A concrete group over `store`. CPU -> Gloo on `hostname` (127.0.0.1 by default; the store backend
// where Gloo is missing or DMUON_CPU_BACKEND=store), CUDA -> NCCL on the current CUDA device: the
// group is bound to it (setBoundDeviceId) and connected at once (eagerConnectSingleDevice), so a
// mesh's NCCL communicators are created in the mesh's fixed creation order at setup, never lazily
// mid-training, and a peer lost before a group's first use fails setup within the timeout. Throws
// with the reason when the backend is not compiled in.
CommPtr make_process_group(const StorePtr& store, int rank, int size, c10::DeviceType device,
                           std::chrono::milliseconds timeout = kDefaultCollectiveTimeout,
                           const std::string& hostname = "127.0.0.1", StreamPriority priority = StreamPriority::High);
// The factory Mesh uses to build its own (isolated) groups for `device`.
ProcessGroupFactory process_group_factory(c10::DeviceType device, const std::string& hostname = "127.0.0.1",
                                          StreamPriority priority = StreamPriority::High);

// Everything a rank needs to build its meshes: the store, the world group, its rank and local rank.
struct Bootstrap {
  StorePtr store;
  CommPtr world;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
};
// From the launch environment (TCPStore at MASTER_ADDR:MASTER_PORT); a single-process world
// (rank 0 of 1, an in-memory HashStore: nothing is written to disk) when the variables are unset.
Bootstrap bootstrap_from_environment(c10::DeviceType device,
                                     std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);

}  // namespace dmuon
