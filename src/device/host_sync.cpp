// Counted device-to-host reads (see include/dmuon/host_sync.h).
#include "dmuon/host_sync.h"

#if DMUON_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace dmuon {

namespace {
thread_local int64_t t_host_syncs = 0;
}  // namespace

int64_t host_sync_count() { return t_host_syncs; }

void wait_for_device(const at::Device& device) {
#if DMUON_WITH_CUDA
  if (device.is_cuda()) at::cuda::getCurrentCUDAStream(device.index()).synchronize();
#else
  (void)device;
#endif
}

namespace detail {
at::Tensor read_to_host(const at::Tensor& t) {
  ++t_host_syncs;
#if DMUON_WITH_CUDA
  // a counted read is the one synchronisation dmuon means to make: CUDA's sync debug mode (which
  // tests set to L_ERROR to catch every other one) is off for its duration
  if (t.is_cuda()) {
    auto& ws = c10::cuda::warning_state();
    const auto mode = ws.get_sync_debug_mode();
    ws.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    try {
      at::Tensor h = t.to(at::kCPU).contiguous();
      ws.set_sync_debug_mode(mode);
      return h;
    } catch (...) {
      ws.set_sync_debug_mode(mode);
      throw;
    }
  }
#endif
  return t.to(at::kCPU).contiguous();
}
}  // namespace detail

}  // namespace dmuon
