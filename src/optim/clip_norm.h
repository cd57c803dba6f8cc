// Internal: the global-norm clipping Muon::clip_grad_norm_ runs (grad_clip.cpp).
#pragma once

#include <optional>
#include <vector>

#include "dmuon/grad_clip.h"
#include "dmuon/mesh.h"

namespace dmuon::detail {

// Clips `scope` (each element counted once over the mesh: ClipGrad::counted) by its global norm of
// order opts.norm_type, or runs the registered strategy opts.strategy. collective: every rank.
MuonGradClipStats clip_norm(std::vector<ClipGrad>& scope, std::optional<double> max_norm, const GradClipOptions& opts,
                            Mesh& mesh);

}  // namespace dmuon::detail
