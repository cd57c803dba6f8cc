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
#include "dmuon/dedicate.h"
#include "dmuon/diagnostics.h"
#include "dmuon/muon.h"
#include "model/gpt.h"

int main(int argc, char** argv) {
  std::vector<int> ranks = {2, 3, 4};
  int64_t d_model = 256, layers = 4;
  int steps = 3;
  bool pack = false;
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
    } else {
      std::fprintf(stderr, "usage: comm_bytes_bench [--ranks 2,3,4] [--d-model D] [--layers L] [--steps S] [--pack 0|1]\n");
      return 2;
    }
  }
  std::printf("# comm_bytes_bench: GPT d=%ld layers=%ld, %d steps, pack_small_params=%d; bytes per rank per step\n",
              static_cast<long>(d_model), static_cast<long>(layers), steps, pack ? 1 : 0);
  std::printf("%-3s %-4s %12s %14s %14s %14s %14s %9s %9s\n", "N", "mode", "P_M", "formula", "plan_mean",
              "measured_mean", "measured_max", "meas/form", "max/form");
  for (int n : ranks) {
    for (bool z3 : {false, true}) {
      const auto dir = std::filesystem::temp_directory_path() /
                       ("dmuon-bytes-" + std::to_string(::getpid()) + "-" + std::to_string(n) + (z3 ? "z3" : "z2"));
      std::filesystem::create_directories(dir);
      std::mutex mu;
      std::vector<double> measured(n, 0);
      double formula = 0, plan_mean = 0, pm = 0;
      std::vector<std::thread> th;
      std::string failure;
      for (int r = 0; r < n; ++r) {
        th.emplace_back([&, r] {
          try {
            auto store = dmuon::make_file_store((dir / "store").string(), n);
            auto pg = dmuon::make_process_group(store, r, n, c10::DeviceType::CPU);
            dmuon::MeshOptions mo;
            mo.store = store;
            mo.factory = dmuon::process_group_factory(c10::DeviceType::CPU);
            auto mesh = dmuon::Mesh::create(pg, mo);
            dmuon::models::GPTConfig cfg;
            cfg.d_model = d_model;
            cfg.n_layers = layers;
            dmuon::models::GPT model(cfg);
            dmuon::DedicateOptions o;
            o.reshard_after_forward = z3;
            o.pack_small_params = pack;
            dmuon::dedicate_params(model.ptr(), mesh, dmuon::models::is_muon_matrix, o);
            dmuon::replicate(model.ptr(), mesh);
            dmuon::MuonOptions opts;
            opts.first_step_progress_log = false;
            dmuon::Muon opt(model.ptr(), opts);
            double sum = 0;
            for (int s = 0; s < steps; ++s) {
              const at::Tensor tokens = at::randint(256, {2, 17}, at::kLong);
              mesh->counters().reset();
              opt.zero_grad();
              model->loss(tokens).backward();
              opt.step();
              sum += static_cast<double>(mesh->counters().bytes(dmuon::CommOp::Broadcast) +
                                         mesh->counters().bytes(dmuon::CommOp::Reduce));
            }
            const auto plan = dmuon::summarize_comm_plan(*model);
            std::lock_guard<std::mutex> g(mu);
            measured[r] = sum / steps;
            const auto& pr = plan["per_rank_bytes"];
            formula = z3 ? pr["formula_z3"].get<double>() : pr["formula_z2"].get<double>();
            plan_mean = z3 ? pr["mean_z3"].get<double>() : pr["mean_z2"].get<double>();
            pm = plan["muon_bytes"].get<double>();
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
      double mean = 0, mx = 0;
      for (double m : measured) {
        mean += m / n;
        mx = std::max(mx, m);
      }
      std::printf("%-3d %-4s %12.0f %14.0f %14.0f %14.0f %14.0f %9.4f %9.4f\n", n, z3 ? "Z3" : "Z2", pm, formula,
                  plan_mean, mean, mx, formula > 0 ? mean / formula : 0, formula > 0 ? mx / formula : 0);
      std::fflush(stdout);
    }
  }
  std::printf("# measured = broadcast + reduce payload bytes counted by dmuon::Communicator on each rank (the\n"
              "# reduce payload carries one 4-byte has-gradient flag per matrix); plan = the planner's per-rank\n"
              "# figure; formula = 2(N-1)/N*P_M (Z2) or 3(N-1)/N*P_M (Z3). max/form > 1 is owner imbalance.\n");
  return 0;
}
