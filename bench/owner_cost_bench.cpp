// owner_cost_bench -- does owner_cost_model = "profiled" balance the measured NS time per owner better
// than the FLOP formula ("optimizer") where that formula misjudges small and skinny matrices?
//
//   owner_cost_bench [--slots S] [--reps N] [--threads T]
//
// Per case: measure this machine's NS profile for the case's shapes (ns_calibration.h), plan the
// owners over S slots with both cost models, then time each slot's NS of its matrices the way
// Muon::step runs them (newton_schulz_many: stacked where stacking pays), the two plans' slots
// interleaved rep by rep. Prints per plan the measured max and mean slot time and max/mean (1.0 =
// perfectly balanced; the step waits for the busiest owner, so max is what a step pays).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dmuon/newton_schulz.h"
#include "dmuon/ns_runner.h"
#include "dmuon/tools/ns_calibration.h"
#include "dmuon/owner_plan.h"

namespace {

struct Case {
  std::string name;
  std::vector<dmuon::ParamSpec> params;
};

dmuon::ParamSpec spec(const std::string& name, int64_t m, int64_t n) {
  dmuon::ParamSpec p;
  p.name = name;
  p.shape = {m, n};
  p.elem_bytes = 4;
  return p;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  {  // a few square matrices and many skinny ones (routers, low-rank adapters, per-head projections)
    Case c{"(a) 5 x 256x256 + 600 x 8x512", {}};
    for (int i = 0; i < 5; ++i) c.params.push_back(spec("sq" + std::to_string(i), 256, 256));
    for (int i = 0; i < 600; ++i) c.params.push_back(spec("sk" + std::to_string(i), 8, 512));
    out.push_back(std::move(c));
  }
  {  // small square matrices
    Case c{"(b) 5 x 256x256 + 600 x 32x32", {}};
    for (int i = 0; i < 5; ++i) c.params.push_back(spec("sq" + std::to_string(i), 256, 256));
    for (int i = 0; i < 600; ++i) c.params.push_back(spec("sm" + std::to_string(i), 32, 32));
    out.push_back(std::move(c));
  }
  {  // a small MoE: per layer attention 4 x 128x128, a 16 x 128 router, 32 experts of 48x128 and 128x48
    Case c{"(c) MoE 6 layers, 32 experts", {}};
    for (int l = 0; l < 6; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      for (const char* w : {"q", "k", "v", "o"}) c.params.push_back(spec(p + "attn." + w, 128, 128));
      c.params.push_back(spec(p + "router", 16, 128));
      for (int e = 0; e < 32; ++e) {
        c.params.push_back(spec(p + "experts." + std::to_string(e) + ".up", 48, 128));
        c.params.push_back(spec(p + "experts." + std::to_string(e) + ".down", 128, 48));
      }
    }
    out.push_back(std::move(c));
  }
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int slots = 4, reps = 5, threads = 1;
  for (int i = 1; i < argc; ++i) {
    auto next = [&]() -> int {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "error: %s needs a value\n", argv[i]);
        std::exit(2);
      }
      return std::atoi(argv[++i]);
    };
    if (!std::strcmp(argv[i], "--slots")) slots = next();
    else if (!std::strcmp(argv[i], "--reps")) reps = next();
    else if (!std::strcmp(argv[i], "--threads")) threads = next();
    else {
      std::fprintf(stderr, "usage: owner_cost_bench [--slots S] [--reps N] [--threads T]\n");
      return 2;
    }
  }
  if (slots < 2 || reps < 1 || threads < 1) {
    std::fprintf(stderr, "error: --slots >= 2, --reps >= 1, --threads >= 1\n");
    return 2;
  }
  at::set_num_threads(threads);  // one owner rank's share of the machine
  const dmuon::NewtonSchulz ns("gram");
  std::printf("# owner_cost_bench: %d slots, %d threads, %d reps (median per slot), %s, fp32\n", slots, threads, reps,
              ns.describe().c_str());
  std::printf("%-32s %-10s %10s %10s %9s %14s\n", "case", "cost model", "max_ms", "mean_ms", "max/mean",
              "max vs optimizer");
  for (const Case& c : cases()) {
    std::vector<dmuon::NsShape> shapes;
    for (const auto& p : c.params) shapes.push_back({p.shape[0], p.shape[1], p.elem_bytes});
    dmuon::NsCalibrationOptions co;
    co.reps = reps;
    auto profile = std::make_shared<const dmuon::NsProfile>(dmuon::measure_ns_profile(shapes, co));
    dmuon::PlanOptions flops, prof;
    flops.owner_cost_model = "optimizer";
    prof.owner_cost_model = "profiled";
    prof.ns_profile = profile;
    const dmuon::OwnerPlan plans[2] = {dmuon::plan_owners(c.params, slots, 1, flops),
                                       dmuon::plan_owners(c.params, slots, 1, prof)};
    at::manual_seed(0);
    std::vector<at::Tensor> mats;
    for (const auto& p : c.params) mats.push_back(at::randn({p.shape[0], p.shape[1]}));
    std::vector<std::vector<at::Tensor>> on[2];
    for (int k = 0; k < 2; ++k) {
      on[k].assign(static_cast<size_t>(slots), {});
      for (size_t i = 0; i < c.params.size(); ++i) on[k][static_cast<size_t>(plans[k].owners[i].shard)].push_back(mats[i]);
    }
    std::vector<std::vector<double>> t[2];
    for (int k = 0; k < 2; ++k) t[k].assign(static_cast<size_t>(slots), {});
    for (int r = 0; r <= reps; ++r)  // rep 0 warms up
      for (int s = 0; s < slots; ++s)
        for (int k = 0; k < 2; ++k) {
          const auto t0 = std::chrono::steady_clock::now();
          if (!on[k][static_cast<size_t>(s)].empty()) (void)dmuon::newton_schulz_many(ns, on[k][static_cast<size_t>(s)]);
          if (r > 0) t[k][static_cast<size_t>(s)].push_back(seconds_since(t0));
        }
    double mx[2] = {0, 0};
    for (int k = 0; k < 2; ++k) {
      double sum = 0;
      for (auto& v : t[k]) {
        std::sort(v.begin(), v.end());
        const double med = v[v.size() / 2];
        sum += med;
        mx[k] = std::max(mx[k], med);
      }
      const double mean = sum / slots;
      std::printf("%-32s %-10s %10.2f %10.2f %9.3f %14.3f\n", k ? "" : c.name.c_str(), k ? "profiled" : "optimizer",
                  mx[k] * 1e3, mean * 1e3, mx[k] / mean, mx[k] / mx[0]);
    }
    std::fflush(stdout);
  }
  std::printf("# max vs optimizer < 1: the profiled plan's busiest owner is faster (the step waits for it).\n");
  return 0;
}
