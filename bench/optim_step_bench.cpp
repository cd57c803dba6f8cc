// optim_step_bench -- issue 19's optimizer probe: what Muon adds to a training step made of many
// small matrices, on one process.
//
//   optim_step_bench [--blocks 32] [--dim 32] [--batch 4] [--reps 200] [--threads 1] [--device cpu]
//                    [--variants adamw,dmuon-adamw,muon-aten,muon]
//
// The model: `--blocks` residual blocks h <- h + W2 relu(W1 h), each W a --dim x --dim matrix without
// bias, run as dmuon hook boundaries; loss = mean(h^2) on a fixed random batch. One training step =
// zero_grad, forward, backward, optimizer step. Variants, timed interleaved rep by rep (median):
//   adamw        plain LibTorch torch::optim::AdamW on a plain model (the baseline);
//   dmuon-adamw  dmuon's Muon optimizer over the dedicated model with every matrix on AdamW;
//   muon-aten    dmuon Muon, every matrix on Newton-Schulz through one ATen call per GEMM
//                (DMUON_NS_CPU_FUSED=0 around its step);
//   muon         dmuon Muon as configured by default (small matrices on the fused CPU NS kernel).
//   dmuon-adamw-mt / muon-mt   as dmuon-adamw / muon with MuonOptions::fused and foreach on (AdamW by
//                LibTorch's fused kernel, the momentum by _foreach_ ops: the CUDA default);
//   dmuon-adamw-pp / muon-pp   with both off (the per-parameter ops and host loops: the CPU default).
// --device cuda runs every variant on the GPU (each step ends with a device synchronize).
// Prints each variant's ms per step, its ratio to adamw, and the NS share Muon's step profile
// measured. --variants runs a subset (adamw, the baseline of the ratios, always runs): e.g. one
// variant under perf. Issue 19's goal: muon at <= 1.5x adamw for 32 blocks of 32 x 32, batch 4.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/bootstrap.h"
#include "dmuon/dedicate.h"
#include "dmuon/host_sync.h"
#include "dmuon/mesh.h"
#include "dmuon/muon.h"
#include "optim/multi_tensor.h"  // fused_adamw_available

namespace {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t dim) {
    fc1 = register_module("fc1", torch::nn::Linear(torch::nn::LinearOptions(dim, dim).bias(false)));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(dim, dim).bias(false)));
  }
  at::Tensor forward(const at::Tensor& h) { return h + fc2(fc1(h).relu()); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct ProbeImpl : torch::nn::Module {
  ProbeImpl(int64_t blocks_, int64_t dim) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t b = 0; b < blocks_; ++b) blocks->push_back(Block(dim));
  }
  at::Tensor forward(at::Tensor h, bool dedicated) {
    for (auto& m : *blocks) {
      auto block = std::dynamic_pointer_cast<BlockImpl>(m);
      h = dedicated ? dmuon::forward(block, h) : block->forward(h);
    }
    return h;
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Probe);

void copy_params(Probe& from, Probe& to) {
  at::NoGradGuard ng;
  auto src = from->named_parameters(true);
  for (auto& p : to->named_parameters(true)) p.value().copy_(src[p.key()]);
}

