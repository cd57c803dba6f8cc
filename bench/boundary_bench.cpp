// boundary_bench -- what dmuon's C++ boundary path (dmuon::forward) costs per boundary, on one process:
// the C++ figure bench/python_hooks_bench.py prints next to the Python hooks' (it runs this program).
//
//   boundary_bench [--blocks 32] [--dim 16] [--iters 200] [--rounds 3]
//
// The model is python_hooks_bench.py's: `--blocks` blocks x <- tanh(Linear(x)) (weight and bias), a batch
// of 4 rows, loss = sum. Two variants, timed interleaved round by round (forward + backward, median of
// --iters per round, the best round): plain LibTorch, and dedicate_params (Z3) + replicate with every
// block run through dmuon::forward. One rank: no collective runs, so the difference is dmuon's own
// per-boundary work (scopes, identity autograd functions, gradient hooks, the schedule). Prints both
// and the difference per boundary in microseconds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dmuon/bootstrap.h"
#include "dmuon/dedicate.h"
#include "dmuon/mesh.h"

namespace {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t dim) { proj = register_module("proj", torch::nn::Linear(dim, dim)); }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(proj(x)); }
  torch::nn::Linear proj{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t blocks, int64_t dim) {
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t b = 0; b < blocks; ++b) layers->push_back(Block(dim));
  }
  at::Tensor forward(at::Tensor x, bool dedicated) {
    for (auto& m : *layers) {
      auto block = std::dynamic_pointer_cast<BlockImpl>(m);
      x = dedicated ? dmuon::forward(block, x) : block->forward(x);
    }
    return x;
  }
  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(Net);

double median_ms(Net& net, bool dedicated, const at::Tensor& x, int iters) {
  std::vector<double> ms;
  for (int i = 0; i < iters + 20; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    net->forward(x, dedicated).sum().backward();
    if (i >= 20)  // warm-up
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t blocks = 32, dim = 16;
  int iters = 200, rounds = 3;
  for (int i = 1; i < argc; ++i) {
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "boundary_bench: %s needs a value\n", argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    if (!std::strcmp(argv[i], "--blocks")) blocks = std::atoll(next());
    else if (!std::strcmp(argv[i], "--dim")) dim = std::atoll(next());
    else if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(next());
    else if (!std::strcmp(argv[i], "--rounds")) rounds = std::atoi(next());
    else {
      std::fprintf(stderr, "usage: boundary_bench [--blocks N] [--dim D] [--iters I] [--rounds R]\n");
      return 2;
    }
  }
  if (blocks < 1 || dim < 1 || iters < 1 || rounds < 1) {
    std::fprintf(stderr, "boundary_bench: --blocks, --dim, --iters and --rounds must be >= 1\n");
    return 2;
  }
  at::set_num_threads(1);
  at::manual_seed(0);
  const at::Tensor x = at::randn({4, dim});
  dmuon::Bootstrap boot = dmuon::bootstrap_from_environment(c10::DeviceType::CPU);
  dmuon::MeshOptions mesh_options;
  mesh_options.process_group_policy = "shared";  // one process: the world group serves every axis
  auto mesh = dmuon::Mesh::create(boot.world, mesh_options);

  Net plain(blocks, dim), ded(blocks, dim);
  dmuon::dedicate_params(ded.ptr(), mesh, [](const std::string&, const at::Tensor& p) { return p.dim() == 2; });
  dmuon::replicate(ded.ptr(), mesh);
  double best_plain = 1e30, best_dmuon = 1e30;
  for (int r = 0; r < rounds; ++r) {  // interleaved: the machine's noise hits both alike
    best_plain = std::min(best_plain, median_ms(plain, false, x, iters));
    best_dmuon = std::min(best_dmuon, median_ms(ded, true, x, iters));
  }
  std::printf("# boundary_bench: %lld boundaries, dim %lld, forward+backward median (best of %d rounds)\n",
              static_cast<long long>(blocks), static_cast<long long>(dim), rounds);
  std::printf("plain_ms %.4f\ndmuon_ms %.4f\nper_boundary_us %.2f\n", best_plain, best_dmuon,
              (best_dmuon - best_plain) * 1e3 / static_cast<double>(blocks));
  return 0;
}
