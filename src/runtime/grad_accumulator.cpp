// The gradient accumulator (see grad_accumulator.h).
#include "runtime/grad_accumulator.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

namespace dmuon {

at::Tensor pack_grads(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets, int64_t total,
                      int64_t flags_at, const at::TensorOptions& options) {
  at::NoGradGuard ng;
  // Every gradient defined and the payload exactly [gradients back to back | one flag each] (the
  // usual case): no zero fill, and the flags set by one fill -- a boundary of many small matrices
  // pays per op, not per byte. Anything else: zeros, then a flag per gradient present.
  bool dense = flags_at + static_cast<int64_t>(params.size()) == total;
  for (size_t k = 0, at_ = 0; dense && k < params.size(); ++k) {
    dense = params[k].grad().defined() && offsets[k] == static_cast<int64_t>(at_);
    at_ += static_cast<size_t>(params[k].numel());
    if (k + 1 == params.size()) dense = dense && static_cast<int64_t>(at_) == flags_at;
  }
  const bool all = dense && !params.empty();
  at::Tensor payload = all ? at::empty({total}, options) : at::zeros({total}, options);
  if (all) payload.narrow(0, flags_at, static_cast<int64_t>(params.size())).fill_(1);
  for (size_t k = 0; k < params.size(); ++k) {
    at::Tensor p = params[k];
    const at::Tensor& g = p.grad();
    if (g.defined()) {
      payload.narrow(0, offsets[k], p.numel()).copy_(g.reshape(-1));
      if (!all) payload[flags_at + static_cast<int64_t>(k)] = 1;
    } else {
      TORCH_INTERNAL_ASSERT(!all, "pack_grads: parameter ", k, " is listed twice");  // its gradient was taken
    }
    p.mutable_grad() = at::Tensor();
  }
  return payload;
}

void upcast_local_grad(const at::Tensor& param, const Precision& prec) {
  at::NoGradGuard ng;
  const at::Tensor& g = param.grad();
  if (!g.defined() || !prec.has_master() || g.scalar_type() == prec.master) return;
  at::Tensor(param).mutable_grad() = g.to(prec.master);
}

void GradAccumulator::fold(const at::Tensor& payload, int64_t numel, int64_t nflags, at::ScalarType master,
                           double divisor) {
  at::NoGradGuard ng;
  const at::Tensor avg = payload.narrow(0, 0, numel).to(master).div(divisor);
  const at::Tensor flags = payload.narrow(0, numel, nflags).to(master);
  if (!sum_.defined()) {  // the first backward pass defines the sum, later ones add to it
    sum_ = avg;
    flags_ = flags;
  } else {
    sum_.add_(avg);
    flags_.add_(flags);
  }
}

at::Tensor GradAccumulator::take_sum() {
  at::Tensor s = std::move(sum_);
  clear();
  return s;
}

at::Tensor GradAccumulator::flags_for_read() const {
  return flags_.defined() ? flags_.to(at::kFloat) : at::Tensor();
}

void GradAccumulator::clear() {
  sum_ = at::Tensor();
  flags_ = at::Tensor();
}

}  // namespace dmuon
