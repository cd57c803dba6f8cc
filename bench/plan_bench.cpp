// plan_bench -- owner-plan quality and planning time on the model presets.
//
// For every preset and owner-slot count S = G x R in {8, 64, 512, 4096} it plans the Muon targets
// (default predicate, default options) with lpt and with round_robin, on a 1-D mesh (G = S, R = 1)
// and on an HSDP grid with G = 8 (R = S / 8), and prints:
//   imbalance = makespan / lower_bound, lower_bound = max(total / S, largest matrix)
//   per-matrix = the imbalance of the same plan with pack_small_params off (packing never costs
//               more than 1% against it), packing = the variant kept (uncapped / capped / none)
//   floor     = granularity_bound / lower_bound: the imbalance no assignment can beat (pigeonhole
//               bound over the unit costs; layer constraints ignored)
//   lpt/floor = makespan / granularity_bound (1.000 = provably optimal)
//   ms        = median wall time of plan_owners with lpt over the repetitions
// Usage: plan_bench [repetitions (default 5)] [preset ...]
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dmuon/tools/model_specs.h"
#include "dmuon/owner_plan.h"

int main(int argc, char** argv) {
  int reps = 5;
  std::vector<std::string> names;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (!a.empty() && std::isdigit(static_cast<unsigned char>(a[0])))
      reps = std::max(1, std::atoi(a.c_str()));
    else
      names.push_back(a);
  }
  if (names.empty()) names = dmuon::model_preset_names();

  std::printf("| preset | muon params | units | G x R | lpt imbalance | per-matrix | packing | floor | "
              "lpt/floor | round_robin imbalance | lpt violations | lpt ms |\n");
  std::printf("|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|\n");
  for (const std::string& name : names) {
    std::vector<dmuon::ParamSpec> params;
    try {
      params = dmuon::select_muon_params(dmuon::model_preset(name));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      return 1;
    }
    for (int S : {8, 64, 512, 4096}) {
      std::vector<std::pair<int, int>> grids = {{S, 1}};
      if (S > 8) grids.emplace_back(8, S / 8);
      for (auto [G, R] : grids) {
        dmuon::PlanOptions lpt_opts;
        lpt_opts.owner_strategy = "lpt";
        dmuon::PlanOptions rr_opts;
        rr_opts.owner_strategy = "round_robin";
        std::vector<double> ms;
        dmuon::OwnerPlan lpt;
        for (int r = 0; r < reps; ++r) {
          const auto t0 = std::chrono::steady_clock::now();
          lpt = dmuon::plan_owners(params, G, R, lpt_opts);
          const auto t1 = std::chrono::steady_clock::now();
          ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        }
        std::sort(ms.begin(), ms.end());
        const dmuon::OwnerPlan rr = dmuon::plan_owners(params, G, R, rr_opts);
        dmuon::PlanOptions off = lpt_opts;
        off.pack_small_params = false;
        const dmuon::OwnerPlan per_matrix = dmuon::plan_owners(params, G, R, off);
        const char* packing = lpt.pack_cap <= 0 ? "none" : std::isinf(lpt.pack_cap) ? "uncapped"
                                                                                    : "capped";
        std::printf("| %s | %zu | %zu | %d x %d | %.3f | %.3f | %s | %.3f | %.3f | %.3f | %zu | %.2f |\n",
                    name.c_str(), params.size(), lpt.units.size(), G, R, lpt.imbalance(),
                    per_matrix.imbalance(), packing, lpt.granularity_bound / lpt.lower_bound,
                    lpt.granularity_imbalance(), rr.imbalance(), lpt.violations.size(),
                    ms[ms.size() / 2]);
      }
    }
  }
  return 0;
}
