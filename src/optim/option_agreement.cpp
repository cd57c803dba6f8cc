// Muon's options agreed across ranks (see option_agreement.h).
#include "optim/option_agreement.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>

#include "dmuon/digest.h"
#include "comm/agreement.h"

namespace dmuon::detail {

namespace {

// The shortest decimal that reads back as exactly `v` (so two values differ in text iff they differ; the
// digests compare the text): 0.02, not 0x1.47ae147ae147bp-6.
std::string num(double v) {
  char buf[64];
  for (int digits = 15; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v || std::isnan(v)) break;
  }
  return buf;
}
template <typename T>
std::string opt(const std::optional<T>& v, std::string (*text)(const T&)) {
  return v ? text(*v) : std::string("unset");
}
std::string dbl(const double& v) { return num(v); }
std::string flag(const bool& v) { return v ? "true" : "false"; }
std::string pair(const std::pair<double, double>& v) {
  std::ostringstream s;
  s << '(' << num(v.first) << ", " << num(v.second) << ')';
  return s.str();
}
std::string count(const int& v) { return std::to_string(v); }

std::string ns_text(const NewtonSchulz& ns) {
  const NsOptions& o = ns.options();
  std::ostringstream s;
  s << ns.backend() << " kernel=" << o.kernel << " steps=" << o.steps << " eps=" << num(o.eps) << " coefficients=";
  if (o.coefficients) {
    for (const auto& c : *o.coefficients) s << '(' << num(c[0]) << ", " << num(c[1]) << ", " << num(c[2]) << ')';
  } else {
    s << "default";
  }
  s << " restart_iterations=";
  if (o.restart_iterations) {
    for (int i : *o.restart_iterations) s << i << ',';
  } else {
    s << "default";
  }
  s << " compute_dtype=" << (o.compute_dtype ? std::string(c10::toString(*o.compute_dtype)) : std::string("default"))
    << " check_finite=" << flag(o.check_finite) << " force_gram=" << flag(o.force_gram);
  return s.str();
}

}  // namespace

std::vector<std::pair<std::string, std::string>> agreed_options(const RuntimeFace& runtime, const MuonOptions& o) {
  std::map<const c10::TensorImpl*, std::string> names;
  for (const auto& v : runtime.describe())
    if (v.param.defined()) names.emplace(v.param.unsafeGetTensorImpl(), v.name);
  std::ostringstream groups;
  for (const auto& g : o.param_groups) {
    groups << "{name=" << g.name << " params=[";
    for (const auto& p : g.params) {
      auto it = p.defined() ? names.find(p.unsafeGetTensorImpl()) : names.end();
      groups << (it == names.end() ? std::string("<not a trainable parameter of the model>") : it->second) << ',';
    }
    groups << "] lr=" << opt(g.lr, dbl) << " momentum=" << opt(g.momentum, dbl) << " weight_decay="
           << opt(g.weight_decay, dbl) << " nesterov=" << opt(g.nesterov, flag) << " ns_steps=" << opt(g.ns_steps, count)
           << " adamw_lr=" << opt(g.adamw_lr, dbl) << " adamw_weight_decay=" << opt(g.adamw_weight_decay, dbl)
           << " adamw_eps=" << opt(g.adamw_eps, dbl) << " adamw_betas=" << opt(g.adamw_betas, pair) << '}';
  }
  return {
      {"lr", num(o.lr)},
      {"momentum", num(o.momentum)},
      {"weight_decay", num(o.weight_decay)},
      {"ns_steps", std::to_string(o.ns_steps)},
      {"adamw_lr", num(o.adamw_lr)},
      {"adamw_betas", pair(o.adamw_betas)},
      {"adamw_weight_decay", num(o.adamw_weight_decay)},
      {"adamw_eps", num(o.adamw_eps)},
      {"param_groups", groups.str()},
      {"ns_backend / ns", o.ns ? ns_text(*o.ns) : o.ns_backend},
      {"nesterov", flag(o.nesterov)},
      {"replicate_async", opt(o.replicate_async, flag)},
      {"group_prepare_ahead", flag(o.group_prepare_ahead)},
      {"tp_distributed_gram", flag(o.tp_distributed_gram)},
      {"tp_distributed_gram_policy", o.tp_distributed_gram_policy},
      {"tp_distributed_gram_max_factor_to_scatter_ratio", num(o.tp_distributed_gram_max_factor_to_scatter_ratio)},
      {"post_step_prefetch_groups", std::to_string(o.post_step_prefetch_groups)},
      {"post_step_prefetch_sharded_adamw", flag(o.post_step_prefetch_sharded_adamw)},
      {"sharded_adamw_unshard_separate_stream", flag(o.sharded_adamw_unshard_separate_stream)},
      {"fused", opt(o.fused, flag)},
      {"foreach", opt(o.foreach, flag)},
  };
}

