// Muon optimizer: Newton-Schulz on owned matrices, AdamW on the rest (see include/dmuon/muon.h).
#include "dmuon/muon.h"

#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>
#include <type_traits>

#include "comm/agreement.h"
#include "comm/error_text.h"
#include "dmuon/digest.h"
#include "dmuon/env.h"
#include "dmuon/host_sync.h"
#include "dmuon/ns_runner.h"
#include "optim/clip_norm.h"
#include "optim/host_ops.h"
#include "optim/multi_tensor.h"
#include "optim/option_agreement.h"
#include "optim/phase_clock.h"
#include "optim/tp_newton_schulz.h"
#include "runtime/runtime_face.h"

namespace dmuon {

// ---- options / state serialization ---------------------------------------------------------------
void MuonGroupOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(is_muon);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(ns_steps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(beta1);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(beta2);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
}
void MuonGroupOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, is_muon);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, ns_steps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, beta1);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, beta2);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
}
void MuonParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  if (momentum_buffer().defined()) _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
  if (exp_avg().defined()) _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  if (exp_avg_sq().defined()) _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
}
void MuonParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  // Buffers are written only when defined (a Muon matrix has no AdamW moments and vice versa).
  for (const char* key : {"momentum_buffer", "exp_avg", "exp_avg_sq"}) {
    c10::IValue iv;
    if (!archive.try_read(key, iv)) continue;
    const at::Tensor t = iv.toTensor();
    if (std::string(key) == "momentum_buffer")
      momentum_buffer(t);
    else if (std::string(key) == "exp_avg")
      exp_avg(t);
    else
      exp_avg_sq(t);
  }
}

namespace {
// whether v is in `range`; `must` says what the range is (for the error)
bool in_range(double v, HparamRange range, const char*& must) {
  bool ok = std::isfinite(v);
  must = "";
  switch (range) {
    case HparamRange::NonNegative:
      ok = ok && v >= 0;
      must = ">= 0";
      break;
    case HparamRange::UnitInterval:
      ok = ok && v >= 0 && v < 1;
      must = "in [0, 1)";
      break;
    case HparamRange::Positive:
      ok = ok && v > 0;
      must = "> 0";
      break;
    case HparamRange::Count:
      ok = ok && v >= 1 && v <= 1000 && v == std::floor(v);
      must = v < 1 ? ">= 1" : "an integer in [1, 1000]";
      break;
  }
  return ok;
}
// check_group_options with the error's `where` built only for an error (Muon::step checks every group
// each step)
template <class Where>
void check_group_options_lazily(const MuonGroupOptions& g, const Where& where) {
  auto check = [&](const char* field, double v, HparamRange range) {
    const char* must = "";
    if (!in_range(v, range, must)) check_hyperparameter(where() + " has " + field, v, range);
  };
  check("lr", g.lr(), HparamRange::NonNegative);
  check("weight_decay", g.weight_decay(), HparamRange::NonNegative);
  if (g.is_muon()) {
    check("momentum", g.momentum(), HparamRange::UnitInterval);
    check("ns_steps", static_cast<double>(g.ns_steps()), HparamRange::Count);
  } else {
    check("beta1", g.beta1(), HparamRange::UnitInterval);
    check("beta2", g.beta2(), HparamRange::UnitInterval);
    check("eps", g.eps(), HparamRange::Positive);
  }
}
// A Muon group's Newton-Schulz iteration count (the explicit coefficients', else its ns_steps) against the
// backend's restart_iterations (Gram only): a restart beyond the count raised inside every step -- after the
// momentum had changed -- instead of once, where the group was given.
template <class Where>
void check_restarts(const NewtonSchulz& ns, const MuonGroupOptions& g, const Where& where) {
  const NsOptions& o = ns.options();
  if (!g.is_muon() || ns.backend() != "gram" || !o.restart_iterations) return;
  const int64_t steps = o.coefficients ? static_cast<int64_t>(o.coefficients->size()) : g.ns_steps();
  for (int r : *o.restart_iterations)
    TORCH_CHECK_VALUE(r < steps, where(), " runs ", steps, " Newton-Schulz steps, but the NewtonSchulz backend restarts "
                      "before step ", r, " (restart_iterations are 0-based steps in [0, ", steps - 1, "]). Give "
                      "restart_iterations below ns_steps, or more ns_steps.");
}

}  // namespace

void check_hyperparameter(const std::string& what, double v, HparamRange range) {
  const char* must = "";
  const bool ok = in_range(v, range, must);
  TORCH_CHECK_VALUE(ok, what, ": ", v, ". Must be ", std::isfinite(v) ? "" : "a finite number ", must, ".");
}

void check_group_options(const MuonGroupOptions& g, const std::string& where) {
  check_group_options_lazily(g, [&] { return where; });
}

namespace {

// The optimizer state map is keyed by std::string ("0x..." of the TensorImpl) in LibTorch <= 2.1 and
// by the TensorImpl* in 2.2+.
using StateMap = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;
using StateKey = StateMap::key_type;
template <class K = StateKey>
K state_key(const at::Tensor& p) {
  if constexpr (std::is_same_v<K, std::string>) {
    std::ostringstream ss;
    ss << static_cast<void*>(p.unsafeGetTensorImpl());
    return ss.str();
  } else {
    return p.unsafeGetTensorImpl();
  }
}

void check_hparam(bool ok, const char* field, double v, const char* range) {
  TORCH_CHECK_VALUE(ok, "Muon: invalid ", field, ": ", v, ". Must be ", range, ".");
}
void check_hparam(const char* field, double v, HparamRange range) {
  check_hyperparameter(std::string("Muon: invalid ") + field, v, range);
}

// The runtime of `model`, or an error saying how to dedicate it.
std::shared_ptr<RuntimeFace> dedicated_runtime(const std::shared_ptr<torch::nn::Module>& model) {
  TORCH_CHECK_VALUE(model, "Muon: the model is null.");
  auto state = detail::face_of(*model);
  TORCH_CHECK_VALUE(state,
                    "Muon: the model was not dedicated. Call dmuon::dedicate_params(model, mesh, predicate) (and "
                    "dmuon::replicate for the other parameters) before constructing Muon; a mesh of one rank works for "
                    "single-process training.");
  return state;
}

// The DMUON_* variables step() and clipping read (the NS kernel, batching, the fused CPU path, CUDA graphs, the
// fast clip), parsed here so a malformed value is refused at construction, on every rank (within the option
// agreement), not in the first step on whichever rank reaches it first while the others wait in a collective.
// `device`: the model's (the NS kernel is resolved for it).
void check_environment(const MuonOptions& o, c10::DeviceType device, const RuntimeFace& state) {
  const NewtonSchulz ns = o.ns ? *o.ns : NewtonSchulz(o.ns_backend);  // (a bad backend: its own error)
  try {
    (void)ns.resolved_kernel(device);  // DMUON_NS_KERNEL (unless the options name the kernel)
    (void)env::batched_ns();
    (void)env::ns_cpu_fused();
    (void)env::ns_cuda_graphs();
    (void)ns_batch_cap_bytes();                 // DMUON_NS_BATCH_MB
    (void)env::fast_clip();                     // clip_grad_norm_'s
    (void)detail::resolve_chunk(std::nullopt);  // DMUON_FAST_CLIP_CHUNK_SIZE
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, "rank ", state.mesh().global_rank(), ": Muon: ", detail::error_text(e),
                      " (the environment is read when Muon is built: fix or unset the variable on every rank)");
  }
}

