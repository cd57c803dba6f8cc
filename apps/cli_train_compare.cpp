// `dmuon train --compare adamw`: the same model and data trained with DMuon and with the AdamW
// baseline, both curves in one chart, and how many steps each needs to reach the baseline's loss.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "cli_launch.h"
#include "cli_text.h"
#include "cli_train.h"

namespace dmuon::cli::train {

std::vector<std::string> with_option(const std::vector<std::string>& args, const std::string& name,
                                     const std::optional<std::string>& value) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == name) {
      ++i;  // and its value
      continue;
    }
    if (args[i].rfind(name + "=", 0) == 0) continue;
    out.push_back(args[i]);
  }
  if (value) {
    out.push_back(name);
    out.push_back(*value);
  }
  return out;
}

Metrics read_metrics(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("--compare: cannot read " + path + " (the run did not write it)");
  auto split = [](const std::string& line) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    for (std::string c; std::getline(ss, c, ',');) cells.push_back(c);
    if (!line.empty() && line.back() == ',') cells.emplace_back();
    return cells;
  };
  std::string line;
  std::getline(in, line);
  const std::vector<std::string> head = split(line);
  auto col = [&](const std::string& name) -> size_t {
    auto it = std::find(head.begin(), head.end(), name);
    if (it == head.end()) throw std::runtime_error("--compare: " + path + " has no column '" + name + "'");
    return static_cast<size_t>(it - head.begin());
  };
  const size_t cs = col("step"), cl = col("loss"), cv = col("val_loss");
  Metrics m;
  while (std::getline(in, line) && !in.eof()) {  // (a last line without its newline: an append cut short)
    const std::vector<std::string> c = split(line);
    if (c.size() <= std::max({cs, cl, cv})) continue;
    m.steps.push_back(std::stoll(c[cs]));
    m.loss.push_back(std::stod(c[cl]));
    if (!c[cv].empty()) {
      m.val_steps.push_back(m.steps.back());
      m.val_loss.push_back(std::stod(c[cv]));
    }
  }
  return m;
}

std::vector<double> trailing_mean(const std::vector<double>& v, size_t window) {
  std::vector<double> out(v.size());
  double sum = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    sum += v[i];
    if (i >= window) sum -= v[i - window];
    out[i] = sum / static_cast<double>(std::min(i + 1, window));
  }
  return out;
}

StepsToTarget steps_to_target(const Metrics& dmuon, const Metrics& adamw) {
  StepsToTarget r;
  const size_t n = std::min(dmuon.loss.size(), adamw.loss.size());
  if (n == 0) return r;
  r.window = std::clamp<size_t>(n / 10, 1, 10);
  const std::vector<double> sd = trailing_mean(dmuon.loss, r.window), sa = trailing_mean(adamw.loss, r.window);
  r.target = sa[n - 1];
  r.dmuon_final = sd[n - 1];
  auto first_at = [&](const std::vector<double>& s, const std::vector<int64_t>& steps) -> int64_t {
    for (size_t i = 0; i < n; ++i)
      if (s[i] <= r.target) return steps[i];
    return -1;
  };
  r.dmuon_steps = first_at(sd, dmuon.steps);
  r.adamw_steps = first_at(sa, adamw.steps);
  if (r.dmuon_steps > 0 && r.adamw_steps > 0)
    r.ratio = static_cast<double>(r.adamw_steps) / static_cast<double>(r.dmuon_steps);
  return r;
}

int run_compare(const TrainArgs& a, const std::vector<std::string>& args, const LaunchFn& launch, std::ostream& out) {
  const std::pair<std::string, std::string> arms[] = {{"dmuon", "dmuon"}, {"adamw", "adamw"}};
  Metrics m[2];
  for (int i = 0; i < 2; ++i) {
    TrainArgs b = a;
    b.compare.clear();
    b.optimizer = arms[i].second;
    b.out = a.out + "/" + arms[i].first;
    std::vector<std::string> bargs = with_option(args, "--compare", std::nullopt);
    bargs = with_option(bargs, "--optimizer", b.optimizer);
    bargs = with_option(bargs, "--out", b.out);
    out << "== --compare: " << (i == 0 ? "DMuon" : "AdamW baseline") << " into " << b.out << "\n" << std::flush;
    if (const int rc = launch(b, bargs)) return rc;
    m[i] = read_metrics(b.out + "/metrics.csv");
  }
  const StepsToTarget s = steps_to_target(m[0], m[1]);
  const double baseline = unigram_entropy_nats(load_text(a.data, static_cast<size_t>(a.seq_len + 2)));
  write_file_atomic(a.out + "/compare.svg",
                    curves_svg({{"DMuon train", m[0].steps, m[0].loss, "#1f5fbf", false},
                                {"DMuon validation", m[0].val_steps, m[0].val_loss, "#1f5fbf", true},
                                {"AdamW train", m[1].steps, m[1].loss, "#2a9d3a", false},
                                {"AdamW validation", m[1].val_steps, m[1].val_loss, "#2a9d3a", true}},
                               baseline, "dmuon train --compare adamw: " + std::to_string(a.ranks) + " ranks"));
  auto last = [](const std::vector<double>& v) { return v.empty() ? std::nan("") : v.back(); };
  nlohmann::json j;
  j["target_loss"] = s.target;
  j["target_is"] = "AdamW's final train loss (trailing mean over " + std::to_string(s.window) + " logged steps)";
  j["dmuon_steps_to_target"] = s.dmuon_steps;
  j["adamw_steps_to_target"] = s.adamw_steps;
  j["steps_ratio_adamw_over_dmuon"] = s.ratio > 0 ? nlohmann::json(s.ratio) : nlohmann::json();
  j["dmuon_final_train_loss"] = s.dmuon_final;
  j["adamw_final_train_loss"] = s.target;
  j["dmuon_final_val_loss"] = std::isfinite(last(m[0].val_loss)) ? nlohmann::json(last(m[0].val_loss)) : nlohmann::json();
  j["adamw_final_val_loss"] = std::isfinite(last(m[1].val_loss)) ? nlohmann::json(last(m[1].val_loss)) : nlohmann::json();
  write_file_atomic(a.out + "/compare.json", j.dump(2) + "\n");
  out << std::fixed << std::setprecision(3) << "\ncompare (same model, data and steps)\n"
      << "  final train loss  DMuon " << s.dmuon_final << ", AdamW " << s.target << " (trailing mean of " << s.window
      << " logged steps)\n";
  if (!m[0].val_loss.empty() && !m[1].val_loss.empty())
    out << "  final val loss    DMuon " << last(m[0].val_loss) << ", AdamW " << last(m[1].val_loss) << "\n";
  if (s.ratio > 0)
    out << "  steps to AdamW's final loss: DMuon " << s.dmuon_steps << ", AdamW " << s.adamw_steps << " -> AdamW needs "
        << std::setprecision(2) << s.ratio << "x the steps\n";
  else
    out << "  DMuon did not reach AdamW's final loss " << s.target << " within " << a.steps << " steps\n";
  out << "  outputs           " << a.out << "/compare.svg, " << a.out << "/compare.json, " << a.out << "/dmuon/, "
      << a.out << "/adamw/\n";
  return 0;
}

}  // namespace dmuon::cli::train
