// Internal: the one gradient accumulator every route uses.
//
// A route hands its local gradients to a collective as one payload: the gradients of its
// parameters at their offsets, followed by one has-gradient flag per parameter (1 where the
// parameter got a gradient on this rank, 0 elsewhere), all in the reduce dtype. After the
// collective the payload holds sums over ranks; the accumulator averages it in the master dtype and
// adds it to the sum over backward passes (gradient accumulation), flags included. The flags stay
// on the device until Runtime::prepare_grads reads every route's flags in one host read.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "runtime/precision.h"

namespace dmuon {

// `params[k]`'s gradient is copied to [offsets[k], offsets[k] + numel) and flag k is written at
// `flags_at + k`; each parameter's gradient is then dropped (the average comes back through the
// accumulator). Returns a zero-initialised payload of `total` elements in `dtype`.
at::Tensor pack_grads(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets, int64_t total,
                      int64_t flags_at, const at::TensorOptions& options);

// A float16 sum over ranks overflows at 65504 where their average does not, so float16 gradients are
// divided by the data-parallel size before their reduce (as torch's DDP does) and fold divides them no
// more; wider dtypes are summed first (one rounding fewer). `grads`: the gradient part of a payload.
void predivide(const at::Tensor& grads, double divisor);

// NoSync: local gradients stay on the rank for several backward passes and autograd accumulates
// into p.grad() in place, so a master-dtype gradient makes that accumulation master-precision.
void upcast_local_grad(const at::Tensor& param, const Precision& prec);

class GradAccumulator {
 public:
  // Adds payload[0, numel) / divisor (in `master`; float16 payloads came predivided) to the sum and
  // payload[numel, numel + nflags) to the flags.
  void fold(const at::Tensor& payload, int64_t numel, int64_t nflags, at::ScalarType master, double divisor);
  // One rank, nothing to reduce: the local gradients are the sum over ranks. Adds params[k]'s
  // gradient (rounded through `reduce` where it differs, as the payload would) at [offsets[k],
  // offsets[k] + numel) of the sum and 1 to flag k where it has one, then drops the gradient: the
  // sums and flags of pack_grads + fold with divisor 1, without the payload or its extra passes.
  void fold_grads(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets, int64_t numel,
                  at::ScalarType reduce, at::ScalarType master, const at::TensorOptions& options);
  bool has_value() const { return sum_.defined(); }
  const at::Tensor& sum() const { return sum_; }
  const at::Tensor& flags() const { return flags_; }
  // the sum, released by the accumulator (the caller installs it as gradients)
  at::Tensor take_sum();
  // the flags as float32, for the one host read per step (undefined when nothing was folded)
  at::Tensor flags_for_read() const;
  void clear();

 private:
  at::Tensor sum_;
  at::Tensor flags_;
};

}  // namespace dmuon
