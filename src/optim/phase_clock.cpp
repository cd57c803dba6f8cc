// Phase timing of an optimizer step (see phase_clock.h).
#include "optim/phase_clock.h"

#include <utility>

namespace dmuon::detail {

PhaseClock::PhaseClock(std::optional<at::Device> cuda_device) {
  if (cuda_device && cuda_device->is_cuda()) {
    auto spans = std::make_unique<DeviceSpans>(*cuda_device);
    if (spans->active()) events_ = std::move(spans);  // (a build without CUDA: host time only)
  }
}

PhaseClock::~PhaseClock() = default;
PhaseClock::PhaseClock(PhaseClock&&) noexcept = default;
PhaseClock& PhaseClock::operator=(PhaseClock&&) noexcept = default;

PhaseClock::Mark PhaseClock::now() {
  Mark m;
  m.host = std::chrono::steady_clock::now();
  if (events_) m.event = events_->begin();
  return m;
}

void PhaseClock::add(Phase p, const Mark& since) {
  host_ms_[static_cast<size_t>(p)] +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since.host).count();
  if (events_) events_->end(since.event, static_cast<int>(p));
}

void PhaseClock::resolve(StepProfile& out) {
  std::array<double, static_cast<size_t>(Phase::kCount)> ms = host_ms_;
  out.clock = "host";
  if (events_) {
    ms.fill(0);
    for (const auto& [p, t] : events_->take_ms()) ms[static_cast<size_t>(p)] += t;
    out.clock = "cuda_events";
    out.host_total_ms = host_ms_[static_cast<size_t>(Phase::Total)];
  }
  out.prepare_ms = ms[static_cast<size_t>(Phase::Prepare)];
  out.muon_ms = ms[static_cast<size_t>(Phase::Muon)];
  out.ns_ms = ms[static_cast<size_t>(Phase::Ns)];
  out.adamw_ms = ms[static_cast<size_t>(Phase::Adamw)];
  out.publish_ms = ms[static_cast<size_t>(Phase::Publish)];
  out.total_ms = ms[static_cast<size_t>(Phase::Total)];
  if (out.host_total_ms == 0) out.host_total_ms = out.total_ms;
}

}  // namespace dmuon::detail
