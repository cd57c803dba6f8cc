// Internal: the replicated route (dmuon::replicate: base parameters whole on every rank, DDP-style bucketed all-reduces).
//
// Every rank keeps the whole parameter and updates it identically. At the end of backward the
// gradients are averaged over the data-parallel ranks (the world without a TP axis; else the R x G
// ranks of this TP position) in a few coalesced all-reduces (buckets of one reduce and
// master dtype and one device, at most bucket_mb MiB each), and the averages are in p.grad when the
// backward returns, as after torch's DDP: what the caller does to them before step() (clipping with
// torch, masking, zero_grad, replacing them) is what step() uses.
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

  // the coalesced all-reduces; their averages in p.grad (where no rank had a gradient: zeros until
  // step(), which leaves none, as torch)
  void end_of_backward() override;
  void collect_flags(std::vector<at::Tensor>& out) override;
  void install_grads(const float*& flag) override;  // drops the zeros of parameters no rank had a gradient for
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
    // after the backward: its has-gradient flags (float32, on the device until the step's one host
    // read) and the gradients it installed (a zero one no rank had is dropped if still installed)
    at::Tensor flags;
    std::vector<at::Tensor> installed;
    // Where the reduce is narrower than the master (grad_dtype bf16, say) and a later backward before
    // the step adds to an installed average: that average as the backward found it, so only the new
    // local gradient crosses the reduce and the average stays in the master's precision (as FSDP2's
    // accumulated sharded gradient). Taken when the backward first reaches the parameter.
    std::vector<at::Tensor> base;
    // what p.grad was after the install or autograd's last accumulation into it: a base holds only while
    // p.grad is still that tensor (one the caller put there, or none, is the caller's gradient)
    std::vector<at::Tensor> last;
  };
  void average(Bucket& b);                      // waits its all-reduce, folds the average
  void install(Bucket& b);                      // the average into p.grad
  // sets p.grad to none where no rank had a gradient (flag 0) and it is still the installed one
  // (`this_pass`: and the backward now ending gave it none)
  void drop_unused(Bucket& b, const float*& flag, bool this_pass);
  // whether the reduce is narrower than the master (then an installed average is kept out of it)
  static bool keeps_bases(const Bucket& b);
  // whether `g` (slot k's p.grad) is still the installed average or what autograd made of it; if not (the
  // caller's gradient, or none), the slot keeps no base from now to the step
  static bool still_installed(Bucket& b, size_t k, const at::Tensor& g);
  // before autograd adds a new gradient to parameter i's p.grad: its installed average kept as the base
  void keep_base(int i);
  // the local gradients of this backward alone in p.grad (each base taken out), before the reduce
  void take_out_bases(Bucket& b);
  const at::Tensor& param(int i) const { return whole_.params()[static_cast<size_t>(i)].param; }
  RouteContext& ctx_;
  std::vector<int> tp_dims_;      // per parameter: TP split dimension, -1 when whole
  bool tp_ = false;
  std::vector<Bucket> buckets_;
  std::vector<bool> got_grad_;  // per parameter: the backward now running gave it a gradient here
  std::vector<std::pair<size_t, size_t>> slot_;  // per parameter: its bucket and place in it
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accs_;
};

}  // namespace dmuon
