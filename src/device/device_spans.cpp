// CUDA event spans (see device_spans.h).
#include "device/device_spans.h"

#include <utility>
#include <vector>

#if DMUON_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace dmuon::detail {

struct DeviceSpans::Events {
#if DMUON_WITH_CUDA
  c10::DeviceIndex device = 0;
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> starts;  // by id, until take_ms
  struct Ended {
    int key, id;
    std::unique_ptr<at::cuda::CUDAEvent> end;
  };
  std::vector<Ended> ended;
  std::unique_ptr<at::cuda::CUDAEvent> record() {
    const c10::cuda::CUDAGuard guard(device);  // this device's stream, whichever device is current
    auto e = std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault);  // timing enabled
    e->record(at::cuda::getCurrentCUDAStream(device));
    return e;
  }
#endif
};

DeviceSpans::DeviceSpans(const at::Device& device) {
#if DMUON_WITH_CUDA
  if (device.is_cuda()) {
    events_ = std::make_unique<Events>();
    events_->device = device.has_index() ? device.index() : c10::cuda::current_device();
  }
#else
  (void)device;
#endif
}

DeviceSpans::~DeviceSpans() = default;
DeviceSpans::DeviceSpans(DeviceSpans&&) noexcept = default;
DeviceSpans& DeviceSpans::operator=(DeviceSpans&&) noexcept = default;

int DeviceSpans::begin() {
#if DMUON_WITH_CUDA
  if (events_) {
    events_->starts.push_back(events_->record());
    return static_cast<int>(events_->starts.size()) - 1;
  }
#endif
  return -1;
}

void DeviceSpans::end(int id, int key) {
#if DMUON_WITH_CUDA
  if (events_ && id >= 0) events_->ended.push_back(Events::Ended{key, id, events_->record()});
#else
  (void)id;
  (void)key;
#endif
}

std::map<int, double> DeviceSpans::take_ms() {
  std::map<int, double> out;
#if DMUON_WITH_CUDA
  if (!events_) return out;
  for (auto& e : events_->ended) {
    e.end->synchronize();
    out[e.key] += events_->starts[static_cast<size_t>(e.id)]->elapsed_time(*e.end);
  }
  events_->ended.clear();
  events_->starts.clear();
#endif
  return out;
}

}  // namespace dmuon::detail
