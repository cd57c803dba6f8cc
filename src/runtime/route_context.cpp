// What the routes see of their model (see route_context.h).
#include "runtime/route_context.h"

#include "comm/error_text.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>
#include <utility>

namespace dmuon {

std::vector<int> RouteContext::publish_order() const {
  // The DDP path: ranks may run different blocks (one skipped a layer, an expert got no tokens), so their
  // recorded orders differ and the owners' broadcasts would pair across blocks (same-sized ones silently):
  // model order, the same on every rank. Elsewhere every rank runs the same blocks in the same order.
  std::vector<int> order = ddp_                              ? std::vector<int>{}
                           : schedule.recorded_order.empty() ? schedule.current_order
                                                             : schedule.recorded_order;
  for (int b = 0; b < num_boundaries(); ++b)
    if (std::find(order.begin(), order.end(), b) == order.end()) order.push_back(b);
  return order;
}

Precision RouteContext::precision_of(const at::Tensor& p) const {
  auto it = precision_.find(p.unsafeGetTensorImpl());
  return it != precision_.end() ? it->second : Precision::plain(p.scalar_type());
}

at::Tensor RouteContext::master_of(const at::Tensor& p) const {
  auto it = masters_.find(p.unsafeGetTensorImpl());
  return it != masters_.end() ? it->second : at::Tensor();
}

void RouteContext::require_given_storage(int b, const std::string& name, const at::Tensor& param,
                                         std::initializer_list<const at::Tensor*> given,
                                         const std::string& during) const {
  const at::Tensor& first = **given.begin();
  bool held = param.scalar_type() == first.scalar_type() && param.device() == first.device();
  if (held) {
    held = false;
    for (const at::Tensor* t : given)
      if (t->defined() && param.storage().is_alias_of(t->storage())) held = true;
  }
  if (held) return;
  std::ostringstream o;
  o << "rank " << mesh_->global_rank() << ": ";
  if (during.empty())
    o << "the forward of boundary '" << boundary_name(b) << "'";
  else
    o << during;
  o << ": parameter '" << name << "' " << kReplacedParamText << " at dedicate_params (it is now " << param.scalar_type() << " "
    << param.sizes() << " on " << param.device() << "; dmuon's is " << first.scalar_type() << " on " << first.device()
    << "). Something replaced it since: a load into the model (torch::load(model, ...), load_state_dict), "
       "p.set_data(...) / p.data = ..., or model->to(dtype or device). dmuon keeps this parameter in a buffer that "
       "its owner updates and sends to the other ranks, so the replacement would be used on this rank alone (and "
       "lose its gradient hooks): the ranks would drift apart. Load values with dmuon's set_model_state_dict "
       "(dmuon.set_model_state_dict in Python) or into the model before dedicate_params; choose dtypes before "
       "dedicate_params (a ParamPolicy / param_policy_fn for mixed precision).";
  TORCH_CHECK_VALUE(false, o.str());
}

ReadyGrad RouteContext::ready_grad(const std::string& name, const at::Tensor& p, const Precision& prec, bool muon,
                                   bool counted, bool counts_param) const {
  ReadyGrad r;
  r.name = name;
  r.param = p;
  r.grad = p.grad();
  r.in_param_grad = true;
  r.prec = prec;
  r.muon = muon;
  const at::Tensor master = master_of(p);
  r.target = master.defined() ? master : p;
  r.write_back = master.defined();
  // a parameter whole on every TP rank (not split) counts once, on TP rank 0; a split one per slice
  const bool tp_lead = mesh_->tp_rank() == 0;
  const bool whole_over_tp = mesh_->has_tp() && !tp_split_.count(name);
  r.norm_counted = counted && (!whole_over_tp || tp_lead);
  r.norm_counts_param = r.norm_counted && counts_param && tp_lead;
  return r;
}

TensorRegion RouteContext::region_of(const std::string& name, at::IntArrayRef local_shape) const {
  auto it = tp_split_.find(name);
  return detail::tp_region(local_shape, it == tp_split_.end() ? -1 : it->second, mesh_->tp_rank(), mesh_->tp_size());
}

void RouteContext::fill_from(ParamSource& source, const std::string& name, const TensorRegion& region, at::Tensor& out) {
  if (!fill_error_.empty()) return;  // the first failure is the one reported
  try {
    TORCH_CHECK(out.sizes().vec() == region.size, "'", name, "': the destination has shape ", out.sizes(),
                " but the region ", at::IntArrayRef(region.size));
    if (!dry_) {
      source.fill(name, region, out);
      return;
    }
    at::Tensor scratch = at::empty(out.sizes(), out.options().device(at::kCPU));  // (no device memory)
    source.fill(name, region, scratch);
  } catch (const std::exception& e) {
    fill_error_ = "reading '" + name + "' from " + source.describe() + ": " + detail::error_text(e);
  }
}

void RouteContext::after_fills(std::function<void()> work) {
  if (!dry_) work();
}

void RouteContext::agree_fills(const std::string& what) {
  const bool dry = std::exchange(dry_, false);
  const int n = mesh_->world_size();
  const at::Tensor mine = at::full({1}, fill_error_.empty() ? int64_t{0} : int64_t{1}, mesh_->options(at::kLong));
  at::Tensor all = at::empty({n}, mesh_->options(at::kLong));
  mesh_->world().allgather_flat(all, mine, what + ": parameter values read").wait_host();
  const at::Tensor host = all.cpu();
  std::string failed;
  for (int r = 0; r < n; ++r)
    if (host.data_ptr<int64_t>()[r] != 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  std::string mine_err = std::move(fill_error_);
  fill_error_.clear();
  if (!mine_err.empty() && mine_err.back() != '.') mine_err += '.';  // (a sentence follows)
  TORCH_CHECK(failed.empty(), "rank ", mesh_->global_rank(), ": ", what, ": reading the parameter values failed on rank(s) ",
              failed, mine_err.empty() ? std::string(" (this rank read its share; see their errors).") : ": " + mine_err,
              !dry ? "" : " Nothing was written: the model holds the values it had before.");
}

}  // namespace dmuon
