// The reductions dmuon's own backends (store, loopback) apply: the ranks' contributions combined in
// rank order, so every rank gets the same bits. Internal to src/bootstrap.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace dmuon::detail {

// acc <- op(acc, x)
inline void combine(at::Tensor& acc, const at::Tensor& x, const c10d::ReduceOp& op, const char* backend) {
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG: acc.add_(x); break;
    case c10d::ReduceOp::MAX: acc = at::maximum(acc, x); break;
    case c10d::ReduceOp::MIN: acc = at::minimum(acc, x); break;
    case c10d::ReduceOp::PRODUCT: acc.mul_(x); break;
    default: TORCH_CHECK(false, backend, ": unsupported reduce op");
  }
}

// AVG: the sum of n contributions divided by n (integers: floor division); other ops unchanged.
inline void finish(at::Tensor& acc, const c10d::ReduceOp& op, int64_t n) {
  if (op != c10d::ReduceOp::AVG) return;
  if (at::isIntegralType(acc.scalar_type(), /*includeBool=*/true))
    acc.div_(n, "floor");
  else
    acc.div_(static_cast<double>(n));
}

}  // namespace dmuon::detail
