// Internal: the parameters on no distributed route -- frozen ones, and the trainable ones that
// neither Muon, sharded_adamw nor dmuon::replicate took (allowed on one rank only: Muon refuses them
// on several). Each rank trains them with its own gradient; checkpoints keep them whole.
#pragma once

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "runtime/route.h"
#include "runtime/whole_params.h"

namespace dmuon {

class LocalRoute final : public WholeParamsRoute {
 public:
  LocalRoute(RouteContext& ctx, std::vector<WholeParam> params) : WholeParamsRoute(ctx, RouteKind::Local) {
    whole_.set_params(std::move(params));
  }
  RouteKind kind() const override { return RouteKind::Local; }

  // dmuon::replicate takes the parameters that require a gradient now (model order); the frozen ones stay
  std::vector<WholeParam> requiring_grad() const {
    std::vector<WholeParam> out;
    for (const auto& w : whole_.params())
      if (w.param.requires_grad()) out.push_back({w.name, w.param, /*trained=*/true});
    return out;
  }
  bool holds_frozen(const std::string& name) const {
    const WholeParam* w = whole_.find(name);
    return w && !w->param.requires_grad();
  }
  // parameters another data-parallel wrapper took over (Runtime::release_external)
  void drop(const std::set<std::string>& names) {
    std::vector<WholeParam> kept;
    for (const auto& w : whole_.params())
      if (!names.count(w.name)) kept.push_back(w);
    whole_.set_params(std::move(kept));
  }
  void drop_requiring_grad() {
    std::vector<WholeParam> kept;
    for (const auto& w : whole_.params())
      if (!w.param.requires_grad()) kept.push_back(w);
    whole_.set_params(std::move(kept));
  }

  void ready_grads(std::vector<ReadyGrad>& out) override { whole_.ready_grads(out, /*counted=*/true); }
};

}  // namespace dmuon
