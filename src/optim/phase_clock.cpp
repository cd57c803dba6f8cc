// Phase timing of an optimizer step (see phase_clock.h).
#include "optim/phase_clock.h"

#include <c10/util/Exception.h>

#include <utility>

#if DMUON_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace dmuon::detail {

struct PhaseClock::Events {
#if DMUON_WITH_CUDA
  c10::DeviceIndex device = 0;
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> events;
  std::vector<std::pair<Phase, std::pair<int, int>>> spans;  // phase, (start event, end event)
  int record() {
    const c10::cuda::CUDAGuard guard(device);  // the parameters' device, not whichever is current
    events.push_back(std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault));  // timing enabled
    events.back()->record(at::cuda::getCurrentCUDAStream(device));
    return static_cast<int>(events.size()) - 1;
  }
#endif
};

PhaseClock::PhaseClock(std::optional<at::Device> cuda_device) {
#if DMUON_WITH_CUDA
  if (cuda_device && cuda_device->is_cuda()) {
    events_ = std::make_unique<Events>();
    events_->device = cuda_device->has_index() ? cuda_device->index() : c10::cuda::current_device();
  }
#else
  (void)cuda_device;
#endif
}

PhaseClock::~PhaseClock() = default;
PhaseClock::PhaseClock(PhaseClock&&) noexcept = default;
PhaseClock& PhaseClock::operator=(PhaseClock&&) noexcept = default;

PhaseClock::Mark PhaseClock::now() {
  Mark m;
  m.host = std::chrono::steady_clock::now();
#if DMUON_WITH_CUDA
  if (events_) m.event = events_->record();
#endif
  return m;
}

void PhaseClock::add(Phase p, const Mark& since) {
  host_ms_[static_cast<size_t>(p)] +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since.host).count();
#if DMUON_WITH_CUDA
  if (events_ && since.event >= 0) events_->spans.push_back({p, {since.event, events_->record()}});
#endif
}

void PhaseClock::resolve(StepProfile& out) {
  std::array<double, static_cast<size_t>(Phase::kCount)> ms = host_ms_;
  out.clock = "host";
#if DMUON_WITH_CUDA
  if (events_) {
    ms.fill(0);
    for (const auto& [p, se] : events_->spans) {
      auto& end = *events_->events[static_cast<size_t>(se.second)];
      end.synchronize();
      ms[static_cast<size_t>(p)] += events_->events[static_cast<size_t>(se.first)]->elapsed_time(end);
    }
    out.clock = "cuda_events";
    out.host_total_ms = host_ms_[static_cast<size_t>(Phase::Total)];
  }
#endif
  out.prepare_ms = ms[static_cast<size_t>(Phase::Prepare)];
  out.muon_ms = ms[static_cast<size_t>(Phase::Muon)];
  out.ns_ms = ms[static_cast<size_t>(Phase::Ns)];
  out.adamw_ms = ms[static_cast<size_t>(Phase::Adamw)];
  out.publish_ms = ms[static_cast<size_t>(Phase::Publish)];
  out.total_ms = ms[static_cast<size_t>(Phase::Total)];
  if (out.host_total_ms == 0) out.host_total_ms = out.total_ms;
}

}  // namespace dmuon::detail
