// Internal: times the phases of one optimizer step. Host clocks always; with CUDA events on the
// GPU when asked (record_step_profile on a CUDA model): a pair of events per span, recorded on the
// current stream and read only when the profile is consumed, so profiling adds no host-device sync
// to the step itself (2 event records per span: ~2 us of host time each on the H200 class of GPUs).
#pragma once

#include <c10/core/Device.h>

#include <optional>

#include <array>
#include <chrono>
#include <memory>
#include <vector>

#include "device/device_spans.h"
#include "dmuon/muon.h"

namespace dmuon::detail {

enum class Phase { Prepare, Muon, Ns, Adamw, Publish, Total, kCount };

class PhaseClock {
 public:
  struct Mark {
    std::chrono::steady_clock::time_point host;
    int event = -1;  // index of the start event (CUDA events only)
  };
  // `cuda_device`: time by CUDA events on that device's current stream (a device guard makes that
  // so whatever device is current); unset: host time only.
  explicit PhaseClock(std::optional<at::Device> cuda_device);
  ~PhaseClock();
  PhaseClock(PhaseClock&&) noexcept;
  PhaseClock& operator=(PhaseClock&&) noexcept;

  Mark now();
  void add(Phase p, const Mark& since);  // the span [since, now] counts for phase p
  // Writes the phase times into `out` (milliseconds) and its clock name; CUDA events are
  // synchronized here (the only wait profiling adds).
  void resolve(StepProfile& out);
  bool cuda_events() const { return events_ != nullptr; }

 private:
  std::array<double, static_cast<size_t>(Phase::kCount)> host_ms_{};
  std::unique_ptr<DeviceSpans> events_;  // CUDA: spans keyed by Phase
};

}  // namespace dmuon::detail
