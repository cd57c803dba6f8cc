// ns_calibration.cpp -- measured NS times per shape, matmul rate and memory bandwidth (ns_calibration.h).
#include "dmuon/tools/ns_calibration.h"

#include "dmuon/host_sync.h"
#include "dmuon/ns_graphs.h"
#include "dmuon/ns_runner.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <limits>
#include <stdexcept>


namespace dmuon {
namespace {

void sync(const at::Device& d) { dmuon::wait_for_device(d); }

// Median wall time of `fn` over `reps` calls after one warm-up call; a call slower than `slow_s`
// is timed once (its warm-up run is the measurement).
double median_s(const std::function<void()>& fn, int reps, const at::Device& dev, double slow_s = 1e30) {
  auto once = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    sync(dev);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const double first = once();
  if (first > slow_s) return first;
  std::vector<double> t;
  for (int i = 0; i < std::max(1, reps); ++i) t.push_back(once());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

at::ScalarType dtype_of(int64_t elem_bytes) {
  switch (elem_bytes) {
    case 2: return at::kBFloat16;
    case 4: return at::kFloat;
    case 8: return at::kDouble;
    default:
      throw std::invalid_argument("measure_ns_profile: elem_bytes " + std::to_string(elem_bytes) +
                                  " is not a parameter dtype (2 = bf16, 4 = fp32, 8 = fp64)");
  }
}

}  // namespace

NsProfile measure_ns_profile(const std::vector<NsShape>& shapes, const NsCalibrationOptions& o) {
  if (o.batch < 2) throw std::invalid_argument("measure_ns_profile: batch must be >= 2, got " + std::to_string(o.batch));
  // the NS Muon::step runs: finite check off (Muon checks all gradients in one read), CUDA graphs on CUDA
  NewtonSchulz ns(o.backend);
  ns.set_check_finite(false);
  NsGraphs graphs(ns);
  auto run = [&](const at::Tensor& x) { return graphs.run(x, o.ns_steps); };
  NsProfile p;
  p.device = o.device.str();
  p.ns_steps = o.ns_steps;
  char src[256];
  std::snprintf(src, sizeof src, "measured: measure_ns_profile on %s, %s, batch %d, median of %d", p.device.c_str(),
                ns.describe(o.device.type()).c_str(), o.batch, o.reps);
  p.source = src;
  at::manual_seed(0);
  for (const NsShape& s : shapes) {
    if (s.rows < 1 || s.cols < 1)
      throw std::invalid_argument("measure_ns_profile: shape " + std::to_string(s.rows) + "x" + std::to_string(s.cols) +
                                  " has an empty side");
    const int64_t m = std::min(s.rows, s.cols), n = std::max(s.rows, s.cols);
    const bool seen = std::any_of(p.timings.begin(), p.timings.end(), [&](const NsTiming& t) {
      return t.rows == m && t.cols == n && t.elem_bytes == s.elem_bytes;
    });
    if (seen) continue;
    const auto opts = at::TensorOptions().dtype(dtype_of(s.elem_bytes)).device(o.device);
    NsTiming t;
    t.rows = m, t.cols = n, t.elem_bytes = s.elem_bytes;
    const at::Tensor one = at::randn({m, n}, opts);
    at::Tensor sink;
    t.single_us = 1e6 * median_s([&] { sink = run(one); }, o.reps, o.device, o.max_shape_s);
    // batched only where Muon::step would stack this shape; elsewhere k matrices cost k single calls
    if (ns_stacking_pays(o.device.type(), m) && t.single_us * o.batch < 1e6 * o.max_shape_s) {
      std::vector<at::Tensor> many;
      for (int i = 0; i < o.batch; ++i) many.push_back(at::randn({m, n}, opts));
      t.batch = o.batch;
      t.batch_us = 1e6 * median_s(
                       [&] {  // through Muon::step's batched runner: stacked, one call, results unstacked
                         std::vector<NsJob> jobs(many.size());
                         for (size_t i = 0; i < many.size(); ++i) {
                           jobs[i].like = many[i];
                           jobs[i].steps = o.ns_steps;
                           jobs[i].apply = [&sink](const at::Tensor& r) { sink = r; };
                         }
                         NsBatchOptions bo;
                         bo.cap_bytes = std::numeric_limits<int64_t>::max();  // the whole batch in one call
                         bo.cap_to_quarter = false;
                         run_ns_batched(jobs, [&](const at::Tensor& x, int) { return run(x); }, bo);
                       },
                       o.reps, o.device);
    }
    p.timings.push_back(t);
  }
  return p;
}

DeviceRates measure_device_rates(const at::Device& device, int reps) {
  DeviceRates r;
  const int64_t n = device.is_cuda() ? 8192 : 1024;
  const auto dt = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  const auto o = at::TensorOptions().dtype(dt).device(device);
  const at::Tensor a = at::randn({n, n}, o), b = at::randn({n, n}, o);
  at::Tensor c;
  const double s = median_s([&] { c = at::mm(a, b); }, reps, device);
  r.matmul_tflops = 2.0 * static_cast<double>(n) * n * n / s / 1e12;
  const int64_t e = (int64_t{64} << 20) / 4;
  const at::Tensor x = at::randn({e}, o.dtype(at::kFloat)), y = at::randn({e}, o.dtype(at::kFloat));
  at::Tensor z = at::empty({e}, o.dtype(at::kFloat));
  const double sm = median_s([&] { at::add_out(z, x, y); }, reps, device);
  r.memory_bandwidth_GBps = 3.0 * static_cast<double>(e) * 4 / sm / 1e9;
  char buf[200];
  std::snprintf(buf, sizeof buf, "%s %lldx%lld GEMM %.3f TFLOP/s, fp32 add over 3 x 64 MiB %.1f GB/s",
                dt == at::kFloat ? "fp32" : "bf16", static_cast<long long>(n), static_cast<long long>(n),
                r.matmul_tflops, r.memory_bandwidth_GBps);
  r.describe = buf;
  return r;
}

}  // namespace dmuon