struct Variant {
  std::string name;
  std::function<void()> step;
  std::function<dmuon::StepProfile()> profile;  // the last step's (invalid for plain AdamW)
  std::vector<double> ms;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t blocks = 32, dim = 32, batch = 4;
  int reps = 200, threads = 1;
  std::string only = "adamw,dmuon-adamw,muon-aten,muon", device_name = "cpu";
  for (int i = 1; i < argc; ++i) {
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "optim_step_bench: %s needs a value\n", argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    if (!std::strcmp(argv[i], "--blocks")) blocks = std::atoll(next());
    else if (!std::strcmp(argv[i], "--dim")) dim = std::atoll(next());
    else if (!std::strcmp(argv[i], "--batch")) batch = std::atoll(next());
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(next());
    else if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(next());
    else if (!std::strcmp(argv[i], "--variants")) only = next();
    else if (!std::strcmp(argv[i], "--device")) device_name = next();
    else {
      std::fprintf(stderr,
                   "usage: optim_step_bench [--blocks N] [--dim D] [--batch B] [--reps R] [--threads T] "
                   "[--device cpu|cuda] [--variants adamw,dmuon-adamw,muon-aten,muon,dmuon-adamw-mt,muon-mt,"
                   "dmuon-adamw-pp,muon-pp]\n");
      return 2;
    }
  }
  if (blocks < 1 || dim < 1 || batch < 1 || reps < 1 || threads < 1) {
    std::fprintf(stderr, "optim_step_bench: --blocks, --dim, --batch, --reps and --threads must be >= 1\n");
    return 2;
  }
  if (device_name != "cpu" && device_name != "cuda") {
    std::fprintf(stderr, "optim_step_bench: --device must be cpu or cuda, got '%s'\n", device_name.c_str());
    return 2;
  }
  const at::Device device(device_name == "cuda" ? at::kCUDA : at::kCPU);
  if (device.is_cuda() && !at::hasCUDA()) {
    std::fprintf(stderr, "optim_step_bench: --device cuda, but this LibTorch has no CUDA device here\n");
    return 2;
  }
  at::set_num_threads(threads);
  at::manual_seed(0);
  const at::Tensor x = at::randn({batch, dim}).to(device);
  auto done = [device] { if (device.is_cuda()) dmuon::wait_for_device(device); };  // a step's time includes its kernels

  dmuon::Bootstrap boot = dmuon::bootstrap_from_environment(device.type());
  dmuon::MeshOptions mesh_options;
  mesh_options.process_group_policy = "shared";  // one process: the world group serves every axis
  auto mesh = dmuon::Mesh::create(boot.world, mesh_options);

  Probe reference(blocks, dim);
  std::vector<Variant> variants;

  // (1) plain LibTorch AdamW.
  Probe plain(blocks, dim);
  copy_params(reference, plain);
  plain->to(device);
  auto adamw = std::make_shared<torch::optim::AdamW>(
      plain->parameters(), torch::optim::AdamWOptions(1e-3).betas({0.9, 0.999}).weight_decay(0.01).eps(1e-8));
  variants.push_back({"adamw", [&] {
                        adamw->zero_grad();
                        plain->forward(x, false).square().mean().backward();
                        adamw->step();
                        done();
                      },
                      [] { return dmuon::StepProfile{}; }, {}});

