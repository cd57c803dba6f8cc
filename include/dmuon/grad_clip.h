// grad_clip.h -- gradient-norm clipping over a dedicated model, distributed-safe.
//
// Call between backward and step (it waits the gradient reduces itself):
//     loss.backward();
//     dmuon::GradClipOptions o;  o.scope = dmuon::ClipScope::AllParams;
//     auto stats = dmuon::clip_grad_norm_(opt, 1.0, o);
//     opt.step();
//
// Scopes:
//   * ClipScope::Muon (the default): the dedicated Muon matrices only; AdamW
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

// One live gradient in a clip's scope (what strategies get; GradClipOptions::extra).
struct ClipGrad {
  std::string name;
  at::Tensor grad;
  bool counted = true;       // this rank adds it to the norm (false: a copy counted on another rank)
  bool counts_param = true;  // counted, and this copy counts the parameter once in param_count
};

struct GradClipOptions {
  double norm_type = 2.0;           // p > 0, or INFINITY for the max norm
  bool error_if_nonfinite = false;  // a NaN/Inf total norm raises (on every rank together)
  ClipScope scope = ClipScope::Muon;
  std::string strategy = "global_norm";  // or a name given to register_muon_grad_clip_strategy
  // Fused foreach kernels (at::_foreach_norm / _foreach_mul_) for the local norms and the scaling:
  // nullopt (default) uses them when every gradient in scope is a float32/float64 CUDA tensor, as
  // PyTorch's clip_grad_norm_ does; true wherever a tensor is eligible (dense float32/float64, any
  // device); false never (float64 reference math). The norm and the collectives are the same
  // either way; only the local arithmetic differs (rounding: the per-tensor norms are in the
  // gradient's dtype before they are combined in float64).
  std::optional<bool> foreach;
  // Gradients the caller trains outside dmuon's routes (e.g. the local shards of FSDP2's DTensor
  // parameters, passed by the Python front end under ClipScope::AllParams): in the norm as their
  // `counted` flags say (each element once over the mesh) and scaled with the rest.
  std::vector<ClipGrad> extra;
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
using MuonGradClipStrategy = std::function<MuonGradClipStats(std::vector<ClipGrad>& grads, std::optional<double> max_norm,
                                                             const GradClipOptions& opts, Mesh& mesh)>;
// Registers (or replaces) `name`; "global_norm" is built in and cannot be replaced. Thread-safe.
void register_muon_grad_clip_strategy(const std::string& name, MuonGradClipStrategy strategy);


class Communicator;

// ---- segmented clipping: one norm and one coefficient per bucket ------------------------------------
//
// clip_grad_norm_buckets_: every bucket is clipped on its own L2 norm,
// coef_b = min(1, max_norm / (norm_b + 1e-6)). A bucket with reduce=true sums its squared partial
// over `group` (gradients spread over ranks: owned Muon matrices, sharded slices); reduce=false
// keeps this rank's norm (gradients identical on every rank: replicated ones).
//
// collective over `group` (nullptr: none, a single process): two all-gathers -- the bucket layout
// (count and reduce flags, so ranks that disagree get an error naming both layouts, not a hang),
// then every bucket's partial -- whatever each rank holds, a rank holding nothing included, and
// whichever path (fused or reference) each tensor takes locally. Partials are combined in rank
// order in float64, so every rank gets the same bits. A non-finite bucket norm leaves that
// bucket's gradients unscaled and says so (found_inf).
struct GradClipBucket {
  std::string name;
  std::vector<at::Tensor> grads;       // undefined entries are skipped
  bool reduce = true;
  // scaled by the bucket's coefficient but not counted in its norm (copies counted elsewhere)
  std::vector<at::Tensor> scale_only;
};

struct GradClipBucketStats {
  std::string name;
  double total_norm = 0;           // before clipping (over the group when reduce)
  std::optional<double> max_norm;
  double clip_coef = 1.0;
  bool clipped = false;
  int64_t param_count = 0;         // defined gradients counted (summed over the group when reduce)
  bool found_inf = false;
  bool fastpath = false;           // this rank used the fused kernels for some tensor of the bucket
};

struct SegmentedGradClipResult {
  at::Tensor total_norm;           // float64 scalar: sqrt(sum_b norm_b^2) (before clipping)
  std::vector<GradClipBucketStats> bucket_stats;  // in bucket order
  bool fastpath = false;           // some tensor took the fused path on this rank
  std::optional<std::string> fallback_reason;     // why not, when no tensor did
  const GradClipBucketStats* find(const std::string& name) const;  // nullptr when absent
};

struct BucketClipOptions {
  // Fused path work unit: at most this many elements per foreach call (tensors are grouped
  // greedily; a larger tensor gets a call of its own). nullopt: DMUON_FAST_CLIP_CHUNK_SIZE, else 2^24.
  std::optional<int64_t> chunk_size;
  // nullopt: fused kernels for float32/float64 CUDA tensors, reference math elsewhere; true: fused for every eligible tensor; false: reference math only. DMUON_FAST_CLIP=0
  // turns the fused path off.
  std::optional<bool> foreach;
};

// collective over `group` (see above).
SegmentedGradClipResult clip_grad_norm_buckets_(const std::vector<GradClipBucket>& buckets, std::optional<double> max_norm,
                                                Communicator* group = nullptr, const BucketClipOptions& opts = {});

// The Wall-X layout in one call: buckets "regular" (the caller's replicated gradients,
// reduce=false), "muon" (this optimizer's Muon gradients, waited here; reduce=true) and "adamw"
// (the caller's sharded/dedicated AdamW gradients, reduce=true), each clipped to max_norm on its
// own; the "muon" bucket's stats become last_muon_grad_clip_stats() (strategy "segmented").
// `group` defaults to the optimizer's world group. The reference math is always built, so a result
// always comes back except when DMUON_FAST_CLIP=0 on every rank (nullopt: how a caller asks to run
// its own path); the setting is agreed over `group` first (one small all-gather), and a mixed one is a
// c10::ValueError on every rank naming the ranks that have it off.
// Whether the fused clip path is on for this install (DMUON_FAST_CLIP unset or not "0"): what
// try_clip_optimizer_grad_norm_buckets_ returns nullopt on. Local.
bool fast_clip_enabled();
// fast_clip_enabled, agreed over `group` (one small all-gather; none for a group of one): a mixed
// setting is a c10::ValueError on every rank naming the ranks that have it off and `fn`. collective.
bool fast_clip_agreed(Communicator& group, const std::string& fn);

// collective: every rank of `group`.
std::optional<SegmentedGradClipResult> try_clip_optimizer_grad_norm_buckets_(
    Muon& optimizer, const std::vector<at::Tensor>& regular_grads, const std::vector<at::Tensor>& adamw_grads,
    double max_norm, Communicator* group = nullptr);

}  // namespace dmuon