std::vector<torch::optim::OptimizerParamGroup> checked_groups(const std::shared_ptr<RuntimeFace>& state,
                                                              const MuonOptions& o, const torch::nn::Module* model) {
  check_hparam("lr", o.lr, HparamRange::NonNegative);
  check_hparam("momentum", o.momentum, HparamRange::UnitInterval);
  check_hparam("weight_decay", o.weight_decay, HparamRange::NonNegative);
  check_hparam("ns_steps", o.ns_steps, HparamRange::Count);
  check_hparam("adamw_lr", o.adamw_lr, HparamRange::NonNegative);
  check_hparam("adamw_betas.first", o.adamw_betas.first, HparamRange::UnitInterval);
  check_hparam("adamw_betas.second", o.adamw_betas.second, HparamRange::UnitInterval);
  check_hparam("adamw_weight_decay", o.adamw_weight_decay, HparamRange::NonNegative);
  check_hparam("adamw_eps", o.adamw_eps, HparamRange::Positive);
  TORCH_CHECK_VALUE(
      o.tp_distributed_gram_policy == "beneficial" || o.tp_distributed_gram_policy == "always",
      "Muon: invalid tp_distributed_gram_policy: '", o.tp_distributed_gram_policy,
      "'. Must be \"beneficial\" "
      "(the distributed Gram form where its payload is at most tp_distributed_gram_max_factor_to_scatter_ratio "
      "of the full scatter) or \"always\" (wherever it applies).");
  check_hparam(o.post_step_prefetch_groups >= 0, "post_step_prefetch_groups", o.post_step_prefetch_groups, ">= 0");
  check_hparam(o.tp_distributed_gram_max_factor_to_scatter_ratio >= 0,
               "tp_distributed_gram_max_factor_to_scatter_ratio", o.tp_distributed_gram_max_factor_to_scatter_ratio,
               ">= 0");
  std::set<const c10::TensorImpl*> dedicated, trainable;
  std::vector<at::Tensor> all;  // every trainable parameter, model order
  for (const auto& v : state->describe()) {
    all.push_back(v.param);
    trainable.insert(v.param.unsafeGetTensorImpl());
    if (v.muon()) dedicated.insert(v.param.unsafeGetTensorImpl());
  }
  const auto first = std::find_if(all.begin(), all.end(), [](const at::Tensor& p) { return p.defined(); });
  check_environment(o, first == all.end() ? c10::DeviceType::CPU : first->device().type(), *state);

  if (model)  // a parameter added (or unfrozen) after dedicate_params has no route: it would never train
    for (const auto& item : model->named_parameters())
      TORCH_CHECK_VALUE(!item.value().requires_grad() || trainable.count(item.value().unsafeGetTensorImpl()),
                        "rank ", state->mesh().global_rank(), ": Muon: parameter '", item.key(),
                        "' is trainable but was not when dedicate_params ran (added to the model, or unfrozen, since), "
                        "so no dmuon route averages its gradient and no step would update it. Build the whole model "
                        "(and set requires_grad) before dedicate_params, or freeze it (requires_grad(false)).");
  std::vector<MuonParamGroup> user = o.param_groups;
  std::set<const c10::TensorImpl*> grouped;
  for (const auto& g : user)
    for (const auto& p : g.params) {
      // a frozen tensor is never stepped (as in torch.optim); a trainable one must be the model's, or it would
      // be silently left alone
      TORCH_CHECK_VALUE(p.defined() && (trainable.count(p.unsafeGetTensorImpl()) || !p.requires_grad()),
                        "Muon: param group '", g.name, "' holds ",
                        p.defined() ? "a trainable tensor of shape " + c10::str(p.sizes()) : std::string("an undefined tensor"),
                        " that is not a trainable parameter of the dedicated model, so no step would ever update it. "
                        "Build the groups from the model's parameters (model->named_parameters()).");
      TORCH_CHECK_VALUE(grouped.insert(p.unsafeGetTensorImpl()).second,
                        "Muon: a parameter appears in more than one "
                        "param group (group '",
                        g.name, "'). Each parameter may be in at most one group.");
    }
  MuonParamGroup rest;
  rest.name = "default";
  for (const auto& p : all)
    if (!grouped.count(p.unsafeGetTensorImpl())) rest.params.push_back(p);
  if (!rest.params.empty() || user.empty()) user.push_back(rest);
  // explicit coefficients set the iteration count (one per triple, as the API reference's NS functions): an
  // ns_steps that differs is not used, which the caller should hear of rather than train on silently
  if (o.ns && o.ns->options().coefficients) {
    const auto n = static_cast<int64_t>(o.ns->options().coefficients->size());
    std::vector<std::string> unused;
    // (the default 5 cannot be told from one the caller gave: only another value is said to be unused)
    if (o.ns_steps != n && o.ns_steps != kDefaultNsSteps)
      unused.push_back("ns_steps=" + std::to_string(static_cast<int64_t>(o.ns_steps)));
    for (const auto& g : user)
      if (g.ns_steps && static_cast<int64_t>(*g.ns_steps) != n)
        unused.push_back("param group '" + g.name + "' ns_steps=" + std::to_string(static_cast<int64_t>(*g.ns_steps)));
    if (!unused.empty()) {
      std::string list;
      for (const auto& u : unused) list += (list.empty() ? "" : ", ") + u;
      TORCH_WARN("Muon: ", list, " not used: the NewtonSchulz backend has explicit coefficients, so every matrix runs ",
                 n, " iterations (one per (a, b, c) triple). Pass as many triples as iterations, or leave "
                 "coefficients unset for the default Polar Express steps.");
    }
  }

  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& g : user) {
    std::vector<at::Tensor> muon_ps, adamw_ps;
    for (const auto& p : g.params) (dedicated.count(p.unsafeGetTensorImpl()) ? muon_ps : adamw_ps).push_back(p);
    const std::optional<double> beta1 = g.adamw_betas ? std::optional(g.adamw_betas->first) : std::nullopt;
    const std::optional<double> beta2 = g.adamw_betas ? std::optional(g.adamw_betas->second) : std::nullopt;
    const std::optional<double> steps = g.ns_steps ? std::optional<double>(*g.ns_steps) : std::nullopt;
    for (const auto& [field, v, range] : {std::tuple{"lr", g.lr, HparamRange::NonNegative},
                                          {"momentum", g.momentum, HparamRange::UnitInterval},
                                          {"weight_decay", g.weight_decay, HparamRange::NonNegative},
                                          {"ns_steps", steps, HparamRange::Count},
                                          {"adamw_lr", g.adamw_lr, HparamRange::NonNegative},
                                          {"adamw_betas.first", beta1, HparamRange::UnitInterval},
                                          {"adamw_betas.second", beta2, HparamRange::UnitInterval},
                                          {"adamw_weight_decay", g.adamw_weight_decay, HparamRange::NonNegative},
                                          {"adamw_eps", g.adamw_eps, HparamRange::Positive}})
      if (v)
        check_hyperparameter("Muon: invalid " + std::string(field) + " of param group '" + g.name + "'", *v, range);
    auto mo = std::make_unique<MuonGroupOptions>(g.lr.value_or(o.lr));
    mo->is_muon(true)
        .momentum(g.momentum.value_or(o.momentum))
        .nesterov(g.nesterov.value_or(o.nesterov))
        .weight_decay(g.weight_decay.value_or(o.weight_decay))
        .ns_steps(g.ns_steps.value_or(o.ns_steps))
        .group_name(g.name);
    const auto betas = g.adamw_betas.value_or(o.adamw_betas);
    auto ao = std::make_unique<MuonGroupOptions>(g.adamw_lr.value_or(o.adamw_lr));
    ao->is_muon(false)
        .beta1(betas.first)
        .beta2(betas.second)
        .eps(g.adamw_eps.value_or(o.adamw_eps))
        .weight_decay(g.adamw_weight_decay.value_or(o.adamw_weight_decay))
        .group_name(g.name);
    groups.emplace_back(muon_ps, std::move(mo));
    groups.emplace_back(adamw_ps, std::move(ao));
  }
  return groups;
}

