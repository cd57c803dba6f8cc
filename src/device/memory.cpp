// The counting CPU allocator and the device memory statistics (see memory.h).
#include "dmuon/memory.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "dmuon/torch_version.h"

#include <atomic>
#include <mutex>
#include <new>

#if DMUON_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace dmuon::memory {

namespace {

struct TagCounters {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocations{0};
  std::array<std::atomic<int64_t>, kNumPhases> phase_peak{};
  std::atomic<int> phase{0};  // the tag's current phase (set by its threads' PhaseScope)
};
std::array<TagCounters, kMaxTags>& counters() {
  static std::array<TagCounters, kMaxTags> c;
  return c;
}

thread_local int t_tag = 0;

void raise(std::atomic<int64_t>& peak, int64_t v) {
  int64_t p = peak.load(std::memory_order_relaxed);
  while (v > p && !peak.compare_exchange_weak(p, v, std::memory_order_relaxed)) {
  }
}

void charge(int tag, int64_t bytes) {
  TagCounters& c = counters()[static_cast<size_t>(tag)];
  const int64_t now = c.current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  if (bytes <= 0) return;
  c.allocations.fetch_add(1, std::memory_order_relaxed);
  raise(c.peak, now);
  raise(c.phase_peak[static_cast<size_t>(c.phase.load(std::memory_order_relaxed))], now);
}

// Each counted allocation carries a header in front of the caller's bytes: the wrapped allocation
// and who to credit when it is freed. The caller's pointer is the DataPtr's context too, so LibTorch's
// raw_allocate / raw_deleter (oneDNN's scratch buffers, e.g. bf16 matmuls on CPUs with avx512_bf16)
// work through the counting allocator like through the default one.
struct Header {
  c10::DataPtr inner;
  int64_t bytes;
  int tag;
};
constexpr size_t kHeaderBytes = 64;  // keeps the caller's bytes at LibTorch's 64-byte alignment
static_assert(sizeof(Header) <= kHeaderBytes, "the allocation header must fit in front of the data");

void free_counted(void* data) {
  if (!data) return;
  auto* h = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeaderBytes);
  charge(h->tag, -h->bytes);
  c10::DataPtr inner = std::move(h->inner);  // owns the memory the header lives in
  h->~Header();
  inner.clear();
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
#if DMUON_TORCH_AT_LEAST(2, 3)  // non-const, copy_data
  c10::DataPtr allocate(size_t n) override { return wrap(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(size_t n) const override { return wrap(n); }
#endif
  c10::DeleterFnPtr raw_deleter() const override { return &free_counted; }

 private:
  c10::DataPtr wrap(size_t n) const {
    if (n == 0) return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));
    c10::DataPtr d = inner_->allocate(n + kHeaderBytes);
    char* base = static_cast<char*>(d.get());
    const c10::Device dev = d.device();
    const int tag = t_tag;
    new (base) Header{std::move(d), static_cast<int64_t>(n), tag};
    charge(tag, static_cast<int64_t>(n));
    void* data = base + kHeaderBytes;
    return c10::DataPtr(data, data, &free_counted, dev);
  }
  c10::Allocator* inner_;
};

std::mutex g_install_mu;
std::atomic<bool> g_installed{false};

}  // namespace

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::Setup: return "setup";
    case Phase::Forward: return "forward";
    case Phase::Backward: return "backward";
    case Phase::Step: return "step";
    case Phase::Checkpoint: return "checkpoint";
    case Phase::Other: break;
  }
  return "other";
}

void install_counting_allocator() {
  std::lock_guard<std::mutex> g(g_install_mu);
  if (g_installed) return;
  // never destroyed: tensors allocated through it may outlive any scope
  static CountingAllocator* alloc = new CountingAllocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(alloc, /*priority=*/100);
  g_installed = true;
}

bool counting_allocator_installed() { return g_installed; }

MemoryTag::MemoryTag(int tag) : prev_(t_tag) {
  TORCH_CHECK(tag >= 0 && tag < kMaxTags, "dmuon::memory::MemoryTag: tag ", tag, " is out of range [0, ", kMaxTags,
              "); use one tag per rank thread, e.g. rank + 1.");
  t_tag = tag;
}
MemoryTag::~MemoryTag() { t_tag = prev_; }
int current_tag() { return t_tag; }

PhaseScope::PhaseScope(Phase phase) : tag_(t_tag) {
  TagCounters& c = counters()[static_cast<size_t>(tag_)];
  prev_ = static_cast<Phase>(c.phase.exchange(static_cast<int>(phase)));
  raise(c.phase_peak[static_cast<size_t>(phase)], c.current.load());  // what is live on entry counts
}
PhaseScope::~PhaseScope() { counters()[static_cast<size_t>(tag_)].phase.store(static_cast<int>(prev_)); }

Stats stats(int tag) {
  TORCH_CHECK(tag >= 0 && tag < kMaxTags, "dmuon::memory::stats: tag ", tag, " is out of range [0, ", kMaxTags, ").");
  const TagCounters& c = counters()[static_cast<size_t>(tag)];
  Stats s;
  s.current = c.current.load();
  s.peak = c.peak.load();
  s.allocations = c.allocations.load();
  for (int i = 0; i < kNumPhases; ++i) s.peak_by_phase[static_cast<size_t>(i)] = c.phase_peak[static_cast<size_t>(i)].load();
  return s;
}

void reset_peaks(int tag) {
  TORCH_CHECK(tag >= 0 && tag < kMaxTags, "dmuon::memory::reset_peaks: tag ", tag, " is out of range [0, ", kMaxTags,
              ").");
  TagCounters& c = counters()[static_cast<size_t>(tag)];
  const int64_t now = c.current.load();
  c.peak.store(now);
  for (auto& p : c.phase_peak) p.store(0);
  c.phase_peak[static_cast<size_t>(c.phase.load())].store(now);
}

Stats device_stats(const at::Device& device) {
#if DMUON_WITH_CUDA
  if (device.is_cuda()) {
    const auto ds = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    Stats s;
    s.current = ds.allocated_bytes[0].current;  // StatType::AGGREGATE
    s.peak = ds.allocated_bytes[0].peak;
    s.allocations = ds.allocation[0].allocated;
    return s;
  }
#endif
  TORCH_CHECK(device.is_cpu(), "dmuon::memory::device_stats: no memory statistics for device ", device,
              " (CPU and CUDA only).");
  return stats();
}

void reset_device_peaks(const at::Device& device) {
#if DMUON_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
    return;
  }
#endif
  TORCH_CHECK(device.is_cpu(), "dmuon::memory::reset_device_peaks: no memory statistics for device ", device,
              " (CPU and CUDA only).");
  reset_peaks();
}

}  // namespace dmuon::memory
