// unshard_profile.h -- what the forward (and Z3 backward) unshards of a dedicated model cost on
// this rank, per hook boundary: how many were issued (own or prefetched), the bytes this rank
// received, and how long it was blocked waiting for them.
//
// Recording is off by default. Turn it on before dedicate_params builds the runtime, with
// DMUON_RECORD_FORWARD_PROFILE=1 in the environment or DedicateOptions::record_forward_profile:
//     DMUON_RECORD_FORWARD_PROFILE=1 ./train ...
//     auto prof = dmuon::collect_forward_unshard_profile(*model, /*clear=*/true, /*synchronize=*/true);
//     std::cout << dmuon::to_json(prof).dump(2);      // diagnostics.h
// Overhead when on: two counter snapshots per unshard issue and one steady_clock pair per wait (well
// under a microsecond per boundary; on CUDA two event records per wait, ~2 us each); off, one
// branch. wait_ms is host time: on CUDA a wait is a stream dependency, so the host spends ~0 there,
// and device_wait_ms (CUDA events around each wait, on the compute stream) is the stall that
// matters. Local: reads this rank's counters, no collective.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dmuon {

struct BoundaryUnshardStats {
  std::string boundary;
  int64_t forward_unshards = 0;     // unshards issued for a forward pass (its own or prefetched)
  int64_t forward_prefetched = 0;   // of which issued ahead, by the previous boundary's prefetch
  int64_t backward_unshards = 0;    // Z3: re-unshards for backward (own or prefetched)
  int64_t forward_bytes = 0;        // bytes this rank received (broadcast / all-gather, as CommCounters count)
  int64_t backward_bytes = 0;
  int64_t forward_waits = 0;        // waits for this boundary's unshard before its forward
  int64_t backward_waits = 0;
  double forward_wait_ms = 0;       // host time blocked in those waits
  double backward_wait_ms = 0;
  // CUDA: how long the compute stream stalled in those waits (a CUDA event before and after each
  // wait on the current stream: the wait is a stream dependency, so this is the device-side stall
  // the host time cannot show). Read when the profile is collected, which waits for those events.
  double forward_device_wait_ms = 0;
  double backward_device_wait_ms = 0;
};

struct ForwardUnshardProfile {
  bool enabled = false;             // recording was on when the model was dedicated
  bool device_timed = false;        // CUDA: the boundaries' *_device_wait_ms are measured (CUDA events)
  int rank = 0;                     // global rank
  int64_t forward_passes = 0;       // forward passes since the last clear
  std::vector<BoundaryUnshardStats> boundaries;  // model order
  int64_t total_bytes() const;
  double total_wait_ms() const;
  double total_device_wait_ms() const;  // CUDA (device_timed), else 0
};

// This rank's counters since the last clear; clear=true resets them. synchronize=true waits for the
// device first (diagnostic boundaries only: it changes the overlap being measured). Local.
ForwardUnshardProfile collect_forward_unshard_profile(torch::nn::Module& model, bool clear = true,
                                                      bool synchronize = false);

// Forgets the recorded forward order, so the next forward pass records it afresh and prefetches in
// model order meanwhile (call when the boundaries' execution order changes, e.g. a different
// branch of the model runs from now on). Every rank must call it at the same point. Local.
void reset_post_forward_order(torch::nn::Module& model);
// The boundaries (module names) in the forward order prefetching follows: the last complete forward
// pass's, or the running one's while none completed; empty before any forward. Local.
std::vector<std::string> post_forward_order(const torch::nn::Module& model);

}  // namespace dmuon
