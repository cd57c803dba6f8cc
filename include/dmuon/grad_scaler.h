// Dynamic loss scaling for fp16 training on a dmuon::Muon: torch.amp.GradScaler's algorithm, with the
// gradients dmuon holds. scale() multiplies the loss before backward; unscale_() divides every gradient
// the next step uses by the scale -- the reduced sums dmuon keeps outside .grad (a dedicated matrix's on
// its owner alone), replicated, sharded_adamw and TP gradients -- and agrees over the mesh whether any is
// inf or NaN; step() then steps, or skips on every rank alike (updating nothing; the gradients stay, as torch's scaler
// leaves them, for the next zero_grad);
// update() backs the scale off after a skipped step and grows it after growth_interval clean ones.
//
//   dmuon::GradScaler scaler;                       // fp16 parameters (ParamPolicy::param_dtype = kHalf)
//   scaler.scale(model->loss(batch)).backward();
//   scaler.unscale_(opt);                           // optional: clip the unscaled gradients
//   opt.clip_grad_norm_(1.0, clip);
//   scaler.step(opt);                               // collective
//   scaler.update();
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace dmuon {

class Muon;

struct GradScalerOptions {
  double init_scale = 65536.0;     // 2^16, torch's default
  double growth_factor = 2.0;      // > 1
  double backoff_factor = 0.5;     // in (0, 1)
  int64_t growth_interval = 2000;  // clean steps between growths, >= 1
  bool enabled = true;             // false: scale() returns the loss, step() steps, update() does nothing
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // loss * scale: in float32 for an fp16 / bf16 loss (65536 x an fp16 loss of 1 would overflow), else in
  // the loss's dtype.
  at::Tensor scale(const at::Tensor& loss) const;
  // collective (every rank of the optimizer's mesh; waits the gradient reduces): unscales the gradients
  // the next step uses, in place, and returns whether any rank's holds an inf or NaN. Once per step.
  bool unscale_(Muon& optimizer);
  // collective: unscale_ unless done, then optimizer.step(), or, where unscale_ found an inf or NaN on
  // any rank, nothing (the unscaled gradients stay until the caller's zero_grad, as in torch). Returns
  // whether the step was taken (the same on every rank).
  bool step(Muon& optimizer);
  // After step(): scale *= backoff_factor when it was skipped; after growth_interval taken steps in a
  // row, scale *= growth_factor (when that stays finite).
  void update();

  double get_scale() const { return scale_; }
  int64_t growth_tracker() const { return tracker_; }
  // A saved scale and growth tracker (checkpoints); validated.
  void load(double scale, int64_t growth_tracker);
  const GradScalerOptions& options() const { return options_; }

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  GradScalerOptions options_;
  double scale_;
  int64_t tracker_ = 0;
  Stage stage_ = Stage::Ready;
  bool found_inf_ = false;
};

}  // namespace dmuon