// The options checked and lowered to param groups, agreed across ranks (collective): a value one rank
// refuses is refused on every rank, with its reason.
std::vector<torch::optim::OptimizerParamGroup> lower_groups(const std::shared_ptr<RuntimeFace>& state,
                                                            const MuonOptions& o, const torch::nn::Module* model) {
  TORCH_CHECK_VALUE(state, "Muon: the runtime is null.");
  std::vector<torch::optim::OptimizerParamGroup> groups;
  detail::agree_options(*state, o, [&] { groups = checked_groups(state, o, model); });
  return groups;
}

// On several ranks every trainable parameter must have a distributed route: dedicated (Muon),
// sharded_adamw, or replicated by dmuon::replicate. Otherwise each rank would update it with its own
// local gradient and the replicas would drift apart silently.
void require_replicated(const RuntimeFace& state) {
  const Mesh& mesh = state.mesh();
  if (mesh.world_size() == 1) return;
  std::vector<std::string> missing;
  for (const auto& v : state.describe())
    if (!v.distributed()) missing.push_back(v.name);
  if (missing.empty()) return;
  std::ostringstream names;
  for (size_t i = 0; i < missing.size() && i < 8; ++i) names << (i ? ", " : "") << "'" << missing[i] << "'";
  if (missing.size() > 8) names << " and " << missing.size() - 8 << " more";
  TORCH_CHECK_VALUE(false, "rank ", mesh.global_rank(), ": Muon: ", missing.size(), " trainable parameter(s) ",
                    "have no distributed route on this ", mesh.world_size(), "-rank mesh: ", names.str(),
                    ". Each rank would update them with its own local gradient and the replicas would drift apart. "
                    "Call dmuon::replicate(model, mesh) after dedicate_params (or route them to sharded_adamw, or "
                    "freeze them with requires_grad(false)) before constructing Muon.");
}

// NaN/Inf in an averaged Muon gradient this rank updates: the matrix is not updated and step() raises on
// every rank, naming it (one host read for all of them). One reduction per gradient: its sum (accumulated in
// fp32, fp64 for fp64) is not finite whenever an element is NaN or Inf (they propagate; +Inf with -Inf gives
// NaN). A finite gradient whose sum overflows is reported too: its Frobenius norm overflows as well (|sum|^2 /
// numel <= |G|_F^2). On the CPU Newton-Schulz normalises a finite matrix whose float32 squares overflow in
// float64. (isfinite(g).all() costs ~5 element-wise passes per matrix: a visible share of the step for many
// small matrices.)
std::string nonfinite_grad_text(const ReadyGrad& r, int rank) {
  std::ostringstream o;
  o << "rank " << rank << ": Muon::step: the averaged gradient of '" << r.name << "' (shape " << r.grad.sizes()
    << ") contains NaN or Inf (or values so large that its norm overflows), so Newton-Schulz cannot orthogonalise "
    << "it";
  return o.str();
}

// `foreach` (MuonOptions::foreach, by default on CUDA): the norms of every fp32/fp64/bf16 gradient in
// one multi-tensor call per dtype instead of one sum per gradient (a norm is not finite exactly when
// the sum test above fails or the norm overflows); fp16 keeps the per-gradient reductions (a foreach norm
// would overflow at 65504; each is taken in fp32 there).
std::vector<char> finite_grads(const std::vector<ReadyGrad>& ready, std::optional<bool> foreach) {
  // device reductions by their dtype, each list stacked into one flag vector, all read at once
  std::map<at::ScalarType, std::vector<at::Tensor>> values;
  std::map<at::ScalarType, std::vector<at::Tensor>> norm_grads;  // by dtype, for _foreach_norm
  std::map<at::ScalarType, std::vector<size_t>> norm_at;         // their entries in `where`
  // per dedicated gradient, in `ready` order: the dtype of its value and its index there; or summed
  // on the host (small CPU matrices: no op per matrix), finite = i
  struct At {
    const ReadyGrad* r;
    bool host;
    at::ScalarType dtype;
    size_t i;
  };
  std::vector<At> where;
  std::vector<char> ok(ready.size(), 1);
  for (const auto& r : ready) {
    if (!r.muon) continue;
    const bool multi = detail::foreach_on(foreach, r.grad);
    if (const std::optional<bool> h = multi ? std::nullopt : detail::host_sum_finite(r.grad)) {
      where.push_back({&r, true, at::kBool, *h ? size_t{1} : size_t{0}});
      continue;
    }
    const at::ScalarType t = r.grad.scalar_type();
    if (multi && (t == at::kFloat || t == at::kDouble || t == at::kBFloat16)) {
      norm_at[t].push_back(where.size());
      norm_grads[t].push_back(r.grad);
      where.push_back({&r, false, t, 0});  // index set below
      continue;
    }
    const at::ScalarType acc = t == at::kDouble ? at::kDouble : at::kFloat;
    where.push_back({&r, false, acc, values[acc].size()});
    // on the CPU Newton-Schulz normalises a finite gradient whose float32 squares overflow (it reads its
    // sums there for free); on a GPU it cannot without a sync, so there the test is the norm's (same cost)
    values[acc].push_back(r.grad.is_cpu() ? r.grad.sum(acc)
                                          : at::linalg_vector_norm(r.grad, 2, at::IntArrayRef{}, false, acc));
  }
  for (auto& [t, grads] : norm_grads) {
    const std::vector<at::Tensor> norms = at::_foreach_norm(grads);
    for (size_t j = 0; j < norms.size(); ++j) {
      where[norm_at[t][j]].i = values[t].size();
      values[t].push_back(norms[j]);
    }
  }
  std::vector<at::Tensor> finite;
  std::map<at::ScalarType, size_t> offset;  // where each dtype's flags start in the read vector
  size_t n = 0;
  for (const auto& [t, v] : values) {
    offset[t] = n;
    n += v.size();
    finite.push_back(at::isfinite(at::stack(v)));
  }
  at::Tensor host;  // one host read for every device reduction
  if (!finite.empty()) host = detail::read_to_host(finite.size() == 1 ? finite[0] : at::cat(finite));
  for (const At& a : where)
    ok[static_cast<size_t>(a.r - ready.data())] = a.host ? a.i != 0 : host.data_ptr<bool>()[offset.at(a.dtype) + a.i];
  return ok;
}

