// Counted device-to-host reads (see include/dmuon/host_sync.h).
#include "dmuon/host_sync.h"

namespace dmuon {

namespace {
thread_local int64_t t_host_syncs = 0;
}  // namespace

int64_t host_sync_count() { return t_host_syncs; }

namespace detail {
at::Tensor read_to_host(const at::Tensor& t) {
  ++t_host_syncs;
  return t.to(at::kCPU).contiguous();
}
}  // namespace detail

}  // namespace dmuon
