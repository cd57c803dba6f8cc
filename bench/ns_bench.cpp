// ns_bench: direct vs Gram Newton-Schulz, per shape, in one run.
//
// Prints, per shape: the median time of direct and Gram NS (5 steps, Polar Express x1.05, Gram
// restarts {2}), their ratio, the effective GFLOP/s of each (plain-GEMM FLOP counts of
// NEWTON_SCHULZ.md §5) next to ATen's own matmul rate measured in the same run on the same shape
// (X X^T), and the accuracy of both against a float64 reference.
//
//   usage: ns_bench [--reps N] [--dtype f32|bf16|f16] [--device cpu|cuda] [--shapes 512x512,...]
//          ns_bench --batched [--reps N] [--device cpu|cuda]
//          ns_bench --fused [--reps N]      (CPU: the fused small-matrix kernel vs ATen calls)
//          ns_bench --kernels [--reps N] [--dtype f16|bf16|f32] [--device cpu|cuda] [--shapes ...]
//
// --kernels: the "syrk" kernel against the plain GEMMs ("cublas"), per shape in the compute dtype:
// the Gram product X X^T alone (cuBLAS / BLAS SYRK for 2-D fp32/fp64, the block triangle for
// 16-bit, kernels.h) and whole Gram NS, their ratios, the relative difference of the NS results,
// and what "auto" resolves to for the shape (on CUDA: measured once per shape).
//
// --batched: the optimizer's two ways of running many matrices, per case: one NS call per matrix
// vs one stacked call per oriented shape (as Muon::step does; stacking and unstacking timed), their
// ratio, and the largest difference of the results. Cases: (a) 64 matrices of 32x32, (b) 64 MoE
// experts of [1408, 2048] scaled by 1/4 to [352, 512], (c) a mixed model (8 blocks of 4 x [256, 256],
// 2 x [688, 256] and 1 x [256, 688]).
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "dmuon/host_sync.h"
#include "dmuon/newton_schulz.h"
#include "dmuon/ns_graphs.h"
#include "ns/fused_cpu.h"  // internal: which copy of the fused CPU kernel runs
#include "ns/kernels.h"    // internal: the Gram products of --kernels


