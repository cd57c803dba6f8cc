// grad_clip.h -- gradient-norm clipping over a dedicated model, distributed-safe.
//
// Call between backward and step (it waits the gradient reduces itself):
//     loss.backward();
//     dmuon::GradClipOptions o;  o.scope = dmuon::ClipScope::AllParams;
//     auto stats = dmuon::clip_grad_norm_(opt, 1.0, o);
//     opt.step();
//
// Scopes:
//   * ClipScope::Muon (the seed's semantics, the default): the dedicated Muon matrices only; AdamW
//     parameters keep whatever the trainer does with them.
//   * ClipScope::AllParams: one global norm over every trainable parameter -- dedicated matrices on
//     their owners, replicated parameters, sharded_adamw slices, TP slices -- equal to
//     torch::nn::utils::clip_grad_norm_ over the whole model in one process. Each element is counted
//     once: a replicated parameter on data-parallel rank 0 only, a sharded_adamw slice in replicate
//     group 0 only, a parameter whole on every TP rank on TP rank 0 only.
// The norm is computed in float64 from every rank's partial sums, combined in rank order, so every
// rank gets the same value bit for bit and takes the same decision. With max_norm set, every gradient
// in scope is multiplied by min(1, max_norm / (total_norm + 1e-6)), as PyTorch does.
//
// collective: every rank of the mesh (one all-gather of three numbers per rank), whatever it owns.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace dmuon {

class Muon;
class Mesh;

enum class ClipScope { Muon, AllParams };

struct GradClipOptions {
  double norm_type = 2.0;           // p > 0, or INFINITY for the max norm
  bool error_if_nonfinite = false;  // a NaN/Inf total norm raises (on every rank together)
  ClipScope scope = ClipScope::Muon;
  std::string strategy = "global_norm";  // or a name given to register_muon_grad_clip_strategy
};

struct MuonGradClipStats {
  double total_norm = 0;            // before clipping
  std::optional<double> max_norm;   // nullopt: stats only, nothing scaled
  double norm_type = 2.0;
  double clip_coef = 1.0;           // min(1, max_norm / (total_norm + 1e-6)); 1 without max_norm
  bool clipped = false;             // clip_coef < 1 and gradients were scaled
  int64_t param_count = 0;          // distinct parameters with a gradient in the norm (all ranks)
  bool found_inf = false;           // total_norm is NaN or Inf (gradients left unscaled)
  std::string strategy = "global_norm";
};

// collective: see above. Throws (on every rank) when error_if_nonfinite and the norm is not finite.
MuonGradClipStats clip_grad_norm_(Muon& optimizer, std::optional<double> max_norm, const GradClipOptions& opts = {});

// Custom strategies. A strategy gets the live gradients in scope on this rank (scale or inspect
// them in place), each with whether this rank counts it in a norm (so every element is counted once
// over the mesh), and returns the stats. It must issue the same collectives on every rank of the mesh.
struct ClipGrad {
  std::string name;
  at::Tensor grad;
  bool counted = true;
};
using MuonGradClipStrategy = std::function<MuonGradClipStats(std::vector<ClipGrad>& grads, std::optional<double> max_norm,
                                                             const GradClipOptions& opts, Mesh& mesh)>;
// Registers (or replaces) `name`; "global_norm" is built in and cannot be replaced. Thread-safe.
void register_muon_grad_clip_strategy(const std::string& name, MuonGradClipStrategy strategy);

}  // namespace dmuon
