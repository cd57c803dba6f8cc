// comm_bytes_bench: bytes per rank and step that dmuon's communication layer counts for the Muon
// matrices, next to the planner's per-rank figure and the formulas 2(N-1)/N*P_M (Z2) and
// 3(N-1)/N*P_M (Z3). N ranks run as threads (Gloo on 127.0.0.1, FileStore in a temp dir).
//
//   usage: comm_bytes_bench [--ranks 2,3,4] [--d-model 256] [--layers 4] [--steps 3] [--pack 0|1]
#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dmuon/bootstrap.h"
#include "dmuon/compat.h"
#include "dmuon/dedicate.h"
#include "dmuon/diagnostics.h"
#include "dmuon/muon.h"
#include "model/dedicated_gpt.h"
#include "model/gpt.h"

int main(int argc, char** argv) {
  std::vector<int> ranks = {2, 3, 4};
  int64_t d_model = 256, layers = 4;
  int steps = 3;
  bool pack = false;
  int replicate = 1;
  std::string param_dtype = "fp32";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--ranks") {
      ranks.clear();
      std::stringstream ss(v);
      for (std::string t; std::getline(ss, t, ',');) ranks.push_back(std::stoi(t));
    } else if (k == "--d-model") {
      d_model = std::stoll(v);
    } else if (k == "--layers") {
      layers = std::stoll(v);
    } else if (k == "--steps") {
      steps = std::stoi(v);
    } else if (k == "--pack") {
      pack = v == "1";
    } else if (k == "--replicate") {
      replicate = std::stoi(v);
    } else if (k == "--param-dtype" && (v == "fp32" || v == "bf16")) {
      param_dtype = v;
    } else {
      std::fprintf(stderr, "usage: comm_bytes_bench [--ranks 2,3,4] [--d-model D] [--layers L] [--steps S] [--pack 0|1] "
                           "[--replicate R] [--param-dtype fp32|bf16]\n");
      return 2;
    }
  }
  std::printf("# comm_bytes_bench: GPT d=%ld layers=%ld, %d steps, pack_small_params=%d, R=%d, param_dtype %s; bytes "
              "per rank per step\n",
              static_cast<long>(d_model), static_cast<long>(layers), steps, pack ? 1 : 0, replicate,
              param_dtype.c_str());
  std::printf("%-3s %-4s %12s %14s %14s %14s %14s %9s %9s %14s %14s\n", "N", "mode", "P_M", "formula", "plan_mean",
              "measured_mean", "measured_max", "meas/form", "max/form", "repl_plan", "repl_measured");
  for (int n : ranks) {
    for (bool z3 : {false, true}) {
      const auto dir = std::filesystem::temp_directory_path() /
                       ("dmuon-bytes-" + std::to_string(::getpid()) + "-" + std::to_string(n) + (z3 ? "z3" : "z2"));
      std::filesystem::create_directories(dir);
      std::mutex mu;
      std::vector<double> measured(n, 0), rep_measured(n, 0);
      double rep_plan = 0;
      double formula = 0, plan_mean = 0, pm = 0;
      std::vector<std::thread> th;
      std::string failure;
      if (n % replicate != 0) {
        std::fprintf(stderr, "error: --replicate %d does not divide N=%d\n", replicate, n);
        return 2;
      }
      for (int r = 0; r < n; ++r) {
        th.emplace_back([&, r] {
          try {
            auto store = dmuon::make_file_store((dir / "store").string(), n);
            auto pg = dmuon::make_process_group(store, r, n, c10::DeviceType::CPU);
            dmuon::models::MeshSetup ms;
            ms.store = store;
            ms.replicate = replicate;
            auto mesh = dmuon::models::make_training_mesh(pg, ms);
            dmuon::models::DedicatedGptSetup gs;
            gs.config.d_model = d_model;
            gs.config.n_layers = layers;
            gs.z3 = z3;
            gs.pack_small_params = pack;
            gs.param_dtype = param_dtype;  // bf16: bf16 parameters, fp32 masters
            auto model = dmuon::models::make_dedicated_gpt(mesh, gs);
            dmuon::MuonOptions opts;
            opts.first_step_progress_log = false;
            opts.replicate_async = false;  // HSDP: step() drains the publish, so a step's bytes are all in it
            dmuon::Muon opt(model.ptr(), opts);
            double sum = 0, rsum = 0;
            for (int s = 0; s < steps; ++s) {
              const at::Tensor tokens = at::randint(256, {2, 17}, at::kLong);
              mesh->shard().own_counters().reset();
              if (mesh->replicate()) mesh->replicate()->own_counters().reset();
              opt.zero_grad();
              model->loss(tokens).backward();
              opt.step();
              dmuon::wait_all_replicate_broadcasts(*model);
              auto& sc = mesh->shard().own_counters();
              sum += static_cast<double>(sc.bytes(dmuon::CommOp::Broadcast) + sc.bytes(dmuon::CommOp::Reduce));
              if (mesh->replicate()) rsum += static_cast<double>(mesh->replicate()->own_counters().total_bytes());
            }
            const dmuon::ModelCommPlan plan = dmuon::get_comm_plan(*model);
            std::lock_guard<std::mutex> g(mu);
            measured[r] = sum / steps;
            rep_measured[r] = rsum / steps;
            rep_plan = plan.comm.formula_replicate;
            formula = z3 ? plan.comm.formula_z3 : plan.comm.formula_z2;
            plan_mean = z3 ? plan.comm.mean_z3() : plan.comm.mean_z2();
            pm = static_cast<double>(plan.comm.muon_bytes);
          } catch (const std::exception& e) {
            std::lock_guard<std::mutex> g(mu);
            if (failure.empty()) failure = "rank " + std::to_string(r) + ": " + e.what();
          }
        });
      }
      for (auto& t : th) t.join();
      std::filesystem::remove_all(dir);
      if (!failure.empty()) {
        std::fprintf(stderr, "error: %s\n", failure.c_str());
        return 1;
      }
      double mean = 0, mx = 0, rmean = 0;
      for (int q = 0; q < n; ++q) {
        mean += measured[q] / n;
        mx = std::max(mx, measured[q]);
        rmean += rep_measured[q] / n;
      }
      std::printf("%-3d %-4s %12.0f %14.0f %14.0f %14.0f %14.0f %9.4f %9.4f %14.0f %14.0f\n", n, z3 ? "Z3" : "Z2", pm,
                  formula, plan_mean, mean, mx, formula > 0 ? mean / formula : 0, formula > 0 ? mx / formula : 0,
                  rep_plan, rmean);
      std::fflush(stdout);
    }
  }
  std::printf("# HSDP (R > 1): N is the world (R x G); formula and plan are shard-axis figures over G ranks;\n"
              "# repl_* are replicate-axis bytes (stage-2 reduce + post-step publish), plan 2(R-1)/(G*R)*P_M.\n");
  std::printf("# measured = broadcast + reduce payload bytes counted by dmuon::Communicator on each rank (the\n"
              "# reduce payload carries one 4-byte has-gradient flag per matrix); plan = the planner's per-rank\n"
              "# figure; formula = 2(N-1)/N*P_M (Z2) or 3(N-1)/N*P_M (Z3). max/form > 1 is owner imbalance.\n"
              "# param_dtype bf16: P_M counts 2-byte elements; on Gloo (no bf16 arithmetic) the gradient reduce\n"
              "# moves an fp32 copy, so measured/formula is (2+4)/(2+2) = 1.5 (Z2) and (2+2+4)/(2+2+2) = 1.33 (Z3).\n");
  return 0;
}