// collective over the world: step() raises on every rank when any rank skipped a non-finite Muon gradient
// (`mine`: this rank's first, "" none; `count`: how many), naming the first rank's, or when the groups' values
// the step used (`values`) differ between ranks; one small all-gather.
void agree_finite_step(const RuntimeFace& rt, const std::string& mine, int64_t count,
                       const std::vector<detail::AgreedEntry>& values) {
  static const std::string after =
      ". No rank updated it (weights and momentum unchanged; a tensor-parallel matrix was updated from its momentum "
      "with the non-finite slice of its gradient taken as zero); the step's other updates were applied. A "
      "non-finite gradient usually means the loss diverged: lower the learning rate or clip gradients "
      "(dmuon.Muon.clip_grad_norm_ / Muon::clip_grad_norm_). In C++ a NewtonSchulz with set_check_finite(false) in "
      "MuonOptions::ns lets NaN propagate instead.";
  detail::AgreementText text;
  text.fn = "Muon::step";
  text.refused = [](const std::vector<int>& ranks, const std::string& reason) {  // (reason: the whole error)
    return "a Muon gradient is not finite on rank(s) " + detail::rank_list(ranks) + ": " + reason;
  };
  text.differs = detail::step_values_differ;
  bool verdict = false;  // another rank's refusal, or this rank's own error (not the agreement's failure)
  text.refused = [&verdict, inner = text.refused](const std::vector<int>& ranks, const std::string& reason) {
    verdict = true;
    return inner(ranks, reason);
  };
  try {
    detail::agree(
        rt.mesh().world(), text,
        [&] {
          if (mine.empty()) return;
          const std::string more = count > 1 ? " (and " + std::to_string(count - 1) + " more on this rank)" : "";
          TORCH_CHECK(false, mine, more, after);
        },
        [&] { return values; });
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    if (!verdict && (mine.empty() || what.find(mine) == std::string::npos)) throw;  // a lost peer's timeout
    throw NonFiniteGradientError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, what);
  }
}

// The device of the model's first trainable parameter when it is a GPU (step profiles time by its events).
std::optional<at::Device> first_param_cuda_device(const RuntimeFace& state) {
  for (const auto& v : state.describe())
    if (v.param.defined()) return v.param.is_cuda() ? std::optional<at::Device>(v.param.device()) : std::nullopt;
  return std::nullopt;
}

// The (device type, device index, dtype) of `t`: multi-tensor calls take one list per such key.
std::tuple<int, int, int> list_key(const at::Tensor& t) {
  return {static_cast<int>(t.device().type()), static_cast<int>(t.device().index()), static_cast<int>(t.scalar_type())};
}

// A parameter of the model with a gradient but in no group has no route: frozen (or added) when dedicate_params
// ran and trainable since. Nothing averages its gradient or updates it, so a step would leave it as it is where
// LibTorch's own optimizers train it: an error naming it (cheap: lookups in the groups' index; names only then).
// `grouped`: Muon's index of its groups' parameters.
void refuse_unrouted_gradients(const torch::nn::Module& model, const std::map<const c10::TensorImpl*, size_t>& grouped,
                               int rank) {
  // requires_grad alone, not whether a gradient arrived: that depends on each rank's batch (a block only some
  // ranks' data reach), and a rank refusing alone would leave the others in the step's collectives
  auto unrouted = [&](const at::Tensor& p) { return p.requires_grad() && !grouped.count(p.unsafeGetTensorImpl()); };
  const auto params = model.parameters();
  if (std::none_of(params.begin(), params.end(), unrouted)) return;
  for (const auto& item : model.named_parameters())
    TORCH_CHECK_VALUE(!unrouted(item.value()), "rank ", rank, ": Muon::step: parameter '", item.key(),
                      "' requires a gradient, but it was frozen (requires_grad(false)) or not in the model when "
                      "dedicate_params ran, so it has no route and no optimizer state: no rank averages its gradient "
                      "and no step would update it. Unfreeze it before dedicate_params (a param group with lr 0 keeps "
                      "it still until it should train), or keep it frozen.");
}

double elapsed_ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

namespace {}  // namespace

// Muon::step's side of RuntimeFace::step: the runtime prepares the gradients and hands them over
// group by group; each group is updated (Muon on the dedicated matrices, AdamW on the rest) and its
// whole matrices' Newton-Schulz run batched by shape before the runtime may publish it.
struct Muon::StepRun final : StepVisitor {
  Muon& opt;
  RuntimeFace& rt;
  StepProfile& prof;
  detail::PhaseClock& clock;
  bool log_first = false;
  std::vector<NsJob> ns_jobs;          // the group's whole matrices: NS batched by shape at the group's end
  std::vector<std::pair<std::string, at::Tensor>> ns_targets;  // each job's parameter (the progress log's)
  std::vector<TpUpdate> tp_pending;    // TP gathers in flight, in step order: NS and scatter before the publish
  struct AdamwBatch {                  // fused AdamW of one (parameter group, device, dtype)
    const MuonGroupOptions* options = nullptr;
    std::vector<detail::AdamwOperands> ops;
    std::vector<std::pair<at::Tensor, at::Tensor>> write_back;  // (parameter, master) under mixed precision
  };
  std::map<std::pair<const MuonGroupOptions*, std::tuple<int, int, int>>, AdamwBatch> adamw_batches;
  struct PendingUpdate {               // W <- decay W + alpha NS(u), by multi-tensor ops (MuonOptions::foreach)
    at::Tensor target, update, param;  // param: defined under mixed precision (rounded from the master)
    double decay, alpha;
  };
  std::vector<PendingUpdate> pending_updates;  // of the NS batch just run
  std::string nonfinite;        // this rank's first non-finite Muon gradient ("" none), raised after the step
  int64_t nonfinite_count = 0;  // and how many it found
  detail::PhaseClock::Mark phase_start;

  void add_ns_job(NsJob job, const std::string& name, const at::Tensor& target) {
    ns_jobs.push_back(std::move(job));
    ns_targets.emplace_back(name, target);
  }

  StepRun(Muon& o, RuntimeFace& r, StepProfile& p, detail::PhaseClock& c)
      : opt(o), rt(r), prof(p), clock(c), log_first(o.options_.first_step_progress_log && o.steps_ == 0) {}

  void begin(Phase) override { phase_start = clock.now(); }
  void end(Phase p) override {
    clock.add(p == Phase::Prepare ? detail::Phase::Prepare : detail::Phase::Publish, phase_start);
  }

