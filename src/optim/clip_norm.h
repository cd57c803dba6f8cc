// Internal: the global-norm clipping Muon::clip_grad_norm_ runs, and the local arithmetic it shares with
// GradScaler (grad_clip.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "dmuon/grad_clip.h"
#include "dmuon/mesh.h"

namespace dmuon::detail {

// The elements per fused (foreach) call: `chunk`, else DMUON_FAST_CLIP_CHUNK_SIZE, else 2^24.
int64_t resolve_chunk(std::optional<int64_t> chunk);
// sum |g|^p (p = inf: max |g|, NaN when one is NaN) over `grads`, as a float64 scalar on `dev`, by foreach
// kernels where `foreach` allows (nullopt: float32/float64 CUDA tensors); `fused` is set when some were.
at::Tensor local_partial(const std::vector<at::Tensor>& grads, double p, std::optional<bool> foreach, int64_t chunk,
                         const at::Device& dev, bool& fused);
// Every tensor of `grads` times `coef`, in place (foreach kernels as local_partial decides).
void scale_all(const std::vector<at::Tensor>& grads, double coef, std::optional<bool> foreach, int64_t chunk);

// Clips `scope` (each element counted once over the mesh: ClipGrad::counted) by its global norm of
// order opts.norm_type, or runs the registered strategy opts.strategy. collective: every rank.
MuonGradClipStats clip_norm(std::vector<ClipGrad>& scope, std::optional<double> max_norm, const GradClipOptions& opts,
                            Mesh& mesh);

}  // namespace dmuon::detail
