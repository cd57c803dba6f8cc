// Dynamic loss scaling on a dmuon::Muon (include/dmuon/grad_scaler.h).
#include "dmuon/grad_scaler.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/grad_clip.h"
#include "dmuon/host_sync.h"
#include "dmuon/mesh.h"
#include "dmuon/muon.h"
#include "optim/clip_norm.h"

namespace dmuon {

GradScaler::GradScaler(GradScalerOptions options) : options_(options), scale_(options.init_scale) {
  const GradScalerOptions& o = options_;
  TORCH_CHECK_VALUE(std::isfinite(o.init_scale) && o.init_scale > 0,
                    "GradScaler: init_scale must be a finite number > 0, got ", o.init_scale, ".");
  TORCH_CHECK_VALUE(std::isfinite(o.growth_factor) && o.growth_factor > 1,
                    "GradScaler: growth_factor must be a finite number > 1, got ", o.growth_factor, ".");
  TORCH_CHECK_VALUE(o.backoff_factor > 0 && o.backoff_factor < 1, "GradScaler: backoff_factor must be in (0, 1), got ",
                    o.backoff_factor, ".");
  TORCH_CHECK_VALUE(o.growth_interval >= 1, "GradScaler: growth_interval must be >= 1, got ", o.growth_interval, ".");
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled) return loss;
  // an fp16 loss times 2^16 would overflow (fp16 ends at 65504): scaled in fp32, as autocast's losses are
  const bool reduced = loss.scalar_type() == at::kHalf || loss.scalar_type() == at::kBFloat16;
  return (reduced ? loss.to(at::kFloat) : loss) * scale_;
}

bool GradScaler::unscale_(Muon& optimizer) {
  if (!options_.enabled) return false;  // (torch's disabled scaler: nothing, and no stage to keep)
  TORCH_CHECK(stage_ != Stage::Unscaled, "rank ", optimizer.mesh().global_rank(),
              ": GradScaler::unscale_: already called since the last update(); call it once per step.");
  TORCH_CHECK(stage_ != Stage::Stepped, "rank ", optimizer.mesh().global_rank(),
              ": GradScaler::unscale_: called after step(); call update() first (once per step).");
  at::NoGradGuard ng;
  // every gradient the step will use, in place (collective: waits the reduces), each rank its own copies
  std::vector<at::Tensor> grads;
  for (const ClipGrad& g : optimizer.clip_grads(ClipScope::AllParams)) grads.push_back(g.grad);
  Mesh& mesh = optimizer.mesh();
  // clipping's local arithmetic (foreach kernels on CUDA): the scaling, then the max |g|, inf or NaN where one is
  const int64_t chunk = detail::resolve_chunk(std::nullopt);
  found_inf_ = false;
  detail::scale_all(grads, 1.0 / scale_, std::nullopt, chunk);
  // unscaled from here on (not before: a refusal above -- a backward that raised -- leaves the gradients
  // scaled, and the caller's retry after zero_grad must unscale them)
  stage_ = Stage::Unscaled;
  bool fused = false;
  const at::Tensor peak = detail::local_partial(grads, INFINITY, std::nullopt, chunk, mesh.device(), fused);
  const at::Tensor bad = at::logical_not(at::isfinite(peak)).to(at::kDouble).reshape({1});
  // a dedicated matrix's reduced gradient lives on its owner alone: every rank decides on all ranks' view
  const at::Tensor all = at::empty({mesh.world_size()}, bad.options());
  mesh.world().allgather_flat(all, bad, "GradScaler: non-finite gradients").wait_host();
  found_inf_ = detail::read_to_host(all).max().item<double>() > 0;
  return found_inf_;
}

bool GradScaler::step(Muon& optimizer) {
  if (!options_.enabled) {  // (torch's disabled scaler: the optimizer's step, nothing else)
    optimizer.step();
    return true;
  }
  TORCH_CHECK(stage_ != Stage::Stepped, "rank ", optimizer.mesh().global_rank(),
              ": GradScaler::step: already called since the last update(); call update() once per step.");
  if (stage_ == Stage::Ready) unscale_(optimizer);
  // the overflowed gradients: nothing is updated, every rank alike; the gradients stay (as torch.amp.GradScaler
  // leaves them) for the caller's zero_grad
  if (!found_inf_) optimizer.step();
  stage_ = Stage::Stepped;  // (after the step: one that raised may be retried)
  return !found_inf_;
}

void GradScaler::update() {
  if (!options_.enabled) {
    stage_ = Stage::Ready;
    return;
  }
  TORCH_CHECK(stage_ == Stage::Stepped, "GradScaler::update: no step() since the last update(); call it after "
              "step(), once per step.");
  if (found_inf_) {
    scale_ *= options_.backoff_factor;
    tracker_ = 0;
  } else if (++tracker_ == options_.growth_interval) {
    const double grown = scale_ * options_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;
    tracker_ = 0;
  }
  stage_ = Stage::Ready;
  found_inf_ = false;
}

void GradScaler::load(double scale, int64_t growth_tracker) {
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0, "GradScaler::load: scale must be a finite number > 0, got ",
                    scale, ".");
  TORCH_CHECK_VALUE(growth_tracker >= 0 && growth_tracker < options_.growth_interval,
                    "GradScaler::load: growth_tracker must be in [0, growth_interval = ", options_.growth_interval,
                    "), got ", growth_tracker, ".");
  scale_ = scale;
  tracker_ = growth_tracker;
}

}  // namespace dmuon