  void update(const std::vector<ReadyGrad>& group) override {
    const std::vector<char> finite =
        opt.check_finite_ ? finite_grads(group, opt.options_.foreach) : std::vector<char>(group.size(), 1);
    // each gradient's parameter group (null: in none, not optimized); the Muon gradients in the
    // optimizer's dtype, and their momentum where it runs multi-tensor
    std::vector<const MuonGroupOptions*> o(group.size());
    std::vector<at::Tensor> g(group.size());
    for (size_t i = 0; i < group.size(); ++i) {
      const ReadyGrad& r = group[i];
      o[i] = options_of(r);
      if (!finite[i] && o[i] != nullptr) {
        // not updated; step() raises on every rank once its collectives are done. A whole matrix is skipped
        // (weights and momentum unchanged); a slice of a tensor-parallel matrix counts as zero, so that its
        // TP group still runs the matrix's gathers and scatters together
        if (nonfinite.empty()) nonfinite = nonfinite_grad_text(r, rt.mesh().global_rank());
        ++nonfinite_count;
        if (r.tp_owner < 0) {
          o[i] = nullptr;
          continue;
        }
      }
      if (r.muon && o[i] != nullptr && o[i]->is_muon())
        g[i] = !finite[i]                             ? at::zeros_like(r.grad, r.grad.options().dtype(r.prec.optim))
               : r.grad.scalar_type() == r.prec.optim ? r.grad
                                                      : r.grad.to(r.prec.optim);
    }
    const std::vector<char> momentum_done = foreach_momentum(group, o, g);
    for (size_t i = 0; i < group.size(); ++i)
      if (o[i] != nullptr) update_one(group[i], *o[i], g[i], momentum_done[i] != 0);
    flush_adamw();
    // the whole matrices' Newton-Schulz of this group, batched by shape: its weights are final
    // before it is published
    if (ns_jobs.empty()) return;
    const auto t0 = clock.now();
    std::vector<double> ms(ns_jobs.size(), 0.0);
    NsBatchOptions batching;
    batching.after_batch = [this] { flush_updates(); };
    run_ns_batched(
        ns_jobs, [this](const at::Tensor& G, int steps) { return opt.ns_graphs_->run(G, steps); }, batching,
        [&ms](size_t i, double t) { ms[i] = t; });
    flush_updates();  // (after_batch did; nothing is left queued past the group)
    clock.add(detail::Phase::Ns, t0);
    for (size_t i = 0; i < ns_targets.size(); ++i) progress_line(ns_targets[i].first, ns_targets[i].second, ms[i]);
    clock.add(detail::Phase::Muon, t0);
    ns_jobs.clear();
    ns_targets.clear();
  }

  // TP gather form: each TP owner runs NS on its full matrices and scatters the slices (every rank of
  // the TP group in the same order); a slice is applied once it arrives, before its holder's data are
  // read or sent again (the boundary's next unshard, the post-step publish, wait_publishes)
  void before_publish() override {
    if (tp_pending.empty()) return;
    const auto t0 = clock.now();
    for (TpUpdate& job : tp_pending) {
      TpScatter s = tp_scatter_update(job.gather, job.ready, job.steps, opt.ns_, rt.mesh(), *opt.tp_scratch_);
      rt.defer_update(job.name, [s, apply = std::move(job.apply)]() mutable {
        s.pending.wait();
        apply(s.slice);
      });
    }
    tp_pending.clear();
    clock.add(detail::Phase::Ns, t0);
    clock.add(detail::Phase::Muon, t0);
  }

  const MuonGroupOptions* options_of(const ReadyGrad& r) const {
    auto g = opt.group_of_.find(r.param.unsafeGetTensorImpl());
    if (g == opt.group_of_.end()) return nullptr;  // in no parameter group: not optimized
    return &static_cast<const MuonGroupOptions&>(opt.param_groups_[g->second].options());
  }

  // Muon's momentum (buf <- mu buf + g) as multi-tensor ops where MuonOptions::foreach applies (by
  // default on CUDA), one pair of launches per (momentum, device, dtype); which entries it updated.
  // g[i] is defined for a Muon matrix in a Muon group.
  std::vector<char> foreach_momentum(const std::vector<ReadyGrad>& group, const std::vector<const MuonGroupOptions*>& o,
                                     const std::vector<at::Tensor>& g) {
    std::vector<char> done(group.size(), 0);
    std::map<std::pair<double, std::tuple<int, int, int>>, std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>>
        lists;
    for (size_t i = 0; i < group.size(); ++i) {
      if (!g[i].defined() || !detail::foreach_on(opt.options_.foreach, g[i])) continue;
      MuonParamState& st = opt.state_for(group[i].param);
      if (!st.momentum_buffer().defined()) st.momentum_buffer(at::zeros_like(g[i]));
      const at::Tensor& buf = st.momentum_buffer();
      if (buf.scalar_type() != g[i].scalar_type() || buf.device() != g[i].device() || buf.sizes() != g[i].sizes())
        continue;  // (a restored state in another dtype: the per-matrix op converts)
      auto& l = lists[{o[i]->momentum(), list_key(buf)}];
      l.first.push_back(buf);
      l.second.push_back(g[i]);
      done[i] = 1;
      ++prof.momentum_foreach;
    }
    if (lists.empty()) return done;
    const auto t0 = clock.now();
    for (const auto& [key, l] : lists) detail::foreach_momentum(l.first, l.second, key.first);
    clock.add(detail::Phase::Muon, t0);
    return done;
  }

  void update_one(const ReadyGrad& r, const MuonGroupOptions& o, const at::Tensor& g, bool momentum_done) {
    const auto t0 = clock.now();
    if (r.muon && o.is_muon()) {
      opt.muon_update(r, g, momentum_done, o, rt.mesh(), prof, clock, *this);
      clock.add(detail::Phase::Muon, t0);
      if (r.tp_owner >= 0) progress_line(r.name, r.target, elapsed_ms(t0.host));  // whole matrices: after their batch
    } else if (!r.muon && !o.is_muon()) {
      adamw(r, o);
      clock.add(detail::Phase::Adamw, t0);
    }
  }

  // AdamW on r.target (the master under mixed precision, rounded into the parameter; for
  // sharded_adamw this rank's shard), its state in the optimizer's dtype keyed by the parameter.
  // Where MuonOptions::fused applies (by default wherever LibTorch has the kernel) it joins its
  // group's fused batch.
  void adamw(const ReadyGrad& r, const MuonGroupOptions& o) {
    const at::ScalarType sd = r.prec.optim;
    at::Tensor p = r.target;
    MuonParamState& st = opt.state_for(r.param);
    if (!st.exp_avg().defined()) {
      st.exp_avg(at::zeros_like(p, p.options().dtype(sd)));
      st.exp_avg_sq(at::zeros_like(p, p.options().dtype(sd)));
    }
    st.step(st.step() + 1);
    const bool fused = detail::fused_on(opt.options_.fused, p);
    detail::AdamwOperands ops{p, fused ? r.grad.to(sd).contiguous() : r.grad.to(sd), st.exp_avg(), st.exp_avg_sq(),
                              st.step()};
    if (fused && detail::fused_adamw_takes(ops)) {
      AdamwBatch& b = adamw_batches[{&o, list_key(p)}];
      b.options = &o;
      b.ops.push_back(std::move(ops));
      if (r.write_back) b.write_back.emplace_back(r.param, p);
      ++prof.adamw_fused;
      return;
    }
    const at::Tensor& g = ops.grad;
    const double b1 = o.beta1(), b2 = o.beta2();
    if (o.weight_decay() != 0) p.mul_(1.0 - o.lr() * o.weight_decay());
    st.exp_avg().mul_(b1).add_(g, 1.0 - b1);
    st.exp_avg_sq().mul_(b2).addcmul_(g, g, 1.0 - b2);
    const double bc1 = 1.0 - std::pow(b1, static_cast<double>(st.step()));
    const double bc2 = 1.0 - std::pow(b2, static_cast<double>(st.step()));
    const at::Tensor denom = (st.exp_avg_sq().sqrt() / std::sqrt(bc2)).add_(o.eps());
    if (p.scalar_type() == sd)
      p.addcdiv_(st.exp_avg(), denom, -o.lr() / bc1);
    else
      p.add_((st.exp_avg() / denom).to(p.scalar_type()), -o.lr() / bc1);
    if (r.write_back) r.param.copy_(p);  // mixed precision: AdamW on the master, rounded into the parameter
  }