namespace {

struct Shape {
  int64_t m, n;
};

void sync(const at::Device& d) { dmuon::wait_for_device(d); }

double median_seconds(const std::function<void()>& fn, int reps, const at::Device& dev) {
  fn();  // warm-up
  sync(dev);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    sync(dev);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor A = a.to(at::kDouble).cpu(), B = b.to(at::kDouble).cpu();
  return (A - B).norm().item<double>() / B.norm().item<double>();
}

std::vector<Shape> parse_shapes(const std::string& s) {
  std::vector<Shape> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    size_t x = item.find('x');
    if (x == std::string::npos) {
      std::fprintf(stderr, "error: bad shape '%s' (expected MxN)\n", item.c_str());
      std::exit(2);
    }
    out.push_back({std::stoll(item.substr(0, x)), std::stoll(item.substr(x + 1))});
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// One NS call per matrix vs one stacked call per oriented shape (Muon::step's batching).
int run_batched(int reps, const at::Device& dev) {
  struct Case {
    const char* name;
    std::vector<Shape> shapes;
  };
  auto repeat = [](std::vector<Shape> unit, int times) {
    std::vector<Shape> out;
    for (int i = 0; i < times; ++i) out.insert(out.end(), unit.begin(), unit.end());
    return out;
  };
  const std::vector<Case> cases = {
      {"(a) 64 x 32x32", repeat({{32, 32}}, 64)},
      {"(a2) 64 x 64x64", repeat({{64, 64}}, 64)},
      {"(a3) 64 x 128x128", repeat({{128, 128}}, 64)},
      {"(a4) 64 x 64x256", repeat({{64, 256}}, 64)},
      {"(b) 64 experts 352x512", repeat({{352, 512}}, 64)},
      {"(c) mixed 8 blocks", repeat({{256, 256}, {256, 256}, {256, 256}, {256, 256}, {688, 256}, {688, 256}, {256, 688}}, 8)},
  };
  const dmuon::NewtonSchulz ns("gram");
  std::printf("# ns_bench --batched: %s, device %s, fp32, %d reps (median)\n", ns.describe(dev.type()).c_str(),
              dev.is_cuda() ? "cuda" : "cpu", reps);
  std::printf("%-24s %8s %12s %12s %9s %10s\n", "case", "matrices", "per_matrix_ms", "batched_ms", "per/bat", "max_diff");
  at::manual_seed(0);
  for (const Case& c : cases) {
    std::vector<at::Tensor> us;
    for (const Shape& s : c.shapes) us.push_back(at::randn({s.m, s.n}, at::TensorOptions().device(dev)));
    std::vector<at::Tensor> per(us.size()), bat(us.size());
    const double t_per = median_seconds(
        [&] {
          for (size_t i = 0; i < us.size(); ++i) per[i] = ns.local(us[i]);
        },
        reps, dev);
    const double t_bat = median_seconds(
        [&] {
          std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<size_t>>> groups;
          for (size_t i = 0; i < us.size(); ++i) {
            const std::pair<int64_t, int64_t> k{std::min(us[i].size(0), us[i].size(1)), std::max(us[i].size(0), us[i].size(1))};
            auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == k; });
            if (it == groups.end()) groups.push_back({k, {i}});
            else it->second.push_back(i);
          }
          for (const auto& [k, idx] : groups) {
            std::vector<at::Tensor> stack;
            for (size_t i : idx) stack.push_back(us[i].size(0) > us[i].size(1) ? us[i].t() : us[i]);
            const at::Tensor out = ns.local(at::stack(stack));
            for (size_t j = 0; j < idx.size(); ++j) {
              const at::Tensor r = out.select(0, static_cast<int64_t>(j));
              bat[idx[j]] = us[idx[j]].size(0) > us[idx[j]].size(1) ? r.t() : r;
            }
          }
        },
        reps, dev);
    double diff = 0;
    for (size_t i = 0; i < us.size(); ++i) diff = std::max(diff, (per[i] - bat[i]).abs().max().item<double>());
    std::printf("%-24s %8zu %12.2f %12.2f %9.3f %10.2e\n", c.name, us.size(), t_per * 1e3, t_bat * 1e3, t_per / t_bat,
                diff);
    std::fflush(stdout);
  }
  std::printf("# per/bat > 1: the stacked call is faster. max_diff: largest |per-matrix - batched| entry.\n");
  return 0;
}

