// The gradient accumulator (see grad_accumulator.h).
#include "runtime/grad_accumulator.h"

#include <ATen/TensorIterator.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace dmuon {

namespace {

// Every gradient defined and the slots [offsets[k], offsets[k] + numel) back to back from 0 to `end`
// (the usual case: no zero fill, and the flags set by one op -- a boundary of many small matrices
// pays per op, not per byte). Sizes are the gradients': a released parameter's data is a 0-element
// placeholder while its gradient, accumulated in an earlier micro-batch, is full-size.
bool dense_grads(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets, int64_t end) {
  int64_t at_ = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    if (!params[k].grad().defined() || offsets[k] != at_) return false;
    at_ += params[k].grad().numel();
  }
  return !params.empty() && at_ == end;
}

// Parameter k's slot in a payload of gradients [0, end): its gradient's size, which must fit before the
// next slot (a gradient of another size, set by hand, would write into its neighbour).
int64_t grad_slot_numel(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets, size_t k,
                        int64_t end) {
  const at::Tensor& g = params[k].grad();
  TORCH_CHECK_VALUE(g.layout() == at::kStrided, "a ", g.layout(), " gradient (shape ", g.sizes(),
                    ") reached dmuon's reduce, which takes dense gradients only; make the layer produce dense ones "
                    "(nn.Embedding / EmbeddingBag with sparse=False).");
  const int64_t n = g.numel(), limit = k + 1 < offsets.size() ? offsets[k + 1] : end;
  TORCH_CHECK(offsets[k] + n <= limit, "a gradient of ", n, " elements (shape ", params[k].grad().sizes(),
              ") does not fit its parameter's ", limit - offsets[k], " in the reduce payload: a gradient of another "
              "shape than its parameter's was assigned to p.grad");
  return n;
}

// CPU, contiguous, small and already in the sum's dtype (float / double): copied or added by a host
// loop instead of narrow + reshape + copy_ / add_ (three ops for a few KB); larger ones take ATen's
// multi-threaded copy and add (past its grain size)
bool host_fold(const at::Tensor& sum, int64_t offset, const at::Tensor& g, bool add) {
  const at::ScalarType t = sum.scalar_type();
  if (!sum.device().is_cpu() || !g.device().is_cpu() || g.scalar_type() != t || !g.is_contiguous() ||
      !sum.is_contiguous() || (t != at::kFloat && t != at::kDouble) || g.numel() > at::internal::GRAIN_SIZE)
    return false;
  auto run = [&](auto* dst, const auto* src) {
    dst += offset;
    const int64_t n = g.numel();
    if (add)
      for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
    else
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(*src));
  };
  if (t == at::kFloat)
    run(sum.data_ptr<float>(), g.data_ptr<float>());
  else
    run(sum.data_ptr<double>(), g.data_ptr<double>());
  return true;
}

}  // namespace

at::Tensor pack_grads(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets, int64_t total,
                      int64_t flags_at, const at::TensorOptions& options) {
  at::NoGradGuard ng;
  // dense: [gradients back to back | one flag each]; anything else: zeros, then a flag per gradient present
  const bool all = flags_at + static_cast<int64_t>(params.size()) == total && dense_grads(params, offsets, flags_at);
  at::Tensor payload = all ? at::empty({total}, options) : at::zeros({total}, options);
  if (all) payload.narrow(0, flags_at, static_cast<int64_t>(params.size())).fill_(1);
  for (size_t k = 0; k < params.size(); ++k) {
    at::Tensor p = params[k];
    const at::Tensor& g = p.grad();
    if (g.defined()) {
      payload.narrow(0, offsets[k], grad_slot_numel(params, offsets, k, flags_at)).copy_(g.reshape(-1));
      if (!all) payload[flags_at + static_cast<int64_t>(k)] = 1;
    } else {
      TORCH_INTERNAL_ASSERT(!all, "pack_grads: parameter ", k, " is listed twice");  // its gradient was taken
    }
    p.mutable_grad() = at::Tensor();
  }
  return payload;
}

namespace {
bool predivided(at::ScalarType reduce) { return reduce == at::kHalf; }
}  // namespace

void predivide(const at::Tensor& grads, double divisor) {
  if (predivided(grads.scalar_type()) && divisor != 1.0) at::Tensor(grads).div_(divisor);
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
  at::Tensor avg = payload.narrow(0, 0, numel).to(master);
  if (divisor != 1.0 && !predivided(payload.scalar_type())) avg = avg.div(divisor);
  // a copy of the few flags: a view would keep the whole payload alive beside a sum that was copied
  const at::Tensor flags = payload.narrow(0, numel, nflags).to(master, /*non_blocking=*/false, /*copy=*/true);
  if (!sum_.defined()) {  // the first backward pass defines the sum, later ones add to it
    // (a view of the payload when no cast or division made a copy: the payload is dropped after)
    sum_ = avg;
    flags_ = flags;
  } else {
    sum_.add_(avg);
    flags_.add_(flags);
  }
}

void GradAccumulator::fold_grads(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                                 int64_t numel, at::ScalarType reduce, at::ScalarType master,
                                 const at::TensorOptions& options) {
  at::NoGradGuard ng;
  const int64_t np = static_cast<int64_t>(params.size());
  const bool all = dense_grads(params, offsets, numel);
  const bool first = !sum_.defined();
  if (first) {
    const auto o = options.dtype(master);
    sum_ = all ? at::empty({numel}, o) : at::zeros({numel}, o);
    flags_ = all ? at::ones({np}, o) : at::zeros({np}, o);
  } else if (all) {
    flags_.add_(1);
  }
  const bool copy = first && all;  // every slot written once: copied, not added to zeros
  for (size_t k = 0; k < params.size(); ++k) {
    at::Tensor p = params[k];
    const at::Tensor& g = p.grad();
    if (!g.defined()) {
      TORCH_INTERNAL_ASSERT(!all, "fold_grads: parameter ", k, " (shape ", p.sizes(),
                            ") is listed twice in one accumulator");  // its gradient was taken
      continue;
    }
    const int64_t n = grad_slot_numel(params, offsets, k, numel);
    if (g.scalar_type() != reduce || !host_fold(sum_, offsets[k], g, !copy)) {
      const at::Tensor v = (g.scalar_type() == reduce ? g : g.to(reduce)).reshape(-1);
      at::Tensor slot = sum_.narrow(0, offsets[k], n);
      if (copy)
        slot.copy_(v);
      else
        slot.add_(v);
    }
    if (!all) flags_.narrow(0, static_cast<int64_t>(k), 1).add_(1);
    p.mutable_grad() = at::Tensor();
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
