// Internal: the element-wise steps of Muon::step on small CPU matrices as one host loop each.
//
// A 32 x 32 update costs less than one ATen op's dispatch (~1-3 us: TensorIterator, allocation),
// so a rank that owns dozens of small matrices (MoE experts, the many-block probe of
// bench/optim_step_bench) pays per op, not per byte. These helpers run the same arithmetic in one
// loop over the elements where they apply -- CPU, float or double, every operand of one dtype, 2-D
// (any strides; the written operand without overlap, an input sharing its memory only as the same
// view), at most kHostMaxElems elements -- and return false (nullopt) elsewhere, where the caller
// takes the ATen ops. The written tensor's version counter is bumped, as an in-place op does. Each
// result element is computed as the ATen ops compute it in that dtype, up to the order of rounding
// (ATen may fuse a multiply-add).
#pragma once

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>

#include <optional>

namespace dmuon::detail {

// the largest matrix the loops take (ATen's grain size: beyond it ATen's threads pay off)
inline constexpr int64_t kHostMaxElems = at::internal::GRAIN_SIZE;

// out <- a + alpha * b (out may be a or b)
bool host_add(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, double alpha);
// t <- t * decay + alpha * u
bool host_scale_add(const at::Tensor& t, double decay, const at::Tensor& u, double alpha);
// whether t.sum() in t's dtype is finite (NaN / Inf anywhere, or a sum that overflows)
std::optional<bool> host_sum_finite(const at::Tensor& t);

}  // namespace dmuon::detail