std::vector<AgreedEntry> step_group_values(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::vector<AgreedEntry> out;
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto& g = static_cast<const MuonGroupOptions&>(groups[i].options());
    std::string shown = "lr=" + num(g.lr()) + " weight_decay=" + num(g.weight_decay());
    if (g.is_muon())
      shown += " momentum=" + num(g.momentum()) + " nesterov=" + flag(g.nesterov()) +
               " ns_steps=" + std::to_string(g.ns_steps());
    else
      shown += " betas=" + pair({g.beta1(), g.beta2()}) + " eps=" + num(g.eps());
    const uint64_t digest = fnv1a(shown);
    out.push_back({"param group #" + std::to_string(i) + " ('" + g.group_name() + "', " +
                       (g.is_muon() ? "Muon" : "AdamW") + ")",
                   digest, std::move(shown)});
  }
  return out;
}

std::string step_values_differ(const Disagreement& d) {
  const std::string what = d.entry ? d.entry->key + " (this rank's: " + d.entry->shown + ")" : "the param groups";
  return "the ranks stepped with different values of " + what + "; rank(s) " + rank_list(d.ranks) +
         " differ from the first rank. Each rank applied its own in this step, so the replicas differ now. A value "
         "changed on some ranks only does this (a scheduler stepped with each rank's own metric, e.g. "
         "ReduceLROnPlateau.step(local_loss), or a write on one rank): give every rank the same values (average "
         "the metric over the ranks first), then resume from a checkpoint taken before this step.";
}

void agree_options(const RuntimeFace& runtime, const MuonOptions& o, const std::function<void()>& check) {
  AgreementText text;
  text.fn = "Muon";
  text.given = "the options";
  text.outcome = "no rank builds Muon";
  const int first = runtime.mesh().world().global_ranks().front();
  text.differs = [&](const Disagreement& d) {
    std::string what = d.entry ? d.entry->key + " (this rank's: " + d.entry->shown + "; " : std::string("options (");
    return "the ranks were given different " + what + "rank(s) " + rank_list(d.ranks) + " differ from rank " +
           std::to_string(first) + "). Each rank would train with its own (the replicas drift apart) or issue other "
           "collectives (a hang); pass the same options to Muon on every rank.";
  };
  agree(runtime.mesh().world(), text, check, [&] {
    std::vector<AgreedEntry> out;
    for (auto& [name, value] : agreed_options(runtime, o)) {
      const uint64_t digest = fnv1a(value);
      out.push_back({name, digest, std::move(value)});
    }
    return out;
  });
}

void agree_clip_arguments(const RuntimeFace& runtime, std::optional<double> max_norm, const GradClipOptions& opts,
                          const std::string& refusal) {
  const int rank = runtime.mesh().global_rank();
  AgreementText text;
  text.fn = "clip_grad_norm_";
  text.given = "the arguments";
  text.outcome = "no rank clips";
  text.differs = [](const Disagreement& d) {
    return d.entry ? "the ranks clip with different arguments: " + d.entry->key + " is " + d.entry->shown +
                         " here and differs on rank(s) " + rank_list(d.ranks) + " (each would clip by its own)."
                   : std::string("the ranks clip with different arguments.");
  };
  agree(
      runtime.mesh().world(), text,
      [&] {
        TORCH_CHECK_VALUE(refusal.empty(), refusal);
        TORCH_CHECK_VALUE(opts.norm_type > 0, "rank ", rank, ": clip_grad_norm_: norm_type must be > 0 (or INFINITY), "
                          "got ", opts.norm_type);
        TORCH_CHECK_VALUE(!max_norm || *max_norm >= 0, "rank ", rank, ": clip_grad_norm_: max_norm must be >= 0 "
                          "(None / nullopt only measures), got ", *max_norm);
      },
      [&] {
        std::vector<AgreedEntry> out;
        const auto add = [&](std::string key, std::string shown) {
          const uint64_t digest = fnv1a(shown);
          out.push_back({std::move(key), digest, std::move(shown)});
        };
        add("max_norm", max_norm ? num(*max_norm) : "none");
        add("norm_type", num(opts.norm_type));
        add("scope", opts.scope == ClipScope::AllParams ? "all" : "muon");
        add("strategy", "'" + opts.strategy + "'");
        add("error_if_nonfinite", flag(opts.error_if_nonfinite));
        return out;
      });
}

}  // namespace dmuon::detail