// --fused (CPU): the fused small-matrix NS kernel (NsOptions::cpu_fused, the default) against one
// ATen call per GEMM (cpu_fused = false), per shape and batch, interleaved rep by rep: microseconds
// per matrix, the ratio, and the relative difference of the results (rounding only).
int run_fused(int reps) {
  std::printf("# ns_bench --fused: Gram NS (direct for square), fp32, CPU, fused kernel copy '%s', %d reps "
              "(median), check_finite off as in Muon::step\n",
              dmuon::detail::fused_cpu::isa(), reps);
  std::printf("%-16s %6s %12s %12s %9s %10s\n", "shape", "batch", "aten_us/mat", "fused_us/mat", "aten/fused",
              "rel_diff");
  struct Case {
    int64_t batch, m, n;
  };
  dmuon::NsOptions fused, aten;
  fused.check_finite = aten.check_finite = false;
  aten.cpu_fused = false;
  at::manual_seed(0);
  for (const Case c : {Case{1, 16, 16}, Case{1, 32, 32}, Case{64, 32, 32}, Case{1, 8, 512}, Case{64, 8, 512},
                       Case{1, 48, 128}, Case{32, 48, 128}, Case{1, 64, 64}, Case{16, 64, 256}, Case{1, 64, 1024}}) {
    const at::Tensor G = c.batch == 1 ? at::randn({c.m, c.n}) : at::randn({c.batch, c.m, c.n});
    at::Tensor a = dmuon::gram_newton_schulz(G, aten), f = dmuon::gram_newton_schulz(G, fused);  // warm-up
    std::vector<double> ta, tf;
    for (int r = 0; r < reps; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      a = dmuon::gram_newton_schulz(G, aten);
      auto t1 = std::chrono::steady_clock::now();
      f = dmuon::gram_newton_schulz(G, fused);
      auto t2 = std::chrono::steady_clock::now();
      ta.push_back(std::chrono::duration<double>(t1 - t0).count());
      tf.push_back(std::chrono::duration<double>(t2 - t1).count());
    }
    std::sort(ta.begin(), ta.end());
    std::sort(tf.begin(), tf.end());
    const double ma = ta[ta.size() / 2] / c.batch * 1e6, mf = tf[tf.size() / 2] / c.batch * 1e6;
    std::printf("%-16s %6lld %12.1f %12.1f %9.2f %10.2e\n", (std::to_string(c.m) + "x" + std::to_string(c.n)).c_str(),
                static_cast<long long>(c.batch), ma, mf, ma / mf, rel(f, a));
    std::fflush(stdout);
  }
  std::printf("# aten/fused > 1: the fused kernel is faster. rel_diff: |fused - aten|_F / |aten|_F.\n");
  return 0;
}

// --graphs (CUDA): host microseconds per NS call, eager vs replayed from a CUDA graph (ns_graphs.h),
// per (shape, batch): the time to issue `reps` calls without waiting, then the device time per call.
int run_graphs(int reps, const at::Device& dev) {
  if (!dev.is_cuda() || !dmuon::NsGraphs::supported()) {
    std::printf("# ns_bench --graphs: CUDA graphs need a CUDA build and --device cuda; nothing to measure here\n");
    return 0;
  }
  dmuon::NewtonSchulz ns("gram");
  ns.set_check_finite(false);
  dmuon::NsGraphs graphs(ns);
  std::printf("# ns_bench --graphs: %s, fp32 input, %d calls per case\n", ns.describe(dev.type()).c_str(), reps);
  std::printf("%-16s %8s %14s %14s %9s %14s %14s\n", "shape", "batch", "eager_host_us", "graph_host_us", "host e/g",
              "eager_dev_us", "graph_dev_us");
  struct Case {
    int64_t batch, m, n;
  };
  for (const Case c : {Case{1, 32, 32}, Case{64, 32, 32}, Case{1, 1024, 4096}, Case{8, 1408, 2048}, Case{64, 128, 512}}) {
    const at::Tensor G = c.batch == 1 ? at::randn({c.m, c.n}, at::TensorOptions().device(dev))
                                      : at::randn({c.batch, c.m, c.n}, at::TensorOptions().device(dev));
    auto issue = [&](const std::function<void()>& fn) {
      fn();
      sync(dev);
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i) fn();
      const double host = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      sync(dev);
      const double all = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return std::pair<double, double>{host / reps * 1e6, all / reps * 1e6};
    };
    at::Tensor out;
    const auto [eh, ed] = issue([&] { out = ns.local(G); });
    const auto [gh, gd] = issue([&] { out = graphs.run(G); });
    std::printf("%-16s %8lld %14.1f %14.1f %9.2f %14.1f %14.1f\n",
                (std::to_string(c.m) + "x" + std::to_string(c.n)).c_str(), static_cast<long long>(c.batch), eh, gh,
                eh / gh, ed, gd);
    std::fflush(stdout);
  }
  std::printf("# host e/g > 1: the graph issues the call faster; dev_us: issue + run, per call.\n");
  return 0;
}

}  // namespace

