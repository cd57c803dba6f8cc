// `dmuon train`'s report: per-rank figures gathered, summary.json and the printed summary.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <iomanip>
#include <numeric>

#include "cli_launch.h"
#include "cli_text.h"
#include "cli_train.h"
#include "dmuon/diagnostics.h"
#include "dmuon/memory.h"

namespace dmuon::cli::train {

std::string fmt_secs(double s) {
  const int t = static_cast<int>(s + 0.5);
  std::ostringstream o;
  o << t / 60 << ":" << std::setw(2) << std::setfill('0') << t % 60;
  return o.str();
}

double mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

int report(const TrainArgs& a, TrainRun& r, TrainLog& log, std::ostream& out) {
  const int world = r.world, first_step = r.first_step;
  const bool use_muon = r.use_muon;
  const double baseline = r.baseline, total_s = log.total_s;
  const auto& model = r.model;
  const auto& losses = log.losses;
  const auto &step_ms = log.step_ms, &fwd_ms = log.fwd_ms, &bwd_ms = log.bwd_ms, &ns_ms = log.ns_ms,
             &adamw_ms = log.adamw_ms, &wait_ms = log.wait_ms, &prep_ms = log.prep_ms;

  // NS load per rank: every rank's total NS milliseconds
  auto gather = [&](double v, const char* what) {
    at::Tensor all = at::zeros({world}, at::TensorOptions().dtype(at::kDouble).device(r.device));
    at::Tensor mine = at::tensor({v}, at::kDouble).to(r.device);
    r.trainer->allgather_flat(all, mine, what).wait_host();
    return all.cpu();
  };
  at::Tensor ns_all = gather(std::accumulate(ns_ms.begin(), ns_ms.end(), 0.0), "NS load");
  at::Tensor bytes_all = gather(mean(log.bytes_per_step), "bytes per step");
  at::Tensor muon_all = gather(mean(log.muon_bytes_per_step), "Muon bytes per step");
  // peak live tensor bytes per rank: overall and per phase (CPU: the counting allocator; CUDA: the
  // caching allocator's allocated bytes, no phases)
  const memory::Stats mem = memory::device_stats(r.device);
  at::Tensor peak_all = gather(static_cast<double>(mem.peak), "peak memory");
  std::vector<at::Tensor> phase_all;
  for (int ph = 1; ph < memory::kNumPhases; ++ph)
    phase_all.push_back(gather(static_cast<double>(mem.peak_by_phase[static_cast<size_t>(ph)]), "peak memory by phase"));
  if (!r.lead) return 0;
  auto per_rank = [&](const at::Tensor& t) {
    std::vector<int64_t> v;
    for (int q = 0; q < world; ++q) v.push_back(static_cast<int64_t>(t[q].item<double>()));
    return v;
  };

  const ModelCommPlan plan = get_comm_plan(*model);
  const size_t tail = std::min<size_t>(10, losses.size());
  const double final_loss = std::accumulate(losses.end() - tail, losses.end(), 0.0) / static_cast<double>(tail);
  const double ns_max = ns_all.max().item<double>(), ns_mean = ns_all.mean().item<double>();
  const double measured_bytes = bytes_all.mean().item<double>();
  // per rank: the shard-axis formula (over G ranks), plus on HSDP the replicate axis 2(R-1)/(G*R)*P_M
  const double formula = use_muon ? plan.formula() : 0.0;
  nlohmann::json s;
  s["world_size"] = world;
  s["process_group_backend"] = r.mesh->world().process_group()->getBackendName();
  s["device"] = a.device;
  s["optimizer"] = a.optimizer;
  s["mode"] = a.mode;
  s["steps"] = a.steps;
  s["first_step"] = first_step;
  s["global_batch"] = a.batch;
  s["seq_len"] = a.seq_len;
  s["model"] = {{"description", model->describe()}, {"hf_config", a.hf_config}, {"init_from", a.init_from},
                {"d_model", a.d_model}, {"layers", a.layers}, {"heads", a.heads},
                {"params", [&] {
                   int64_t n = 0;
                   for (const auto& p : model->parameters()) n += p.numel();
                   return n;
                 }()}};
  s["first_loss"] = losses.front();
  s["final_loss"] = final_loss;
  s["val_loss"] = log.val_losses.empty() ? nlohmann::json() : nlohmann::json(log.val_losses.back());
  s["val_losses"] = {{"steps", log.val_steps}, {"loss", log.val_losses}};
  s["grad_norm"] = {{"first", log.grad_norms.empty() ? 0.0 : log.grad_norms.front()},
                    {"last", log.grad_norms.empty() ? 0.0 : log.grad_norms.back()},
                    {"clip", a.clip_grad},
                    {"clipped_fraction", log.grad_norms.empty() ? 0.0
                                                                : static_cast<double>(log.clipped_steps) /
                                                                      static_cast<double>(log.grad_norms.size())}};
  s["loss_scale"] = log.loss_scale > 0 ? nlohmann::json{{"final", log.loss_scale}, {"skipped_steps", log.skipped_steps}}
                                       : nlohmann::json();
  s["unigram_baseline"] = baseline;
  s["below_baseline"] = final_loss < baseline;
  s["seconds"] = total_s;
  s["tokens_per_s"] = static_cast<double>(a.batch * a.seq_len * (a.steps - first_step + 1)) / total_s;
  s["step_ms"] = {{"mean", mean(step_ms)}, {"forward", mean(fwd_ms)}, {"backward", mean(bwd_ms)},
                  {"newton_schulz", mean(ns_ms)}, {"comm_wait", mean(wait_ms)}, {"grad_prepare", mean(prep_ms)},
                  {"adamw", mean(adamw_ms)}};
  s["bytes_per_step"] = {{"measured_mean_per_rank", measured_bytes},
                         {"measured_per_rank", std::vector<double>(bytes_all.data_ptr<double>(),
                                                                   bytes_all.data_ptr<double>() + world)},
                         {"formula_per_rank", formula},
                         {"note", "measured: dmuon's Muon broadcasts/reduces plus the AdamW all-reduces; formula: "
                                  "Muon matrices only, 2(N-1)/N*P_M (Z2) or 3(N-1)/N*P_M (Z3)"}};
  const double muon_measured = muon_all.mean().item<double>();
  s["muon_bytes_per_step"] = {{"measured_mean_per_rank", muon_measured},
                              {"formula", formula},
                              {"measured_over_formula", formula > 0 ? muon_measured / formula : 0.0}};
  s["ns_load_ms"] = {{"per_rank", std::vector<double>(ns_all.data_ptr<double>(), ns_all.data_ptr<double>() + world)},
                     {"max", ns_max},
                     {"mean", ns_mean},
                     {"max_over_mean", ns_mean > 0 ? ns_max / ns_mean : 1.0}};
  s["peak_memory_bytes"] = per_rank(peak_all);
  nlohmann::json by_phase = nlohmann::json::object();
  if (!r.device.is_cuda())
    for (int ph = 1; ph < memory::kNumPhases; ++ph)
      by_phase[memory::phase_name(static_cast<memory::Phase>(ph))] = per_rank(phase_all[static_cast<size_t>(ph - 1)]);
  s["peak_memory_by_phase"] = by_phase;
  s["peak_memory_note"] = r.device.is_cuda() ? "CUDA caching allocator: peak allocated bytes"
                                             : "live tensor bytes (dmuon's counting CPU allocator), per rank";
  s["plan"] = {{"imbalance", plan.plan.imbalance()}, {"fingerprint", format_fingerprint(plan.plan.fingerprint)}};
  write_outputs(a, r, log, true);
  write_file_atomic(a.out + "/summary.json", s.dump(2) + "\n");

  out << std::fixed << std::setprecision(3);
  out << "\nsummary (" << world << " ranks, " << a.steps << " steps, " << std::setprecision(1) << total_s << " s)\n"
      << std::setprecision(3) << "  loss            " << losses.front() << " -> " << final_loss
      << " (mean of last " << tail << " steps); unigram baseline " << baseline
      << (final_loss < baseline ? "  [below baseline]" : "  [NOT below baseline]") << "\n"
      << (log.val_losses.empty() ? std::string()
                                 : "  val loss        " + std::to_string(log.val_losses.back()).substr(0, 5) +
                                       " (held-out text, step " + std::to_string(log.val_steps.back()) + ")\n")
      << std::setprecision(4) << "  grad norm       first " << s["grad_norm"]["first"].get<double>() << ", last "
      << s["grad_norm"]["last"].get<double>()
      << (a.clip_grad > 0 ? "; clipped to " + std::to_string(a.clip_grad) + " in " +
                                std::to_string(static_cast<int>(100 * s["grad_norm"]["clipped_fraction"].get<double>() + 0.5)) +
                                "% of steps"
                          : std::string("; not clipped (--clip-grad)"))
      << "\n"
      << (log.loss_scale > 0 ? "  loss scale      " + nlohmann::json(log.loss_scale).dump() + " at the end; " +
                                   std::to_string(log.skipped_steps) + " step(s) skipped for an inf / NaN gradient\n"
                             : std::string())
      << std::setprecision(0) << "  tokens/s        " << s["tokens_per_s"].get<double>() << "\n"
      << std::setprecision(1) << "  step ms         " << mean(step_ms) << " = forward " << mean(fwd_ms)
      << " + backward " << mean(bwd_ms) << " + optimizer " << mean(prep_ms) + mean(ns_ms) + mean(adamw_ms)
      << " (NS " << mean(ns_ms) << ", AdamW " << mean(adamw_ms) << ", grad wait " << mean(prep_ms) << ")"
      << "; blocked on communication " << mean(wait_ms) << "\n";
  if (use_muon) {
    out << std::setprecision(0) << "  bytes/step/rank Muon " << muon_measured << " measured vs "
        << (a.mode == "z3" ? "3" : "2") << "(G-1)/G*P_M" << (a.replicate > 1 ? " + 2(R-1)/(G*R)*P_M" : "")
        << " = " << formula << " (ratio " << std::setprecision(4)
        << (formula > 0 ? muon_measured / formula : 0.0) << std::setprecision(0) << "); all collectives "
        << measured_bytes << "\n"
        << std::setprecision(2) << "  NS load         max/mean " << (ns_mean > 0 ? ns_max / ns_mean : 1.0)
        << " over ranks (plan imbalance " << plan.plan.imbalance() << ")\n";
  }
  {
    const auto peaks = s["peak_memory_bytes"].get<std::vector<int64_t>>();
    const int64_t hi = *std::max_element(peaks.begin(), peaks.end()), lo = *std::min_element(peaks.begin(), peaks.end());
    out << std::setprecision(2) << "  peak memory     " << static_cast<double>(hi) / 1e6 << " MB per rank (max; min "
        << static_cast<double>(lo) / 1e6 << " MB)";
    if (!r.device.is_cuda()) {
      out << ": setup / forward / backward / step";
      for (const char* ph : {"setup", "forward", "backward", "step"})
        out << (ph[0] == 's' && ph[1] == 'e' ? " " : " / ")
            << static_cast<double>(*std::max_element(by_phase[ph].begin(), by_phase[ph].end())) / 1e6;
      out << " MB";
    }
    out << "\n";
  }
  out << "  outputs         " << a.out << "/metrics.csv, " << a.out << "/summary.json, " << a.out << "/loss.svg\n";
  return 0;
}

}  // namespace dmuon::cli::train