  // The NS batch's queued weight updates: three multi-tensor launches per (device, dtype).
  void flush_updates() {
    if (pending_updates.empty()) return;
    struct Lists {
      std::vector<at::Tensor> targets, updates;
      std::vector<double> decays, alphas;
    };
    std::map<std::tuple<int, int, int>, Lists> lists;
    for (const PendingUpdate& u : pending_updates) {
      Lists& l = lists[list_key(u.target)];
      l.targets.push_back(u.target);
      l.updates.push_back(u.update);
      l.decays.push_back(u.decay);
      l.alphas.push_back(u.alpha);
    }
    for (const auto& [key, l] : lists) detail::foreach_scale_add(l.targets, l.decays, l.updates, l.alphas);
    for (const PendingUpdate& u : pending_updates)
      if (u.param.defined()) u.param.copy_(u.target);  // mixed precision: rounded into the parameter
    prof.update_foreach += static_cast<int>(pending_updates.size());
    pending_updates.clear();
  }

  // The group's fused AdamW batches: one call each, before the group's weights are published.
  void flush_adamw() {
    if (adamw_batches.empty()) return;
    const auto t0 = clock.now();
    for (auto& [key, b] : adamw_batches) {
      detail::fused_adamw(b.ops, {b.options->lr(), b.options->beta1(), b.options->beta2(), b.options->eps(),
                                  b.options->weight_decay()});
      for (auto& [param, master] : b.write_back) param.copy_(master);
    }
    adamw_batches.clear();
    clock.add(detail::Phase::Adamw, t0);
  }

  void progress_line(const std::string& name, const at::Tensor& target, double ms) {
    if (!log_first || opt.progress_logged_ >= opt.options_.first_step_progress_log_limit) return;
    ++opt.progress_logged_;
    std::ostringstream line;
    line << "[dmuon] rank " << rt.mesh().global_rank() << ": first step: " << opt.ns_.describe(target.device().type())
         << " on '" << name << "' (" << target.size(0) << "x" << target.size(1) << ") took " << ms << " ms";
    if (opt.options_.log)
      opt.options_.log(line.str());
    else
      std::cerr << line.str() << "\n";
  }
};

Muon::Muon(const std::shared_ptr<torch::nn::Module>& model, MuonOptions options)
    : Muon(dedicated_runtime(model), std::move(options), model.get()) {
  model_ = model;
  has_model_ = true;
}

Muon::Muon(const std::shared_ptr<RuntimeFace>& runtime, MuonOptions options)
    : Muon(runtime, std::move(options), nullptr) {}

Muon::Muon(const std::shared_ptr<RuntimeFace>& runtime, MuonOptions options, const torch::nn::Module* model)
    : Optimizer(lower_groups(runtime, options, model), std::make_unique<MuonGroupOptions>(options.lr)),
      runtime_(runtime),
      options_(std::move(options)),
      ns_(options_.ns ? *options_.ns : NewtonSchulz(options_.ns_backend)) {
  for (size_t i = 0; i < param_groups_.size(); ++i)
    check_restarts(ns_, static_cast<const MuonGroupOptions&>(param_groups_[i].options()), [&] {
      return "rank " + std::to_string(runtime->mesh().global_rank()) + ": Muon: param group '" +
             static_cast<const MuonGroupOptions&>(param_groups_[i].options()).group_name() + "'";
    });
  check_finite_ = ns_.options().check_finite;
  ns_.set_check_finite(false);  // checked for all matrices at once in step()
  runtime->set_step_verdict(check_finite_);
  NsGraphOptions go;
  go.enabled = env::ns_cuda_graphs().value_or(options_.ns_cuda_graphs);
  ns_graphs_ = std::make_shared<NsGraphs>(ns_, go);
  tp_scratch_ = std::make_shared<TpScratch>();
  tp_scratch_->set_policy(runtime->options().tp_buffer_reuse);
  runtime->set_separate_sharded_unshard(options_.sharded_adamw_unshard_separate_stream);
  require_replicated(*runtime);
  if (options_.fused.value_or(false))
    for (const auto& v : runtime->describe())
      TORCH_CHECK_VALUE(!v.param.defined() || detail::fused_adamw_available(v.param.device().type()), "rank ",
                        runtime->mesh().global_rank(), ": Muon: fused=true, but this LibTorch (", TORCH_VERSION,
                        ") has no fused AdamW kernel for '", v.name, "' on ", v.param.device(),
                        " (LibTorch >= 2.0 has it on CUDA, >= 2.4 on the CPU). Leave `fused` unset (fused wherever "
                        "LibTorch has the kernel) or set it false.");
  attachment_ = runtime->attach_optimizer();  // (last: a construction that failed above takes no gradient)
}

Muon::~Muon() {
  if (const std::shared_ptr<RuntimeFace> state = runtime_.lock()) state->release_gradients(attachment_);
}

Mesh& Muon::mesh() const { return runtime("Muon")->mesh(); }

std::shared_ptr<RuntimeFace> Muon::runtime(const char* fn) const {
  if (has_model_) {  // built from a LibTorch model: it must still exist and be dedicated
    auto model = model_.lock();
    TORCH_CHECK_VALUE(model, fn, ": the model was destroyed.");
    auto state = detail::face_of(*model);
    TORCH_CHECK_VALUE(state, fn, ": the model is no longer dedicated.");
    return state;
  }
  auto state = runtime_.lock();
  TORCH_CHECK_VALUE(state, fn,
                    ": the dedicated model's runtime was destroyed (keep what dedicate_model_view returned).");
  return state;
}

std::shared_ptr<RuntimeFace> Muon::stepping_runtime(const char* fn) const {
  std::shared_ptr<RuntimeFace> state = runtime(fn);
  // (every rank steps its optimizers in one order: every rank refuses alike, before any collective)
  const uint64_t other = state->take_gradients(attachment_);
  TORCH_CHECK_VALUE(other == 0, "rank ", state->mesh().global_rank(), ": ", fn, ": another Muon on this model (the #",
                    other, " built on it; this is #", attachment_, ") took these gradients already -- since the last "
                    "backward or zero_grad -- so this one would step the model a second time. One Muon steps a "
                    "whole dedicated model (the parameters in none of its param_groups form a default group), so two "
                    "Muons cannot split one: give one Muon every parameter set as its param_groups (each group keeps "
                    "its own hyperparameters; an lr scheduler sets each group's lr). Replacing the optimizer is fine: "
                    "the new one steps after the next backward.");
  return state;
}

MuonParamState& Muon::state_for(const at::Tensor& p) {
  auto key = state_key(p);
  auto it = state_.find(key);
  if (it == state_.end()) it = state_.emplace(key, std::make_unique<MuonParamState>()).first;
  return static_cast<MuonParamState&>(*it->second);
}

const MuonParamState* Muon::state_of(const at::Tensor& p) const {
  auto it = state_.find(state_key(p));
  return it == state_.end() ? nullptr : static_cast<const MuonParamState*>(it->second.get());
}

