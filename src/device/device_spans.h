// Internal: how long a device's stream spent on spans of work, measured by CUDA event pairs recorded
// on its current stream and read only when asked (so measuring adds no host-device sync where the
// spans are recorded). On the CPU, or in a build without CUDA, inactive: begin() returns -1.
#pragma once

#include <c10/core/Device.h>

#include <map>
#include <memory>

namespace dmuon::detail {

class DeviceSpans {
 public:
  explicit DeviceSpans(const at::Device& device);  // active for a CUDA device in a CUDA build
  ~DeviceSpans();
  DeviceSpans(DeviceSpans&&) noexcept;
  DeviceSpans& operator=(DeviceSpans&&) noexcept;
  bool active() const { return events_ != nullptr; }
  // Records a start event on the device's current stream: the id to end() with (-1 when inactive).
  int begin();
  // Records the end event of span `id` (begun since the last take_ms), counted under `key`; a span
  // may end several times (each end is its own span from the same start).
  void end(int id, int key);
  // Waits for the recorded events and returns the milliseconds per key of every span ended since
  // the last take (then forgets them).
  std::map<int, double> take_ms();

 private:
  struct Events;  // CUDA events (defined only in a CUDA build)
  std::unique_ptr<Events> events_;
};

}  // namespace dmuon::detail
