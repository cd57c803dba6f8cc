// Internal: Newton-Schulz of a dedicated matrix on a mesh with a tensor-parallel axis (Muon::step).
//
// The T owners of a matrix (one per TP position, all at the same DP coordinate: exactly one TP
// group) each hold the momentum-update input of their slice. tp_orthogonalize returns this TP
// rank's slice of NS(full input):
//   * split, gather form: gather the slices to the TP owner, NS on the full matrix there, scatter
//     the slices of the result (each non-owner sends and receives its slice once);
//   * split, distributed Gram form: gram_newton_schulz_distributed_local over the TP group (one
//     all-reduce of the m x m Gram matrix per NS window and of the squared norm); applies only when
//     the split runs along the long side of the matrix (the oriented slice is a column block);
//   * whole (not split; identical on every TP rank): the TP owner alone runs NS and broadcasts it.
// collective: every rank of the TP group, same matrices in the same order.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dmuon/mesh.h"
#include "dmuon/newton_schulz.h"
#include "runtime/route.h"

namespace dmuon {

// Whether the distributed Gram form can orthogonalise a matrix of `full` shape split along `tp_dim`.
bool tp_distributed_gram_applies(const std::vector<int64_t>& full, int tp_dim);
// Elements all-reduced by the distributed Gram form over elements of the full matrix:
// windows * m^2 / (rows * cols), windows = 1 + restarts inside the run.
double tp_factor_to_scatter_ratio(const std::vector<int64_t>& full, const NsOptions& opts, int steps);

// The exchange's scratch tensors (DedicateOptions::tp_buffer_reuse): per matrix and slot, either
// allocated for each use ("off") or kept and handed out again at the next step. Reuse is safe
// because Runtime::step finishes every TP update of the step before (the deferred applies that
// read the receive buffers) before it hands out a gradient, and each step waits its own gathers.
class TpScratch {
 public:
  enum class Slot { Gathered = 0, Full, Send, Receive };
  // "off", "gather" (Gathered, Full), "scatter" (Send, Receive) or "all" (validated by dedicate_params)
  void set_policy(const std::string& policy);
  // an uninitialised tensor of `sizes` for `name`'s `slot`: the kept one when that slot is reused and
  // it matches (sizes, dtype, device), else a new one (kept when the slot is reused)
  at::Tensor get(const std::string& name, Slot slot, at::IntArrayRef sizes, const at::TensorOptions& options);
  int64_t kept_bytes() const;  // what the kept buffers hold

 private:
  bool reuse_[4] = {false, false, false, false};
  std::map<std::pair<std::string, int>, at::Tensor> kept_;
};

// Synchronous: this rank's slice of NS(full input), by any of the three forms.
at::Tensor tp_orthogonalize(const at::Tensor& u_local, const ReadyGrad& r, int steps, const NewtonSchulz& ns,
                            bool distributed_gram, Mesh& mesh, TpScratch& scratch);

// The gather form in two halves, so a step issues every gather before any NS (the TP owners compute
// while the other gathers are in flight) and returns before the scatters land (async publish).
struct TpGather {
  at::Tensor u, gathered;  // kept alive while in flight
  Pending pending;
};
TpGather tp_issue_gather(const at::Tensor& u_local, const ReadyGrad& r, Mesh& mesh, TpScratch& scratch);
struct TpScatter {
  at::Tensor slice;  // this rank's slice of the update, valid once `pending` is waited
  Pending pending;
};
// The TP owner waits its gather and runs NS; every rank issues the scatter.
TpScatter tp_scatter_update(TpGather& g, const ReadyGrad& r, int steps, const NewtonSchulz& ns, Mesh& mesh,
                            TpScratch& scratch);

// Muon::step's record of a TP matrix whose Newton-Schulz waits for its gather (`gather` in flight),
// and how to apply its update.
struct TpUpdate {
  std::string name;
  ReadyGrad ready;
  int steps = 0;
  TpGather gather;
  std::function<void(const at::Tensor&)> apply;
};

}  // namespace dmuon
