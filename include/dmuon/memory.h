// memory.h -- peak live bytes of tensors, measured: a counting CPU allocator, and the CUDA caching
// allocator's statistics on the GPU.
//
// Peak resident memory (RSS) is a blunt instrument: the C allocator keeps freed pages, so a rank
// that frees a matrix after forward shows no saving. This counts what tensors hold instead: every
// CPU tensor allocation made after install_counting_allocator() is charged to the calling thread's
// *tag* (0 unless a MemoryTag scope says otherwise) and to its current *phase*; freeing returns
// the bytes to the tag that allocated them, whichever thread frees. In one process per rank the tag
// is the process (0); tests that run ranks as threads give each rank thread its own tag.
//
//   dmuon::memory::install_counting_allocator();           // before the tensors to count exist
//   dmuon::memory::MemoryTag tag(rank + 1);                // (ranks as threads only)
//   { dmuon::memory::PhaseScope p(dmuon::memory::Phase::Forward); loss = model->loss(x); }
//   auto s = dmuon::memory::stats();                       // current, peak, peak per phase
//
// Resizing a storage to zero bytes and back (what dmuon does to free and regather a matrix) is a
// free and an allocation. Allocations that bypass LibTorch's CPU allocator (BLAS scratch, Gloo's
// internal buffers) are not counted.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <string>

namespace dmuon::memory {

enum class Phase : int { Other = 0, Setup, Forward, Backward, Step, Checkpoint };
inline constexpr int kNumPhases = 6;
inline constexpr int kMaxTags = 64;  // tags 0 .. kMaxTags-1
const char* phase_name(Phase p);     // "other", "setup", "forward", "backward", "step", "checkpoint"

struct Stats {
  int64_t current = 0;  // live bytes now
  int64_t peak = 0;     // the most live at once since the last reset_peaks
  std::array<int64_t, kNumPhases> peak_by_phase{};  // the most live at once while in that phase
  int64_t allocations = 0;
};

// Wraps LibTorch's CPU allocator with the counter (idempotent; thread-safe). Tensors allocated
// before it are not charged (their frees are not either).
void install_counting_allocator();
bool counting_allocator_installed();

// The calling thread's allocations go to `tag` while the scope lives (nests; restores the previous).
class MemoryTag {
 public:
  explicit MemoryTag(int tag);
  ~MemoryTag();
  MemoryTag(const MemoryTag&) = delete;
  MemoryTag& operator=(const MemoryTag&) = delete;

 private:
  int prev_;
};
int current_tag();

// The calling thread's tag is in `phase` while the scope lives (nests; restores the previous).
class PhaseScope {
 public:
  explicit PhaseScope(Phase phase);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  int tag_;
  Phase prev_;
};

Stats stats(int tag);
inline Stats stats() { return stats(current_tag()); }
// Peaks (overall and per phase) restart from the current live bytes.
void reset_peaks(int tag);
inline void reset_peaks() { reset_peaks(current_tag()); }

// Device memory: the CUDA caching allocator's allocated bytes (current and peak) of `device`;
// the counting allocator's figures for the calling thread's tag on the CPU. peak_by_phase is filled
// only on the CPU.
Stats device_stats(const at::Device& device);
void reset_device_peaks(const at::Device& device);

}  // namespace dmuon::memory