void Muon::muon_update(const ReadyGrad& r, const at::Tensor& g, bool momentum_done, const MuonGroupOptions& o,
                       Mesh& mesh, StepProfile& prof, detail::PhaseClock& clock, StepRun& run) {
  MuonParamState& st = state_for(r.param);
  if (!st.momentum_buffer().defined()) st.momentum_buffer(at::zeros_like(g));
  at::Tensor& buf = st.momentum_buffer();
  // buf <- mu buf + g, one pass (small CPU matrices: one host loop, no op), unless the group's
  // multi-tensor momentum did it
  if (!momentum_done && !detail::host_add(buf, g, buf, o.momentum())) at::add_out(buf, g, buf, o.momentum());
  const bool nesterov = o.nesterov();
  const double mu = o.momentum();
  st.step(st.step() + 1);
  const auto t0 = clock.now();
  // the full matrix's shape (TP: this rank holds a slice of it)
  const std::vector<int64_t> full = r.full_shape.empty() ? r.target.sizes().vec() : r.full_shape;
  const double m = static_cast<double>(std::min(full[0], full[1]));
  const double n = static_cast<double>(std::max(full[0], full[1]));
  const int steps = static_cast<int>(o.ns_steps());
  // W <- W (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) NS(u); the target is the master under mixed
  // precision, rounded into the parameter
  TpUpdate job;
  job.name = r.name;
  const double scale = 0.2 * std::sqrt(n);
  job.apply = [target = r.target, param = r.param, wb = r.write_back, lr = o.lr(), wd = o.weight_decay(),
               scale](const at::Tensor& update) mutable {
    if (!detail::host_scale_add(target, 1.0 - lr * wd, update, -lr * scale)) {
      if (wd != 0) target.mul_(1.0 - lr * wd);
      target.add_(update.to(target.scalar_type()), -lr * scale);
    }
    if (wb) param.copy_(target);
  };
  double flop_share = 1;  // of the full matrix's NS work done on this rank
  if (r.tp_owner < 0) {   // batched with the other whole matrices of the group (run_ns_batched)
    NsJob ns_job;
    ns_job.like = buf;
    ns_job.steps = steps;
    if (nesterov)
      ns_job.input = [g, buf, mu](const at::Tensor& out) {
        if (!out.defined()) return g.add(buf, mu);
        at::Tensor o = out;
        return detail::host_add(o, g, buf, mu) ? o : at::add_out(o, g, buf, mu);
      };
    else
      ns_job.input = [buf](const at::Tensor& out) {
        if (!out.defined()) return buf;
        at::Tensor o = out;
        return o.copy_(buf);
      };
    if (detail::foreach_on(options_.foreach, r.target) && r.target.scalar_type() == buf.scalar_type())
      // queued for the batch's multi-tensor update (StepRun::flush_updates), after its NS
      ns_job.apply = [&run, target = r.target, param = r.param, wb = r.write_back,
                      decay = 1.0 - o.lr() * o.weight_decay(), alpha = -o.lr() * scale](const at::Tensor& update) {
        run.pending_updates.push_back({target, update, wb ? param : at::Tensor(), decay, alpha});
      };
    else
      ns_job.apply = std::move(job.apply);
    run.add_ns_job(std::move(ns_job), r.name, r.target);
  } else {
    const at::Tensor u = nesterov ? g.add(buf, mu) : buf;
    const bool dist = options_.tp_distributed_gram && tp_distributed_gram_applies(full, r.tp_dim) &&
                      (options_.tp_distributed_gram_policy == "always" ||
                       tp_factor_to_scatter_ratio(full, ns_.options(), steps) <=
                           options_.tp_distributed_gram_max_factor_to_scatter_ratio);
    if (r.tp_dim >= 0) ++(dist ? prof.tp_distributed : prof.tp_gathered);
    flop_share = dist ? 1.0 / mesh.tp_size() : mesh.tp_rank() == r.tp_owner ? 1.0 : 0.0;
    if (r.tp_dim >= 0 && !dist) {  // gather now; NS and scatter once every gather is in flight
      job.gather = tp_issue_gather(u, r, mesh, *tp_scratch_);
      job.ready = r;
      job.steps = steps;
      run.tp_pending.push_back(std::move(job));
    } else {
      job.apply(tp_orthogonalize(u, r, steps, ns_, dist, mesh, *tp_scratch_));
    }
    clock.add(detail::Phase::Ns, t0);  // (whole matrices: timed by the batched run)
  }
  prof.ns_flops += flop_share * (20 * m * m * n + 10 * m * m * m);
  ++prof.owned_updates;
}

void Muon::index_groups() {
  size_t grouped = 0;
  for (const auto& group : param_groups_) grouped += group.params().size();
  if (grouped == group_of_count_) return;  // rebuilt when groups are added
  group_of_.clear();
  for (size_t gi = 0; gi < param_groups_.size(); ++gi)
    for (const auto& p : param_groups_[gi].params()) group_of_[p.unsafeGetTensorImpl()] = gi;
  group_of_count_ = grouped;
}

at::Tensor Muon::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable(true);
    loss = closure();
  }
  const std::shared_ptr<RuntimeFace> state = stepping_runtime("Muon::step");
  index_groups();
  if (const auto model = model_.lock()) refuse_unrouted_gradients(*model, group_of_, state->mesh().global_rank());
  // the groups' values may have changed since construction (a scheduler, the caller): a NaN lr or a
  // momentum of 1.5 is an error here, not weights silently ruined by this step
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const auto& g = static_cast<const MuonGroupOptions&>(param_groups_[i].options());
    const auto where = [&] {
      return "rank " + std::to_string(state->mesh().global_rank()) + ": Muon::step: param group #" + std::to_string(i) +
             " ('" + g.group_name() + "', " + (g.is_muon() ? "Muon" : "AdamW") + "), as set since construction,";
    };
    check_group_options_lazily(g, where);
    check_restarts(ns_, g, where);
  }
  StepProfile prof;
  // CUDA events only when profiling a CUDA model; host clocks otherwise (cheap, always on)
  detail::PhaseClock clock(options_.record_step_profile ? first_param_cuda_device(*state) : std::nullopt);
  const auto t_start = clock.now();
  const bool async = options_.replicate_async.value_or(state->options().replicate_async);
  std::optional<std::vector<ReadyGrad>> taken;  // clip_grad_norm_ took this step's gradients already
  if (taken_ && taken_epoch_ == state->grads_epoch()) taken = std::move(*taken_);  // (not before a change)
  taken_.reset();
  // collective: prepare (reduces waited), update group by group, publish
  StepRun run(*this, *state, prof, clock);
  state->step(options_.group_prepare_ahead, async, std::move(taken), run);
  ++steps_;  // (a step that raises below has applied its other updates: it counts)
  // every rank raises, or none: a rank that raised alone would leave the others in its next collective
  if (check_finite_) agree_finite_step(*state, run.nonfinite, run.nonfinite_count, detail::step_group_values(param_groups_));
  if (options_.post_step_prefetch_groups > 0 || options_.post_step_prefetch_sharded_adamw)
    state->prefetch_next_forward(options_.post_step_prefetch_groups, options_.post_step_prefetch_sharded_adamw);
  clock.add(detail::Phase::Total, t_start);
  prof.valid = true;
  prof.step = steps_;
  if (options_.record_step_profile) {
    last_profile_ = prof;
    last_clock_ = std::make_shared<detail::PhaseClock>(std::move(clock));
  }
  return loss;
}

