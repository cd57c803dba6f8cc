// Internal: the replicated route (dmuon::replicate: base parameters whole on every rank, DDP-style bucketed all-reduces).
//
// Every rank keeps the whole parameter and updates it identically. At the end of backward the
// gradients are averaged over the data-parallel ranks (the world without a TP axis; else the R x G
// ranks of this TP position) in a few coalesced all-reduces (buckets of one reduce and
// master dtype and one device, at most bucket_mb MiB each).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dmuon/communicator.h"
#include "runtime/grad_accumulator.h"
#include "runtime/route.h"
#include "runtime/whole_params.h"

namespace dmuon {

class RouteContext;

class ReplicatedRoute final : public WholeParamsRoute {
 public:
  // `params`: the trainable parameters on no other route (the local route hands them over), in
  // model order. collective: rank 0's initial values. `tp`: TP-split parameters are accepted
  // (replicate_tp); otherwise they are an error.
  ReplicatedRoute(RouteContext& ctx, std::vector<WholeParam> params, double bucket_mb, bool tp);
  RouteKind kind() const override { return RouteKind::Replicated; }

  void end_of_backward() override;  // issue the coalesced all-reduces (async)
  void finish_reduces() override;   // wait them; fold into the accumulators
  void collect_flags(std::vector<at::Tensor>& out) override;
  void install_grads(const float*& flag) override;
  void ready_grads(std::vector<ReadyGrad>& out) override;
  void discard_grads() override;
  bool in_flight() override;
  void plan_step_traffic(std::vector<PlannedTraffic>& out) const override;
  void upcast_local_grads() override;

  std::vector<std::string> names() const;
  const std::vector<int>& tp_split_dims() const { return tp_dims_; }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  bool tp() const { return tp_; }

 private:
  struct Bucket {
    std::vector<int> params;      // indices into whole_.params
    std::vector<int64_t> offsets;
    int64_t numel = 0;
    Precision prec;
    at::Tensor payload;           // grads then has-grad flags, while the all-reduce is in flight
    Pending pending;
    GradAccumulator acc;
  };
  const at::Tensor& param(int i) const { return whole_.params()[static_cast<size_t>(i)].param; }
  RouteContext& ctx_;
  std::vector<int> tp_dims_;      // per parameter: TP split dimension, -1 when whole
  bool tp_ = false;
  std::vector<Bucket> buckets_;
  bool issued_ = false;
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accs_;
};

}  // namespace dmuon