int run_kernels(int reps, const at::Device& dev, at::ScalarType dt, const std::vector<Shape>& shapes) {
  namespace k = dmuon::detail::kernels;
  std::printf("# ns_bench --kernels: \"syrk\" vs plain GEMMs, device %s, compute dtype %s, %d reps (median)\n",
              dev.str().c_str(), c10::toString(dt), reps);
  std::printf("%-12s %6s %10s %10s %7s %10s %10s %7s %9s %7s\n", "shape", "depth", "mm_ms", "syrk_ms", "mm/syrk",
              "ns_mm_ms", "ns_syrk_ms", "ratio", "ns_diff", "auto");
  at::manual_seed(0);
  for (const auto& s : shapes) {
    const int64_t m = std::min(s.m, s.n), n = std::max(s.m, s.n);
    const at::Tensor X = at::randn({m, n}, at::TensorOptions().dtype(at::kFloat).device(dev)).div(std::sqrt(n)).to(dt);
    const double t_mm = median_seconds([&] { k::gram(X, "cublas"); }, reps, dev);
    const double t_sy = median_seconds([&] { k::gram(X, "syrk"); }, reps, dev);
    dmuon::NsOptions plain, syrk;
    plain.kernel = "cublas";
    syrk.kernel = "syrk";
    plain.compute_dtype = syrk.compute_dtype = dt;
    const at::Tensor G = at::randn({s.m, s.n}, at::TensorOptions().dtype(at::kFloat).device(dev));
    at::Tensor a, b;
    const double n_mm = median_seconds([&] { a = dmuon::gram_newton_schulz(G, plain); }, reps, dev);
    const double n_sy = median_seconds([&] { b = dmuon::gram_newton_schulz(G, syrk); }, reps, dev);
    std::printf("%-12s %6d %10.3f %10.3f %7.3f %10.3f %10.3f %7.3f %9.2e %7s\n",
                (std::to_string(s.m) + "x" + std::to_string(s.n)).c_str(), k::block_triangle_depth(m), t_mm * 1e3,
                t_sy * 1e3, t_mm / t_sy, n_mm * 1e3, n_sy * 1e3, n_mm / n_sy, rel(b, a), k::resolve_kernel("auto", X).c_str());
    std::fflush(stdout);
  }
  std::printf("# mm/syrk, ratio > 1: the symmetric product is faster (Gram product alone; whole Gram NS). depth: the\n"
              "# block triangle's (0: none; 16-bit inputs then take the plain GEMMs). auto: what \"auto\" runs here.\n");
  return 0;
}