void Muon::zero_grad(bool set_to_none) {
  // Gradients dmuon already holds (reduced sums of owned matrices, replicated buckets, sharded
  // slices) are discarded too, so zero_grad between a backward and step() drops that backward.
  taken_.reset();  // a clipped set of gradients from before is dropped too
  std::shared_ptr<RuntimeFace> state;
  if (has_model_) {
    if (auto model = model_.lock()) state = detail::face_of(*model);
  } else {
    state = runtime_.lock();
  }
  if (state) state->discard_grads(set_to_none);
  for (auto& group : param_groups_)
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (set_to_none) {
        p.mutable_grad() = at::Tensor();
      } else if (p.grad().is_view()) {  // a view into dmuon's reduced buffer: zeros of its own
        p.mutable_grad() = at::zeros_like(p.grad());
      } else {
        p.mutable_grad().detach_();
        p.mutable_grad().zero_();
      }
    }
}

StepProfile Muon::consume_last_step_profile() {
  StepProfile p = last_profile_;
  if (last_clock_) last_clock_->resolve(p);  // CUDA events: synchronizes here, not in step()
  last_profile_ = StepProfile{};
  last_clock_.reset();
  return p;
}

// Beside LibTorch's optimizer archive (groups and per-parameter state, by position), what makes a file one rank's
// state under one plan: the rank and world size that wrote it, the plan's fingerprint, and steps_taken. A state
// only means something on the rank that holds the same matrices: on another rank or plan each owner would take
// another owner's momentum (or none) without a word.
namespace {
constexpr const char* kSavedRank = "dmuon_rank";
constexpr const char* kSavedWorld = "dmuon_world_size";
constexpr const char* kSavedPlan = "dmuon_plan_fingerprint";
constexpr const char* kSavedSteps = "dmuon_steps_taken";
}  // namespace

void Muon::save(torch::serialize::OutputArchive& archive) const {
  const std::shared_ptr<RuntimeFace> state = runtime("Muon::save");
  torch::optim::serialize<MuonParamState, MuonGroupOptions>(archive, *this);
  archive.write(kSavedRank, c10::IValue(static_cast<int64_t>(state->mesh().global_rank())));
  archive.write(kSavedWorld, c10::IValue(static_cast<int64_t>(state->mesh().world_size())));
  archive.write(kSavedPlan, c10::IValue(static_cast<int64_t>(state->plan().fingerprint)));
  archive.write(kSavedSteps, c10::IValue(steps_));
}

void Muon::load(torch::serialize::InputArchive& archive) {
  const std::shared_ptr<RuntimeFace> state = runtime("Muon::load");
  const Mesh& mesh = state->mesh();
  const auto saved = [&](const char* key) -> std::optional<int64_t> {
    c10::IValue v;
    if (!archive.try_read(key, v)) return std::nullopt;
    TORCH_CHECK_VALUE(v.isInt(), "rank ", mesh.global_rank(), ": Muon::load: the archive's \"", key,
                      "\" is not an integer; the file is damaged or was not written by Muon::save.");
    return v.toInt();
  };
  const auto rank = saved(kSavedRank), world = saved(kSavedWorld), plan = saved(kSavedPlan), steps = saved(kSavedSteps);
  // every check before anything changes: a refused file leaves this optimizer as it was
  if (rank || world || plan || steps) {
    TORCH_CHECK_VALUE(rank && world && plan && steps, "rank ", mesh.global_rank(),
                      ": Muon::load: the archive holds only part of what Muon::save writes (rank, world size, plan "
                      "fingerprint, steps taken); the file is damaged or was not written by Muon::save.");
    const uint64_t fingerprint = state->plan().fingerprint;
    TORCH_CHECK_VALUE(*rank == mesh.global_rank() && *world == mesh.world_size() &&
                          static_cast<uint64_t>(*plan) == fingerprint,
                      "rank ", mesh.global_rank(), ": Muon::load: the archive holds the optimizer state of rank ", *rank,
                      " of ", *world, " under plan ", format_fingerprint(static_cast<uint64_t>(*plan)), ", but this is rank ",
                      mesh.global_rank(), " of ", mesh.world_size(), " under plan ", format_fingerprint(fingerprint),
                      ". Muon::save/load keep each rank's own state (the matrices it owns), so a file resumes only on "
                      "the rank that wrote it, on the same mesh and plan (same model, options and world size); load "
                      "each rank's own file, or resume on another mesh from save_checkpoint/load_checkpoint "
                      "(or get_optimizer_state_dict/set_optimizer_state_dict).");
    TORCH_CHECK_VALUE(*steps >= 0, "rank ", mesh.global_rank(), ": Muon::load: the archive's steps taken is ", *steps,
                      "; the file is damaged.");
  }
  torch::optim::serialize<MuonParamState, MuonGroupOptions>(archive, *this);
  if (steps) steps_ = *steps;  // an archive of an earlier dmuon records none: the count is left as it was
  taken_.reset();  // gradients clipping took belong to the state before the load
}

// ---- clipping (the norm itself: grad_clip.cpp) -----------------------------------------------------
std::vector<ClipGrad> Muon::clip_grads(ClipScope scope) {
  at::NoGradGuard ng;
  const std::shared_ptr<RuntimeFace> state = stepping_runtime("clip_grad_norm_");
  state->require_reduced_grads("clip_grad_norm_");
  state->prepare_grads();  // collective: the reduces land (idempotent; step() calls it again)
  // taken once per set of gradients: a backward or a zero_grad (the model's too) since makes them stale
  if (taken_ && taken_epoch_ != state->grads_epoch()) taken_.reset();
  if (!taken_) {
    taken_ = std::make_shared<std::vector<ReadyGrad>>(state->take_ready_grads());
    taken_epoch_ = state->grads_epoch();
  }
  // each element once over the whole mesh (see grad_clip.h): the routes decided who counts what
  std::vector<ClipGrad> out;
  for (const ReadyGrad& r : *taken_) {
    if (scope != ClipScope::AllParams && !r.muon) continue;
    out.push_back(ClipGrad{r.name, r.grad, r.norm_counted, r.norm_counts_param});
  }
  return out;
}

void Muon::agree_clip_arguments(std::optional<double> max_norm, const GradClipOptions& opts,
                                const std::string& refusal) const {
  detail::agree_clip_arguments(*runtime("clip_grad_norm_"), max_norm, opts, refusal);
}

MuonGradClipStats Muon::clip_grad_norm_(std::optional<double> max_norm, const GradClipOptions& opts) {
  // The arguments agreed first, on every rank (one small all-gather; the norm's own exchange reads the host
  // anyway): an argument one rank refuses raises on every rank, and so do arguments that differ (each replica
  // would clip by its own) and a rank in another collective call (a clip on some ranks only).
  detail::agree_clip_arguments(*runtime("clip_grad_norm_"), max_norm, opts);
  std::vector<ClipGrad> scope = clip_grads(opts.scope);
  scope.insert(scope.end(), opts.extra.begin(), opts.extra.end());
  last_clip_ = detail::clip_norm(scope, max_norm, opts, runtime("clip_grad_norm_")->mesh());
  return *last_clip_;
}

}  // namespace dmuon
