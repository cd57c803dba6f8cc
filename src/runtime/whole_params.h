// Internal: parameters every rank keeps whole (the replicated route and the local route): what
// checkpoints and optimizer state need of them, written once for both routes.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "runtime/route.h"
#include "runtime/route_context.h"

namespace dmuon {

struct WholeParam {
  std::string name;
  at::Tensor param;
  // trainable when dedicate_params (or replicate) took it: the optimizer keeps it, as torch's keeps a
  // parameter frozen later (its state is checkpointed; a zero gradient left by zero_grad(set_to_none=False)
  // still steps it)
  bool trained = false;
  // trained, or requires_grad now (one unfrozen later): it has optimizer state and is stepped when it has
  // a gradient; the others are checkpointed only
  bool trainable() const { return trained || param.requires_grad(); }
};

class WholeParams {
 public:
  WholeParams(RouteContext& ctx, RouteKind kind) : ctx_(ctx), kind_(kind) {}
  const std::vector<WholeParam>& params() const { return params_; }
  void set_params(std::vector<WholeParam> params);

  const WholeParam* find(const std::string& name) const;
  bool describe(const std::string& name, ParamView& v) const;
  // local (a TP-split one is gathered by the caller's sink)
  void gather_full(const TensorSink& put) const;       // the master where there is one
  void assign_from(ParamSource& source) const;         // every rank reads its whole value (TP: its slice)
  void full_shapes(std::map<std::string, std::vector<int64_t>>& out) const;
  void state_slots(std::vector<StateSlot>& out) const;
  void gather_state(const OptimizerStateReader& opt, const StateSink& put) const;
  void assign_state(OptimizerStateAccess& opt, const StateSource& get) const;
  // the trainable ones with a gradient; `counted`: this rank counts them in a global norm
  void ready_grads(std::vector<ReadyGrad>& out, bool counted) const;

 private:
  RouteContext& ctx_;
  RouteKind kind_;
  std::vector<WholeParam> params_;
  std::map<std::string, size_t> index_;  // name -> params_
};

// A route of whole parameters: their checkpoint and optimizer-state methods, once (the replicated
// and the local route derive from it).
class WholeParamsRoute : public Route {
 public:
  WholeParamsRoute(RouteContext& ctx, RouteKind kind) : whole_(ctx, kind) {}
  bool describe(const std::string& name, ParamView& v) const override { return whole_.describe(name, v); }
  void gather_full(const TensorSink& put) override { whole_.gather_full(put); }
  void assign_from(ParamSource& source) override { whole_.assign_from(source); }
  void full_shapes(std::map<std::string, std::vector<int64_t>>& out) const override { whole_.full_shapes(out); }
  void state_slots(std::vector<StateSlot>& out) const override { whole_.state_slots(out); }
  void gather_state(const OptimizerStateReader& opt, const StateSink& put) override { whole_.gather_state(opt, put); }
  void assign_state(OptimizerStateAccess& opt, const StateSource& get) override { whole_.assign_state(opt, get); }

 protected:
  WholeParams whole_;
};

// A state tensor from a checkpoint in the dtype and on the device the optimizer keeps it.
at::Tensor to_state_tensor(const at::Tensor& v, const at::Device& device, at::ScalarType dtype);

}  // namespace dmuon