int main(int argc, char** argv) {
  int reps = 5;
  std::string dtype = "f32", device = "cpu";
  std::vector<Shape> shapes = {{512, 512}, {512, 2048}, {1024, 4096}, {2048, 2048}, {4096, 1024}};
  bool batched = false, graphs = false, fused = false, kernels = false;
  for (int i = 1; i < argc; ++i) {
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "error: %s needs a value\n", argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    if (!std::strcmp(argv[i], "--reps")) reps = std::stoi(next());
    else if (!std::strcmp(argv[i], "--dtype")) dtype = next();
    else if (!std::strcmp(argv[i], "--device")) device = next();
    else if (!std::strcmp(argv[i], "--shapes")) shapes = parse_shapes(next());
    else if (!std::strcmp(argv[i], "--batched")) batched = true;
    else if (!std::strcmp(argv[i], "--graphs")) graphs = true;
    else if (!std::strcmp(argv[i], "--fused")) fused = true;
    else if (!std::strcmp(argv[i], "--kernels")) kernels = true;
    else {
      std::fprintf(stderr, "usage: ns_bench [--reps N] [--dtype f32|bf16|f16] [--device cpu|cuda] [--shapes MxN,...]\n"
                           "       ns_bench --batched [--reps N] [--device cpu|cuda]\n"
                           "       ns_bench --graphs [--reps N] --device cuda\n"
                           "       ns_bench --kernels [--reps N] [--dtype f32|bf16|f16] [--device cpu|cuda] [--shapes MxN,...]\n");
      return 2;
    }
  }
  if (fused) return run_fused(reps);
  if (batched) return run_batched(reps, at::Device(device == "cuda" ? at::kCUDA : at::kCPU));
  if (graphs) return run_graphs(reps, at::Device(device == "cuda" ? at::kCUDA : at::kCPU));
  const at::ScalarType dt = dtype == "bf16" ? at::kBFloat16 : dtype == "f16" ? at::kHalf : at::kFloat;
  const at::Device dev(device == "cuda" ? at::kCUDA : at::kCPU);
  if (kernels) return run_kernels(reps, dev, dt, shapes);
  std::printf("# ns_bench: %s, device %s, input %s, %d reps (median), PE x1.05 coefficients, Gram restarts {2}\n",
              dmuon::get_ns_backend().c_str(), device.c_str(), dtype.c_str(), reps);
  std::printf("%-11s %10s %10s %7s %7s %9s %9s %9s %8s %8s %9s %9s\n", "shape", "direct_ms", "gram_ms", "g/d", "theory",
              "mm_GF/s", "dir_GF/s", "gram_GF/s", "dir/mm", "gram/mm", "err_dir", "err_gram");
  at::manual_seed(0);
  double total_d = 0, total_g = 0;
  for (const auto& s : shapes) {
    const double m = std::min(s.m, s.n), n = std::max(s.m, s.n);
    at::Tensor G = at::randn({s.m, s.n}, at::TensorOptions().dtype(at::kFloat).device(dev)).to(dt);
    // matmul rate on the shape's own Gram product, in the NS compute dtype
    // default compute dtypes: fp32 on CPU; on CUDA bf16 (direct) / fp16 (Gram) -- rate taken in bf16
    const at::ScalarType cdt = dev.is_cuda() ? at::kBFloat16 : at::kFloat;
    at::Tensor X = (s.m > s.n ? G.t() : G).to(cdt).contiguous();
    const double t_mm = median_seconds([&] { at::mm(X, X.t()); }, reps, dev);
    const double mm_rate = 2.0 * m * m * n / t_mm / 1e9;

    at::Tensor out_d, out_g;
    dmuon::NsOptions forced;
    forced.force_gram = true;
    const double t_d = median_seconds([&] { out_d = dmuon::direct_newton_schulz(G); }, reps, dev);
    const double t_g = median_seconds([&] { out_g = dmuon::gram_newton_schulz(G, forced); }, reps, dev);
    const double flops_d = 20 * m * m * n + 10 * m * m * m;  // plain GEMMs, T = 5
    const double flops_g = 8 * m * m * n + 28 * m * m * m;   // Gram, restart {2}, T = 5
    // the float64 reference on the same device (no CPU float64 NS on a GPU machine)
    const at::Tensor ref = dmuon::direct_newton_schulz(G.to(at::kDouble));
    std::printf("%-11s %10.2f %10.2f %7.3f %7.3f %9.1f %9.1f %9.1f %8.2f %8.2f %9.2e %9.2e\n",
                (std::to_string(s.m) + "x" + std::to_string(s.n)).c_str(), t_d * 1e3, t_g * 1e3, t_g / t_d,
                flops_g / flops_d, mm_rate, flops_d / t_d / 1e9, flops_g / t_g / 1e9, flops_d / t_d / 1e9 / mm_rate,
                flops_g / t_g / 1e9 / mm_rate, rel(out_d, ref), rel(out_g, ref));
    std::fflush(stdout);
    total_d += t_d;
    total_g += t_g;
  }
  std::printf("%-11s %10.2f %10.2f %7.3f   (all shapes above, e.g. one transformer layer's matrices)\n", "total",
              total_d * 1e3, total_g * 1e3, total_g / total_d);
  std::printf("# g/d: Gram time / direct time (square shapes: the library dispatches Gram to direct; the row\n"
              "# times the Gram algorithm itself). theory: plain-GEMM FLOP ratio. dir/mm, gram/mm: effective\n"
              "# NS rate over the matmul rate measured above. err_*: relative Frobenius error vs float64 direct NS.\n");
  return 0;
}