  // (2)-(4) dmuon over dedicated copies of the same model.
  struct Dedicated {
    Probe model{nullptr};
    std::shared_ptr<dmuon::Muon> opt;
  };
  auto make = [&](bool muon, std::optional<bool> multi_tensor) {
    Dedicated d{Probe(blocks, dim), nullptr};
    copy_params(reference, d.model);
    d.model->to(device);
    dmuon::dedicate_params(d.model.ptr(), mesh, [muon](const std::string&, const at::Tensor& p) {
      return muon && p.dim() == 2;
    });
    dmuon::replicate(d.model.ptr(), mesh);
    dmuon::MuonOptions o;
    o.ns = dmuon::NewtonSchulz("gram", "auto");
    o.record_step_profile = true;
    o.foreach = multi_tensor;
    // fused where this LibTorch has the kernel (a forced-on fused elsewhere is refused)
    if (multi_tensor && (!*multi_tensor || dmuon::detail::fused_adamw_available(device.type()))) o.fused = multi_tensor;
    d.opt = std::make_shared<dmuon::Muon>(d.model.ptr(), o);
    return d;
  };
  struct Kind {
    const char* name;
    bool muon, aten;                    // Muon on the matrices; the fused CPU NS kernel off
    std::optional<bool> multi_tensor;   // MuonOptions::fused and foreach (unset: the device's default)
  };
  const std::vector<Kind> kinds = {{"dmuon-adamw", false, false, std::nullopt}, {"muon-aten", true, true, std::nullopt},
                                   {"muon", true, false, std::nullopt},        {"dmuon-adamw-mt", false, false, true},
                                   {"muon-mt", true, false, true},             {"dmuon-adamw-pp", false, false, false},
                                   {"muon-pp", true, false, false}};
  auto wanted = [&](const std::string& name) { return ("," + only + ",").find("," + name + ",") != std::string::npos; };
  for (size_t a = 0, b = 0; a <= only.size(); a = b + 1) {
    b = only.find(',', a);
    if (b == std::string::npos) b = only.size();
    const std::string v = only.substr(a, b - a);
    if (v != "adamw" && std::none_of(kinds.begin(), kinds.end(), [&](const Kind& k) { return v == k.name; })) {
      std::fprintf(stderr, "optim_step_bench: unknown variant '%s' in --variants (adamw, dmuon-adamw, muon-aten, muon, "
                           "dmuon-adamw-mt, muon-mt, dmuon-adamw-pp, muon-pp)\n", v.c_str());
      return 2;
    }
  }
  std::vector<Dedicated> dedicated;
  dedicated.reserve(kinds.size());  // the step closures hold pointers into it
  for (const Kind& k : kinds) {
    if (!wanted(k.name)) continue;
    dedicated.push_back(make(k.muon, k.multi_tensor));
    Dedicated* d = &dedicated.back();
    const bool aten = k.aten;  // the fused CPU kernel off for this variant (read per NS call)
    variants.push_back({k.name, [d, &x, aten, &done] {
                          d->opt->zero_grad();
                          d->model->forward(x, true).square().mean().backward();
                          if (aten) setenv("DMUON_NS_CPU_FUSED", "0", 1);
                          d->opt->step();
                          if (aten) unsetenv("DMUON_NS_CPU_FUSED");
                          done();
                        },
                        [d] { return d->opt->consume_last_step_profile(); }, {}});
  }

  std::vector<std::vector<dmuon::StepProfile>> prof(variants.size());
  for (auto& v : variants)
    for (int w = 0; w < 5; ++w) v.step();  // warm-up: allocator, first-step work
  for (int r = 0; r < reps; ++r) {
    for (size_t k = 0; k < variants.size(); ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      variants[k].step();
      variants[k].ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      prof[k].push_back(variants[k].profile());
    }
  }
  const double base = median(variants[0].ms);
  std::printf("# optim_step_bench: %lld blocks x 2 matrices %lldx%lld, batch %lld, %s, %d threads, %d reps (median, "
              "interleaved); NS kernel \"auto\" runs %s here\n",
              static_cast<long long>(blocks), static_cast<long long>(dim), static_cast<long long>(dim),
              static_cast<long long>(batch), device_name.c_str(), threads, reps,
              dmuon::NewtonSchulz().describe(device.type()).c_str());
  std::printf("%-15s %9s %9s %9s %9s %9s %9s\n", "variant", "step_ms", "vs_adamw", "opt_ms", "muon_ms", "ns_ms",
              "adamw_ms");
  for (size_t k = 0; k < variants.size(); ++k) {
    const double step = median(variants[k].ms);
    std::printf("%-15s %9.3f %9.3f", variants[k].name.c_str(), step, step / base);
    if (!prof[k].empty() && prof[k][0].valid) {
      auto field = [&](double dmuon::StepProfile::*f) {
        std::vector<double> v;
        for (const auto& p : prof[k]) v.push_back(p.*f);
        return median(v);
      };
      std::printf(" %9.3f %9.3f %9.3f %9.3f\n", field(&dmuon::StepProfile::total_ms),
                  field(&dmuon::StepProfile::muon_ms), field(&dmuon::StepProfile::ns_ms),
                  field(&dmuon::StepProfile::adamw_ms));
    } else {
      std::printf(" %9s %9s %9s %9s\n", "-", "-", "-", "-");
    }
  }
  std::printf("# opt_ms: Muon::step's own time (StepProfile total); muon_ms: momentum + NS + update of the "
              "matrices; step_ms - opt_ms: zero_grad, forward and backward with dmuon's boundaries\n");
  return 0;
}
