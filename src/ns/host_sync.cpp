// Counted device-to-host reads (see include/dmuon/host_sync.h).
#include "dmuon/host_sync.h"

#if DMUON_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
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
  return t.to(at::kCPU).contiguous();
}
}  // namespace detail

}  // namespace dmuon
