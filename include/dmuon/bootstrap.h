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
  // nullopt when RANK/WORLD_SIZE are unset; throws std::invalid_argument naming the variable when
  // a value is malformed (non-numeric, rank outside [0, world), port outside [1, 65535]).
  static std::optional<LaunchEnv> from_environment();
};

// TCPStore: rank 0 serves, the others connect (retrying until `timeout`).
StorePtr make_tcp_store(const std::string& host, int port, int rank, int world_size,
                        std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);
// FileStore at `path` (use a fresh path per job: a file left by a crashed run reads as live state).
StorePtr make_file_store(const std::string& path, int world_size);

// Whether this build can create a group for the device type (Gloo: CPU, NCCL: CUDA).
bool process_group_available(c10::DeviceType device);
// A concrete group over `store`. CPU -> Gloo on `hostname` (127.0.0.1 by default), CUDA -> NCCL.
// Throws with the reason when the backend is not compiled in.
CommPtr make_process_group(const StorePtr& store, int rank, int size, c10::DeviceType device,
                           std::chrono::milliseconds timeout = kDefaultCollectiveTimeout,
                           const std::string& hostname = "127.0.0.1");
// The factory Mesh uses to build its own (isolated) groups for `device`.
ProcessGroupFactory process_group_factory(c10::DeviceType device, const std::string& hostname = "127.0.0.1");

// Everything a rank needs: the store, the world group and a 1-D mesh over it.
struct Bootstrap {
  StorePtr store;
  CommPtr world;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
};
// From the launch environment (TCPStore at MASTER_ADDR:MASTER_PORT); a single-process world
// (rank 0 of 1, FileStore in a temp dir) when the variables are unset.
Bootstrap bootstrap_from_environment(c10::DeviceType device,
                                     std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);

}  // namespace dmuon
