// ns_graphs.h -- Newton-Schulz of a fixed (shape, dtype, device, steps) captured once into a CUDA graph
// and replayed: ~30 kernel launches per matrix (per stacked batch) become one graph launch, so the
// host cost of an NS call is microseconds whatever its step count. Muon::step runs its NS through one
// (MuonOptions::ns_cuda_graphs, default on; DMUON_NS_CUDA_GRAPHS=0 turns it off).
//
// Where it applies: a CUDA build, a CUDA input, the backend's NsOptions::check_finite off (the finite
// check reads the host; Muon checks all its gradients in one read and turns it off), and room under
// the caps (graphs, bytes). Anything else runs ns.local eagerly, with the same result. A graph's
// first call captures it (after `warmup` eager calls on a side stream, which also settle cuBLAS
// workspaces and the "auto" kernel choice); later calls copy the input into the graph's static
// input, replay, and return a copy of its static output. Replayed results equal the eager ones bit
// for bit (the same kernels on the same data). Captures run on a stream of their own in thread-local
// capture mode, so communication other threads issue meanwhile is neither waited for nor captured; a
// capture that fails is logged once and turns graphs off for this runner (NS continues eagerly).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "dmuon/newton_schulz.h"

namespace dmuon {

struct NsGraphOptions {
  bool enabled = true;
  int max_graphs = 64;                    // distinct (shape, dtype, device, steps) kept
  int64_t max_bytes = int64_t{4} << 30;   // static inputs + outputs of all graphs, x 4 for workspace
  int warmup = 2;                         // eager calls before the capture
};

class NsGraphs {
 public:
  explicit NsGraphs(NewtonSchulz ns, NsGraphOptions opts = {});
  ~NsGraphs();
  NsGraphs(const NsGraphs&) = delete;
  NsGraphs& operator=(const NsGraphs&) = delete;

  // ns.local(G, steps), from a CUDA graph where one applies (above). G: [..., m, n].
  at::Tensor run(const at::Tensor& G, int steps = kDefaultNsSteps);

  // This build can capture CUDA graphs (a CUDA build of LibTorch).
  static bool supported();
  struct Stats {
    int64_t captures = 0, replays = 0, eager = 0;
  };
  const Stats& stats() const { return stats_; }
  const NewtonSchulz& ns() const { return ns_; }
  void set_check_finite(bool on) { ns_.set_check_finite(on); }

 private:
  struct Entry;
  struct Streams;  // CUDA: one capture stream per device, owned here
  using Key = std::tuple<std::vector<int64_t>, int, int, int>;  // sizes, dtype, device index, steps
  NewtonSchulz ns_;
  NsGraphOptions opts_;
  std::map<Key, std::unique_ptr<Entry>> graphs_;
  std::unique_ptr<Streams> streams_;
  int64_t bytes_ = 0;
  Stats stats_;
};

}  // namespace dmuon
