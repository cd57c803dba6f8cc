// ns_runner.h -- Newton-Schulz of many matrices at once: the one batched runner Muon::step, the
// device calibration and the benchmarks share.
//
// Jobs are grouped by their shape after orientation (rows <= cols), dtype, device and step count,
// in first-seen order. A group stacks into one NS call per batch where ns_stacking_pays (every
// matrix is normalised on its own inside the stack), each batch at most NsBatchOptions::cap_bytes;
// elsewhere each matrix runs alone. A job's input is made when its batch is built (so at most one
// batch of inputs exists at a time) and its result handed over as soon as the batch is computed.
// Results equal NewtonSchulz::local per matrix (float64 on the CPU: the same multiply order per
// matrix; fp32 within the GEMM path's rounding).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "dmuon/newton_schulz.h"

namespace dmuon {

// Whether one stacked NS call over same-shape matrices beats one call each on `device`, for a
// shape whose smaller side is `small_side`: always on CUDA (fewer launches); on the CPU only up to
// kCpuStackMaxSide (ATen's batched CPU GEMM is slower than its plain one from 128 on;
// bench/ns_bench --batched, docs/PERF.md). DMUON_BATCHED_NS=0 turns stacking off everywhere.
inline constexpr int64_t kCpuStackMaxSide = 64;
bool ns_stacking_pays(c10::DeviceType device, int64_t small_side);

// DMUON_NS_BATCH_MB in bytes (default 256 MiB): the largest stacked call. A bad value is an error
// saying how to set it.
int64_t ns_batch_cap_bytes();

// One matrix's Newton-Schulz.
struct NsJob {
  at::Tensor like;  // the input's shape (its own layout, 2-D), dtype and device
  int steps = kDefaultNsSteps;
  // The input: written into `out` (a slice of the stacked batch, in the matrix's own layout) and
  // returned when `out` is defined, else returned as a tensor of its own. Unset: `like` is the input.
  std::function<at::Tensor(const at::Tensor& out)> input;
  // NS(input), in the matrix's own layout (a view into the batch's result)
  std::function<void(const at::Tensor& result)> apply;
};

struct NsBatchOptions {
  int64_t cap_bytes = -1;        // largest stack per call; < 0: ns_batch_cap_bytes()
  // and at most a quarter of all the jobs' input bytes: a stack and its NS workspace (~4x the
  // stack) stay a fraction of what the run updates, so batching never doubles its peak memory
  bool cap_to_quarter = true;
  // called after each batch's results are applied, before the next batch runs (a caller whose
  // `apply` queues work flushes it here, while the batch's results are alive and no more of them)
  std::function<void()> after_batch;
};

// The NS of one matrix or stack [..., m, n] (NewtonSchulz::local, NsGraphs::run).
using NsFn = std::function<at::Tensor(const at::Tensor& G, int steps)>;

// Runs every job (above). `timed(i, ms)`: job i's share of its batch's wall time. Each job's
// `input`/`apply` are released once it is applied.
void run_ns_batched(std::vector<NsJob>& jobs, const NsFn& ns, const NsBatchOptions& options = {},
                    const std::function<void(size_t job, double ms)>& timed = {});

// NS of each input (2-D, any shapes), batched as above without the quarter cap; results in input
// order and layout.
std::vector<at::Tensor> newton_schulz_many(const NewtonSchulz& ns, const std::vector<at::Tensor>& inputs,
                                           int steps = kDefaultNsSteps);

}  // namespace dmuon
