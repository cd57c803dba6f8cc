// Internal: Muon::step's element-wise work as multi-tensor kernels, one launch per list of
// parameters instead of a few per parameter.
//
// The per-parameter ops of AdamW (~8 kernels per parameter) and of Muon's momentum (one per matrix)
// are launch- or dispatch-bound for the many small tensors of a model (norms, biases, small
// matrices): LibTorch's multi-tensor kernels do a whole list in one call. AdamW goes through
// at::_fused_adamw_ (LibTorch >= 2.0 on CUDA, >= 2.4 on the CPU), by default wherever it exists: on
// the CPU it is 3-7x faster than the per-parameter ops too (docs/PERF.md). The momentum goes through
// at::_foreach_mul_ / at::_foreach_add_ (every LibTorch this project builds with), by default on
// CUDA only: on the CPU the per-matrix host loops (host_ops.h) are as fast or faster. The arithmetic
// is the per-parameter path's, up to the order of rounding (float64: ~1e-16 relative per step).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace dmuon::detail {

// Whether this LibTorch has the fused AdamW kernel for `device`.
bool fused_adamw_available(c10::DeviceType device);

// One parameter's AdamW operands: `target` is updated in place with `grad` (its dtype, the moments'
// dtype); `step` is the step count after this step's increment (bias correction).
struct AdamwOperands {
  at::Tensor target, grad, exp_avg, exp_avg_sq;
  int64_t step = 0;
};
struct AdamwHyper {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
};

// Whether `ops` can go through the fused kernel: floating, contiguous, the four tensors of one
// dtype and device, on a device that has the kernel.
bool fused_adamw_takes(const AdamwOperands& ops);
// AdamW on every entry (one device and dtype, fused_adamw_takes each) with one fused call:
// p <- p (1 - lr wd); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
// p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
void fused_adamw(const std::vector<AdamwOperands>& ops, const AdamwHyper& h);

// bufs[i] <- mu bufs[i] + grads[i] for every i, two multi-tensor launches (one device and dtype).
void foreach_momentum(const std::vector<at::Tensor>& bufs, const std::vector<at::Tensor>& grads, double mu);

// targets[i] <- decays[i] targets[i] + alphas[i] updates[i] for every i (one device and dtype; the
// updates are scaled in place): three multi-tensor launches. Muon's weight update W (1 - lr wd) -
// lr s NS(u) for a batch of matrices.
void foreach_scale_add(const std::vector<at::Tensor>& targets, const std::vector<double>& decays,
                       const std::vector<at::Tensor>& updates, const std::vector<double>& alphas);

// MuonOptions::fused / foreach for a tensor: unset, fused wherever the kernel exists, foreach on CUDA.
inline bool fused_on(std::optional<bool> option, const at::Tensor& t) {
  return option.value_or(fused_adamw_available(t.device().type()));
}
inline bool foreach_on(std::optional<bool> option, const at::Tensor& t) { return option.value_or(t.is_cuda()); }

}  // namespace dmuon::detail
