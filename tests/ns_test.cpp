// Newton-Schulz kernels against a float64 SVD reference U f(S) V^T (shared/docs/NEWTON_SCHULZ.md §8).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/compat.h"
#include "dmuon/communicator.h"  // the column-sharded Gram NS over a process group
#include "dmuon/newton_schulz.h"
#include "dmuon/ns_runner.h"
#include "dmuon/tools/ns_calibration.h"
#include "dmuon/ns_graphs.h"
#include "ns/fused_cpu.h"  // internal: the fused CPU kernel
#include "ns/kernels.h"    // internal: the block-triangle Gram product
#include "support/multirank.h"

namespace dmuon {
namespace {

// ---- float64 reference -----------------------------------------------------------------------
at::Tensor reference_ns(const at::Tensor& G, const Coefficients& coeffs, double eps = kDefaultNsEps) {
  at::Tensor g = G.to(at::kDouble);
  auto [U, S, Vh] = at::linalg_svd(g, /*full_matrices=*/false);
  at::Tensor x = S / (g.norm().item<double>() + eps);
  for (const auto& [a, b, c] : coeffs) {
    at::Tensor x2 = x * x;
    x = x * (a + b * x2 + c * x2 * x2);
  }
  return at::matmul(U * x.unsqueeze(-2), Vh);
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor A = a.to(at::kDouble), B = b.to(at::kDouble);
  const double nb = B.norm().item<double>();
  return (A - B).norm().item<double>() / (nb > 0 ? nb : 1.0);
}

// Random orthogonal factor via QR.
at::Tensor orthogonal(int64_t n, int64_t k) {
  auto [q, r] = at::linalg_qr(at::randn({n, k}, at::kDouble));
  return q;
}

enum class Spectrum { Gauss, IllCond, RankDeficient };

at::Tensor make_input(int64_t m, int64_t n, Spectrum s) {
  if (s == Spectrum::Gauss) return at::randn({m, n}, at::kDouble);
  const int64_t k = std::min(m, n);
  at::Tensor U = orthogonal(m, k), V = orthogonal(n, k);
  at::Tensor sv;
  if (s == Spectrum::IllCond) {
    sv = at::logspace(0, -6, k, 10.0, at::kDouble);  // 1 ... 1e-6
  } else {
    sv = at::zeros({k}, at::kDouble);
    const int64_t r = std::max<int64_t>(1, k / 8);
    sv.narrow(0, 0, r).copy_(at::rand({r}, at::kDouble) + 0.5);
  }
  return at::matmul(U * sv.unsqueeze(0), V.transpose(0, 1));
}

const char* spectrum_name(Spectrum s) {
  return s == Spectrum::Gauss ? "gauss" : s == Spectrum::IllCond ? "illcond" : "rankdef";
}

struct Shape {
  int64_t m, n;
};
const std::vector<Shape> kShapes = {{64, 64}, {128, 512}, {512, 128}, {96, 200}, {200, 96}, {3, 7}, {1, 5}, {33, 33}};

NsOptions forced(NsOptions o) {
  o.force_gram = true;
  return o;
}

NsOptions steps_opts(int steps) {
  NsOptions o;
  o.steps = steps;
  return o;
}

// ---- coefficients ------------------------------------------------------------------------------
TEST(NewtonSchulzTest, PolarExpressCoefficientsAreExactWithSafetyFactorOnAllFive) {
  const Coefficients expected = {
      {7.892582874424408, -20.38301394587957, 13.555306149406924},
      {3.911484868135431, -2.5464635929060884, 0.4268988319673074},
      {3.760657955697423, -2.512819018216563, 0.4323647349070073},
      {3.160399673686287, -2.149649518898498, 0.3996366907664389},
      {2.1910971618617303, -1.441662010214663, 0.328146487623155},
  };
  ASSERT_EQ(POLAR_EXPRESS_COEFFICIENTS.size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    for (int j = 0; j < 3; ++j) EXPECT_EQ(POLAR_EXPRESS_COEFFICIENTS[i][j], expected[i][j]) << "step " << i << " " << j;
  EXPECT_EQ(POLAR_EXPRESS_UNMODIFIED_COEFFICIENTS[0][0], 8.28721201814563);
  EXPECT_EQ(POLAR_EXPRESS_UNMODIFIED_COEFFICIENTS[4][2], 0.4188073119525673);
}

TEST(NewtonSchulzTest, YouCoefficientsAreExact) {
  const Coefficients expected = {{4.0848, -6.8946, 2.9270}, {3.9505, -6.3029, 2.6377}, {3.7418, -5.5913, 2.3037},
                                 {2.8769, -3.1427, 1.2046}, {2.8366, -3.0525, 1.2012}};
  EXPECT_EQ(YOU_COEFFICIENTS, expected);
}

TEST(NewtonSchulzTest, StepsSelectPrefixOfDefaultsAndRepeatLast) {
  NsOptions o;
  o.steps = 3;
  auto c = resolve_coefficients(o);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[2], POLAR_EXPRESS_COEFFICIENTS[2]);
  o.steps = 7;
  c = resolve_coefficients(o);
  ASSERT_EQ(c.size(), 7u);
  EXPECT_EQ(c[6], POLAR_EXPRESS_COEFFICIENTS[4]);
  o.coefficients = YOU_COEFFICIENTS;  // explicit list: its length wins
  EXPECT_EQ(resolve_coefficients(o).size(), 5u);
}

// ---- float64 accuracy ------------------------------------------------------------------------
TEST(NewtonSchulzTest, Float64BothFormsMatchSvdReferenceForAnyRestartSet) {
  at::manual_seed(1);
  const std::vector<std::vector<int>> restart_sets = {{}, {2}, {1, 3}, {1, 2, 3, 4}};
  for (const auto& shape : kShapes) {
    for (Spectrum s : {Spectrum::Gauss, Spectrum::IllCond, Spectrum::RankDeficient}) {
      at::Tensor G = make_input(shape.m, shape.n, s);
      for (const Coefficients* coeffs : {&POLAR_EXPRESS_COEFFICIENTS, &YOU_COEFFICIENTS}) {
        const at::Tensor ref = reference_ns(G, *coeffs);
        NsOptions o;
        o.coefficients = *coeffs;
        const at::Tensor d = direct_newton_schulz(G, o);
        EXPECT_LE(rel(d, ref), 1e-10) << "direct " << shape.m << "x" << shape.n << " " << spectrum_name(s);
        for (const auto& rs : restart_sets) {
          o.restart_iterations = rs;
          const at::Tensor g = gram_newton_schulz(G, forced(o));
          EXPECT_LE(rel(g, ref), 1e-10) << "gram " << shape.m << "x" << shape.n << " " << spectrum_name(s)
                                        << " restarts=" << rs.size();
          EXPECT_LE(rel(g, d), 1e-10) << "direct vs gram " << shape.m << "x" << shape.n;
        }
      }
    }
  }
}

TEST(NewtonSchulzTest, OutputSingularValuesStayBelowSupOfComposedPolynomial) {
  at::manual_seed(2);
  for (auto s : {Spectrum::Gauss, Spectrum::IllCond}) {
    at::Tensor G = make_input(128, 512, s).to(at::kFloat);
    at::Tensor W = newton_schulz(G);
    const double smax = at::linalg_svdvals(W.to(at::kDouble)).max().item<double>();
    EXPECT_LE(smax, 1.123559 + 1e-4) << spectrum_name(s);
    EXPECT_GT(smax, 1.0);
  }
}

// ---- float32 accuracy (§8) -------------------------------------------------------------------------
TEST(NewtonSchulzTest, Float32WithinDocumentedBounds) {
  at::manual_seed(3);
  for (const auto& shape : std::vector<Shape>{{128, 512}, {512, 128}, {64, 64}, {256, 300}}) {
    for (Spectrum s : {Spectrum::Gauss, Spectrum::IllCond, Spectrum::RankDeficient}) {
      at::Tensor G64 = make_input(shape.m, shape.n, s);
      at::Tensor G = G64.to(at::kFloat);
      const at::Tensor ref = reference_ns(G.to(at::kDouble), POLAR_EXPRESS_COEFFICIENTS);
      const double bound = s == Spectrum::Gauss ? 1e-4 : 2e-3;
      const at::Tensor d = direct_newton_schulz(G);
      const at::Tensor g = gram_newton_schulz(G);
      EXPECT_EQ(d.scalar_type(), at::kFloat);
      EXPECT_EQ(g.scalar_type(), at::kFloat);
      EXPECT_LE(rel(d, ref), bound) << "direct " << shape.m << "x" << shape.n << " " << spectrum_name(s);
      EXPECT_LE(rel(g, ref), bound) << "gram " << shape.m << "x" << shape.n << " " << spectrum_name(s);
      EXPECT_LE(rel(g, d), bound) << "direct vs gram " << shape.m << "x" << shape.n << " " << spectrum_name(s);
    }
  }
}

TEST(NewtonSchulzTest, BFloat16DirectWithinHalfPrecisionBound) {
  at::manual_seed(4);
  at::Tensor G = at::randn({64, 256});
  const at::Tensor ref = reference_ns(G.to(at::kDouble), POLAR_EXPRESS_COEFFICIENTS);
  NsOptions o;
  o.compute_dtype = at::kBFloat16;
  at::Tensor d = direct_newton_schulz(G.to(at::kBFloat16), o);
  EXPECT_EQ(d.scalar_type(), at::kBFloat16);
  EXPECT_LE(rel(d, ref), 5e-2);
  // nuclear-gap criterion: |gap(W) - gap(ref)| <= 5e-3 with gap(W) = 1 - <G, W> / |G|_*
  const double nuc = at::linalg_svdvals(G.to(at::kDouble)).sum().item<double>();
  auto gap = [&](const at::Tensor& W) { return 1.0 - (G.to(at::kDouble) * W.to(at::kDouble)).sum().item<double>() / nuc; };
  EXPECT_LE(std::abs(gap(d) - gap(ref)), 5e-3);
}

// ---- invariants ---------------------------------------------------------------------------------
TEST(NewtonSchulzTest, ZeroInputGivesExactZero) {
  for (const auto& shape : kShapes) {
    at::Tensor Z = at::zeros({shape.m, shape.n});
    EXPECT_TRUE(at::equal(newton_schulz(Z), Z));
    EXPECT_TRUE(at::equal(direct_newton_schulz(Z), Z));
  }
}

// eps = 0 is allowed, but a zero matrix then normalises to 0/0: an error naming eps, not a NaN result.
TEST(NewtonSchulzTest, ZeroInputWithEpsZeroIsAnErrorNotNaN) {
  at::Tensor Z = at::zeros({8, 12}, at::kDouble);
  try {
    gram_newton_schulz(Z, 5, 0.0);
    ADD_FAILURE() << "no error for a zero matrix with eps = 0";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("is all zeros and eps is 0, so normalising it would divide 0 by 0"),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(direct_newton_schulz(at::stack({Z, at::ones({8, 12}, at::kDouble)}), 5, 0.0), c10::ValueError);
  at::manual_seed(11);
  const at::Tensor G = at::randn({8, 12}, at::kDouble);  // a non-zero matrix: eps = 0 is fine
  EXPECT_LE(rel(gram_newton_schulz(G, 5, 0.0), gram_newton_schulz(G, 5, 1e-300)), 1e-14);
}

TEST(NewtonSchulzTest, TransposeCommutes) {
  at::manual_seed(5);
  for (const auto& shape : kShapes) {
    at::Tensor G = at::randn({shape.m, shape.n}, at::kDouble);
    EXPECT_LE(rel(gram_newton_schulz(G.t()), gram_newton_schulz(G).t()), 1e-12) << shape.m << "x" << shape.n;
    EXPECT_LE(rel(direct_newton_schulz(G.t()), direct_newton_schulz(G).t()), 1e-12);
  }
}

TEST(NewtonSchulzTest, PositiveScaleInvariantUpToEps) {
  at::manual_seed(6);
  at::Tensor G = at::randn({70, 70}, at::kDouble);  // |G|_F ~ 70
  for (double s : {0.5, 3.0, 1000.0}) EXPECT_LE(rel(newton_schulz(G * s), newton_schulz(G)), 1e-7) << s;
}

TEST(NewtonSchulzTest, ShapeAndDtypePreserved) {
  for (auto dt : {at::kFloat, at::kDouble, at::kBFloat16}) {
    at::Tensor G = at::randn({12, 20}).to(dt);
    at::Tensor W = newton_schulz(G);
    EXPECT_EQ(W.sizes(), G.sizes());
    EXPECT_EQ(W.scalar_type(), dt);
    EXPECT_TRUE(W.is_contiguous());
  }
}

TEST(NewtonSchulzTest, BatchEqualsPerMatrix) {
  at::manual_seed(7);
  for (auto shape : std::vector<Shape>{{16, 40}, {40, 16}, {24, 24}}) {
    at::Tensor B = at::randn({2, 3, shape.m, shape.n}, at::kDouble);
    at::Tensor out_g = gram_newton_schulz(B), out_d = direct_newton_schulz(B);
    ASSERT_EQ(out_g.sizes(), B.sizes());
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) {
        EXPECT_LE(rel(out_g[i][j], gram_newton_schulz(B[i][j])), 1e-13);
        EXPECT_LE(rel(out_d[i][j], direct_newton_schulz(B[i][j])), 1e-13);
        EXPECT_LE(rel(out_g[i][j], reference_ns(B[i][j], POLAR_EXPRESS_COEFFICIENTS)), 1e-10);
      }
  }
}

TEST(NewtonSchulzTest, ManyMatricesEqualOneCallEachWhateverTheGrouping) {
  at::manual_seed(11);
  // stacked groups (wide and tall 16 x 40 together, square 24 x 24), a lone shape, and a shape above
  // the CPU's stacking limit (one call each)
  std::vector<at::Tensor> in;
  for (auto [m, n] : std::vector<std::pair<int64_t, int64_t>>{{16, 40}, {40, 16}, {24, 24}, {16, 40}, {24, 24},
                                                               {100, 80}, {80, 100}, {7, 3}})
    in.push_back(at::randn({m, n}, at::kDouble));
  const NewtonSchulz ns("gram");
  const std::vector<at::Tensor> out = newton_schulz_many(ns, in, 5);
  ASSERT_EQ(out.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(out[i].sizes(), in[i].sizes()) << i;
    EXPECT_LE(rel(out[i], ns.local(in[i], 5)), 1e-12) << i;
  }
  EXPECT_TRUE(ns_stacking_pays(c10::DeviceType::CPU, kCpuStackMaxSide));
  EXPECT_FALSE(ns_stacking_pays(c10::DeviceType::CPU, kCpuStackMaxSide + 1));
  EXPECT_TRUE(ns_stacking_pays(c10::DeviceType::CUDA, 4096));
  EXPECT_THROW(newton_schulz_many(ns, {at::randn({2, 3, 4})}), c10::Error);
}

TEST(NewtonSchulzTest, GraphRunnerIsTheEagerNsOffCuda) {
  at::manual_seed(12);
  NewtonSchulz ns("gram");
  ns.set_check_finite(false);
  NsGraphs graphs(ns);
  EXPECT_EQ(NsGraphs::supported(), DMUON_WITH_CUDA != 0);
  const at::Tensor G = at::randn({3, 16, 40}, at::kDouble);
  EXPECT_TRUE(at::equal(graphs.run(G, 5), ns.local(G, 5)));
  EXPECT_EQ(graphs.stats().eager, 1);  // a CPU tensor is never captured
  EXPECT_EQ(graphs.stats().captures, 0);
}

TEST(NsCalibration, MeasuresEachShapeOnceTheWayTheStepRunsIt) {
  NsCalibrationOptions o;
  o.reps = 1;
  o.batch = 3;
  // 32 x 32 twice and 8 x 200 / 200 x 8 (one shape), 100 x 120 above the CPU stacking limit, fp64
  const NsProfile p = measure_ns_profile({{32, 32, 4}, {8, 200, 4}, {32, 32, 4}, {200, 8, 4}, {100, 120, 8}}, o);
  ASSERT_EQ(p.timings.size(), 3u);
  EXPECT_EQ(p.device, "cpu");
  EXPECT_EQ(p.timings[0].rows, 32);
  EXPECT_EQ(p.timings[1].rows, 8);
  EXPECT_EQ(p.timings[1].cols, 200);
  EXPECT_EQ(p.timings[2].elem_bytes, 8);
  for (const NsTiming& t : p.timings) EXPECT_GT(t.single_us, 0.0);
  EXPECT_EQ(p.timings[0].batch, 3);  // stacks on the CPU: measured batched
  EXPECT_GT(p.timings[0].batch_us, 0.0);
  EXPECT_EQ(p.timings[2].batch, 1);  // does not stack: k matrices cost k single calls
  EXPECT_GT(p.cost_of(120, 100, 8).per_matrix_us, 0.0);
  // what was measured reads back
  EXPECT_EQ(ns_profile_from_json(ns_profile_to_json(p), "rt").digest(), p.digest());
  EXPECT_THROW(measure_ns_profile({{4, 4, 3}}, o), std::invalid_argument);
  const DeviceRates r = measure_device_rates(at::kCPU, 1);
  EXPECT_GT(r.matmul_tflops, 0.0);
  EXPECT_GT(r.memory_bandwidth_GBps, 0.0);
}

TEST(NewtonSchulzTest, SquareInputUsesDirectForm) {
  at::manual_seed(8);
  at::Tensor G = at::randn({48, 48});
  EXPECT_TRUE(at::equal(gram_newton_schulz(G), direct_newton_schulz(G)));
  EXPECT_TRUE(at::equal(newton_schulz(G), direct_newton_schulz(G)));
}

// ---- fused CPU kernel ---------------------------------------------------------------------------
NsOptions aten_path(NsOptions o = {}) {
  o.cpu_fused = false;
  return o;
}

// Runs a test with the fused kernel's default setup (DMUON_NS_CPU_FUSED unset, the CPU's best ISA
// copy) and restores the caller's environment variable and ISA choice when it ends.
struct FusedTestScope {
  FusedTestScope() {
    if (const char* v = std::getenv("DMUON_NS_CPU_FUSED")) saved = v;
    unsetenv("DMUON_NS_CPU_FUSED");
    detail::fused_cpu::select_isa("");
  }
  ~FusedTestScope() {
    detail::fused_cpu::select_isa("");
    if (saved) setenv("DMUON_NS_CPU_FUSED", saved->c_str(), 1);
    else unsetenv("DMUON_NS_CPU_FUSED");
  }
  std::optional<std::string> saved;
};

// The fused kernel against the ATen path (one ATen call per GEMM) on the shapes it takes: wide,
// tall (oriented), square (direct form), odd sizes (padding), a 1-row matrix, batches, Gram restart
// sets and both backends. float64: the two differ by rounding only (measured <= 3e-15 relative; bound
// 1e-12, margin > 300x). float32: see the bounds above.
// fp32 bounds, measured on this project's AVX2 box (ns_test prints them): the fused kernel's error
// against the float64 SVD reference exceeds the ATen path's by <= 5.4e-6 (bound 1e-4: 18x), and the
// two differ by <= 8.2e-5 (Gram NS without restarts amplifies rounding most; bound 1e-3: 12x).
constexpr double kFp32RefBound = 1e-4;
constexpr double kFp32PathBound = 1e-3;
TEST(NewtonSchulzTest, FusedCpuKernelMatchesTheAtenPath) {
  FusedTestScope scope;
  at::manual_seed(31);
  double worst_vs_ref = 0, worst_vs_aten = 0;
  const std::vector<std::vector<int64_t>> shapes = {{32, 32}, {8, 512}, {512, 8}, {48, 128}, {20, 21}, {21, 20},
                                                    {64, 64}, {1, 7},   {64, 1000}, {5, 24, 40}, {3, 33, 17}};
  for (const auto& shape : shapes) {
    for (const std::string backend : {"gram", "direct"}) {
      for (const auto& rs : std::vector<std::vector<int>>{{2}, {}, {1, 3}}) {
        NsOptions o;
        o.restart_iterations = rs;
        const at::Tensor G64 = at::randn(shape, at::kDouble);
        const at::Tensor oriented = (shape[shape.size() - 2] > shape.back() ? G64.transpose(-2, -1) : G64).contiguous();
        ASSERT_TRUE(detail::fused_cpu::applies(o, "cublas", oriented)) << at::IntArrayRef(shape);
        ASSERT_FALSE(detail::fused_cpu::applies(aten_path(o), "cublas", oriented));
        auto ns = [&](const at::Tensor& G, const NsOptions& opts) {
          return backend == "gram" ? gram_newton_schulz(G, opts) : direct_newton_schulz(G, opts);
        };
        const at::Tensor fused64 = ns(G64, o), aten64 = ns(G64, aten_path(o));
        EXPECT_EQ(fused64.sizes(), G64.sizes());
        EXPECT_LT(rel(fused64, aten64), 1e-12) << backend << " " << at::IntArrayRef(shape);
        if (shape.size() == 2) {
          const at::Tensor G32 = G64.to(at::kFloat);
          const at::Tensor ref = reference_ns(G64, POLAR_EXPRESS_COEFFICIENTS);
          const at::Tensor fused32 = ns(G32, o), aten32 = ns(G32, aten_path(o));
          EXPECT_EQ(fused32.scalar_type(), at::kFloat);
          worst_vs_ref = std::max(worst_vs_ref, rel(fused32, ref) - rel(aten32, ref));
          worst_vs_aten = std::max(worst_vs_aten, rel(fused32, aten32));
          EXPECT_LT(rel(fused32, ref) - rel(aten32, ref), kFp32RefBound) << backend << " " << at::IntArrayRef(shape);
          EXPECT_LT(rel(fused32, aten32), kFp32PathBound) << backend << " " << at::IntArrayRef(shape);
        }
      }
    }
  }
  std::cout << "[ measured ] fp32: fused error - ATen error vs the float64 reference <= " << worst_vs_ref
            << " (bound " << kFp32RefBound << "), fused vs ATen <= " << worst_vs_aten << " (bound " << kFp32PathBound
            << ")\n";
}

// The portable copy and the AVX2 copy compute the same thing (float64: rounding only); each is
// deterministic for any thread count, and a stacked matrix gets what it gets alone (to rounding).
TEST(NewtonSchulzTest, FusedCpuKernelIsDeterministicAcrossIsaCopiesBatchesAndThreads) {
  FusedTestScope scope;
  at::manual_seed(32);
  const at::Tensor G = at::randn({6, 24, 72}, at::kDouble);
  const at::Tensor best = gram_newton_schulz(G);
  ASSERT_TRUE(detail::fused_cpu::select_isa("generic"));
  EXPECT_STREQ(detail::fused_cpu::isa(), "generic");
  const at::Tensor generic = gram_newton_schulz(G);
  EXPECT_LT(rel(generic, best), 1e-12);
  EXPECT_LT(rel(generic, gram_newton_schulz(G, aten_path())), 1e-12);
  detail::fused_cpu::select_isa("");
  EXPECT_FALSE(detail::fused_cpu::select_isa("sve"));
  for (auto dt : {at::kFloat, at::kDouble}) {
    const at::Tensor Gd = G.to(dt);
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    const at::Tensor one = gram_newton_schulz(Gd);
    at::set_num_threads(4);
    if (at::get_num_threads() > 1) {  // (a started thread pool may keep its size: then nothing to compare)
      EXPECT_TRUE(at::equal(one, gram_newton_schulz(Gd)));
    }
    at::set_num_threads(threads);
    // the factors of a stack reproduce its NS bit for bit, matrix by matrix
    EXPECT_TRUE(at::equal(apply_gram_factors(Gd, gram_newton_schulz_factors(Gd)), one));
    // alone, a matrix differs only by its norm's summation order (ATen's reduction over a stack)
    for (int64_t b = 0; b < G.size(0); ++b)
      EXPECT_LT(rel(one[b], gram_newton_schulz(Gd[b])), dt == at::kDouble ? 1e-12 : 1e-5) << b;
    EXPECT_TRUE(at::equal(one, gram_newton_schulz(Gd)));  // run to run
  }
}

// What the fused kernel does not take runs the ATen path, bit for bit: a Gram side over 64, too many
// columns, half precision, the SYRK kernel, cpu_fused = false and DMUON_NS_CPU_FUSED=0.
TEST(NewtonSchulzTest, FusedCpuKernelStepsAsideWhereItDoesNotApply) {
  FusedTestScope scope;
  at::manual_seed(33);
  using detail::fused_cpu::supports;
  EXPECT_FALSE(supports(at::zeros({65, 70})));
  EXPECT_FALSE(supports(at::zeros({64, 1100})));
  EXPECT_FALSE(supports(at::zeros({16, 16}, at::kBFloat16)));
  EXPECT_FALSE(supports(at::zeros({40, 20})));  // not oriented
  EXPECT_FALSE(supports(at::zeros({2, 3, 16, 16})));
  EXPECT_TRUE(supports(at::zeros({64, 1024})));
  EXPECT_TRUE(supports(at::zeros({7, 16, 16}, at::kDouble)));
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{65, 70}, {16, 5000}}) {
    const at::Tensor G = at::randn(shape);
    EXPECT_TRUE(at::equal(gram_newton_schulz(G), gram_newton_schulz(G, aten_path())));
  }
  const at::Tensor G = at::randn({24, 48});
  const at::Tensor aten = gram_newton_schulz(G, aten_path());
  EXPECT_TRUE(detail::fused_cpu::applies(NsOptions{}, "cublas", G));
  EXPECT_FALSE(detail::fused_cpu::applies(NsOptions{}, "syrk", G));
  setenv("DMUON_NS_CPU_FUSED", "0", 1);
  EXPECT_FALSE(detail::fused_cpu::applies(NsOptions{}, "cublas", G));
  EXPECT_TRUE(at::equal(gram_newton_schulz(G), aten));
  unsetenv("DMUON_NS_CPU_FUSED");
  NsOptions syrk;
  syrk.kernel = "syrk";
  NsOptions syrk_aten = aten_path(syrk);
  EXPECT_TRUE(at::equal(gram_newton_schulz(G, syrk), gram_newton_schulz(G, syrk_aten)));
  NsOptions half;  // a 16-bit compute dtype
  half.compute_dtype = at::kBFloat16;
  const at::Tensor H = at::randn({16, 40});
  EXPECT_TRUE(at::equal(gram_newton_schulz(H, half), gram_newton_schulz(H, aten_path(half))));
}

// ---- factors -------------------------------------------------------------------------------------
TEST(NewtonSchulzTest, FactorSegmentsReproduceGramBitForBit) {
  at::manual_seed(9);
  for (auto shape : std::vector<Shape>{{32, 96}, {96, 32}, {20, 21}}) {
    for (const auto& rs : std::vector<std::vector<int>>{{}, {2}, {1, 3}, {1, 2, 3, 4}}) {
      for (auto dt : {at::kFloat, at::kDouble}) {
        at::Tensor G = at::randn({shape.m, shape.n}).to(dt);
        NsOptions o;
        o.restart_iterations = rs;
        GramFactors f = gram_newton_schulz_factors(G, o);
        EXPECT_EQ(f.segments.size(), rs.size() + 1);
        EXPECT_EQ(f.transposed, shape.m > shape.n);
        const int64_t k = std::min(shape.m, shape.n);
        for (const auto& seg : f.segments) EXPECT_EQ(seg.sizes(), (std::vector<int64_t>{k, k}));
        EXPECT_NEAR(f.normalizer.item<double>(), G.to(at::kDouble).norm().item<double>() + 1e-7,
                    dt == at::kDouble ? 1e-12 : 1e-4);
        EXPECT_TRUE(at::equal(apply_gram_factors(G, f, o), gram_newton_schulz(G, forced(o))));
        const NsOptions a = aten_path(o);  // and on the ATen path (the fused kernel takes these shapes)
        EXPECT_TRUE(at::equal(apply_gram_factors(G, gram_newton_schulz_factors(G, a), a),
                              gram_newton_schulz(G, forced(a))));
      }
    }
  }
  EXPECT_TRUE(at::equal(gram_newton_schulz_q(at::ones({3, 5})).segments[0],
                        gram_newton_schulz_factors(at::ones({3, 5})).segments[0]));
}

// ---- kernels -------------------------------------------------------------------------------------
TEST(NewtonSchulzTest, SyrkKernelMatchesPlainGemm) {
  at::manual_seed(10);
  for (auto dt : {at::kFloat, at::kDouble}) {
    at::Tensor G = at::randn({64, 300}).to(dt);
    NsOptions plain, syrk;
    plain.kernel = "cublas";
    syrk.kernel = "syrk";
    const double tol = dt == at::kDouble ? 1e-12 : 1e-5;
    EXPECT_LE(rel(gram_newton_schulz(G, syrk), gram_newton_schulz(G, plain)), tol);
    EXPECT_LE(rel(direct_newton_schulz(G, syrk), direct_newton_schulz(G, plain)), tol);
  }
}

// The "syrk" kernel's product for what no BLAS SYRK takes (16-bit, batches): the lower block
// triangle (issue 37). float64: equal to X X^T up to float64 rounding (measured <= 1.3e-16 relative,
// OMP_NUM_THREADS 1 and 2; bound 1e-13) and exactly symmetric. bf16: each block is an fp32-accumulated
// sum rounded once to bf16, as the plain product's elements are (measured here: identical to the plain
// bf16 product; another BLAS may order a sum differently and flip a rounding: bound 8e-3, two bf16
// ulps), and as close to the float64 product as the plain one is (1.6e-3 to 1.8e-3 both).
TEST(NewtonSchulzTest, BlockTriangleGramEqualsTheFullProduct) {
  namespace k = detail::kernels;
  EXPECT_EQ(k::block_triangle_depth(256), 1);
  EXPECT_EQ(k::block_triangle_depth(512), 2);
  EXPECT_EQ(k::block_triangle_depth(1024), 3);
  EXPECT_EQ(k::block_triangle_depth(4096), 3);
  EXPECT_EQ(k::block_triangle_depth(384), 1);  // 192-row halves; quarters of 96 are too small
  EXPECT_EQ(k::block_triangle_depth(200), 0);
  EXPECT_EQ(k::block_triangle_depth(258), 1);  // two 129-row halves; 258 is not a multiple of 4
  at::manual_seed(31);
  struct Case {
    std::vector<int64_t> shape;
    int depth;
  };
  for (const Case& c : {Case{{256, 300}, 1}, Case{{512, 100}, 2}, Case{{1024, 40}, 3}, Case{{3, 256, 40}, 1},
                        Case{{2, 512, 64}, 2}, Case{{96, 50}, 0}}) {
    SCOPED_TRACE(::testing::PrintToString(c.shape) + " depth " + std::to_string(c.depth));
    const at::Tensor X = at::randn(c.shape, at::kDouble);
    const at::Tensor C = k::block_triangle_gram(X, c.depth);
    const at::Tensor ref = at::matmul(X, X.transpose(-1, -2));
    EXPECT_LE(rel(C, ref), 1e-13);
    EXPECT_TRUE(at::equal(C, C.transpose(-1, -2)));
    const at::Tensor H = X.to(at::kBFloat16);
    const at::Tensor CH = k::block_triangle_gram(H, c.depth);
    EXPECT_EQ(CH.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(CH, CH.transpose(-1, -2)));
    const at::Tensor plain = k::mm(H, H.transpose(-1, -2));
    EXPECT_LE(rel(CH, plain), 8e-3);
    const at::Tensor exact = at::matmul(H.to(at::kDouble), H.to(at::kDouble).transpose(-1, -2));
    EXPECT_LE(rel(CH, exact), 2 * rel(plain, exact) + 1e-6);
  }
}

// "syrk" on 16-bit inputs runs Newton-Schulz with the block-triangle Gram product: the same result as
// the plain GEMMs up to bf16 rounding (measured here: identical; bound 2e-2), and as close to the
// float64 NS (both 2.7e-2: bf16 Gram NS without restarts' benefit on a 256 x 700 Gaussian).
TEST(NewtonSchulzTest, SyrkOn16BitInputsUsesTheBlockTriangle) {
  at::manual_seed(32);
  const at::Tensor G = at::randn({256, 700});
  NsOptions plain, syrk;
  plain.kernel = "cublas";
  syrk.kernel = "syrk";
  plain.compute_dtype = syrk.compute_dtype = at::kBFloat16;
  const at::Tensor a = gram_newton_schulz(G, syrk), b = gram_newton_schulz(G, plain);
  const at::Tensor ref = reference_ns(G.to(at::kDouble), POLAR_EXPRESS_COEFFICIENTS);
  EXPECT_LE(rel(a, b), 2e-2);
  EXPECT_LE(rel(a, ref), 1.5 * rel(b, ref) + 1e-3);
  EXPECT_EQ(detail::kernels::resolve_kernel("syrk", G.to(at::kBFloat16)), "syrk");
  EXPECT_EQ(detail::kernels::resolve_kernel("syrk", at::zeros({100, 700}, at::kBFloat16)), "cublas");  // no depth
}

TEST(NewtonSchulzTest, NewtonSchulzObjectAndBackendStatus) {
  at::manual_seed(11);
  at::Tensor G = at::randn({16, 48}, at::kDouble);
  NewtonSchulz gram;
  NewtonSchulz direct("direct");
  EXPECT_LE(rel(gram.local(G), reference_ns(G, POLAR_EXPRESS_COEFFICIENTS)), 1e-10);
  EXPECT_LE(rel(direct.local(G, 3), reference_ns(G, resolve_coefficients(steps_opts(3)))), 1e-10);
  NewtonSchulz you("gram", "auto", YOU_COEFFICIENTS);
  EXPECT_LE(rel(you.local(G), reference_ns(G, YOU_COEFFICIENTS)), 1e-10);
  EXPECT_EQ(NewtonSchulz("gram", "auto", std::nullopt, std::nullopt, /*deterministic=*/true).options().kernel,
            "cublas");
  // the name of what runs: on the CPU the plain-GEMM path is not cuBLAS
  EXPECT_EQ(gram.describe(), "Gram NS · kernel=cpu-gemm");
  EXPECT_EQ(gram.describe(c10::DeviceType::CUDA), "Gram NS · kernel=cublas");
  EXPECT_EQ(NewtonSchulz("direct", "syrk").describe(), "Direct NS · kernel=cpu-blas-syrk");
  EXPECT_EQ(get_ns_backend().find("cublas"), std::string::npos) << get_ns_backend();

  const BackendStatus s = get_backend_status();
  EXPECT_EQ(s.sm_version, 0);
  EXPECT_EQ(s.device, "cpu");
  EXPECT_TRUE(s.cublas_always_available);
  EXPECT_EQ(s.auto_choice, "cublas");
  EXPECT_FALSE(s.quack_available || s.cute_sm80_available);
  std::vector<std::string> names;
  for (const KernelStatus& k : s.kernels) {
    names.push_back(k.name);
    EXPECT_FALSE(k.detail.empty()) << k.name;
    const bool always = k.name == "auto" || k.name == "cublas", never = k.name == "quack" || k.name == "cute_sm80";
    if (always || never) {
      EXPECT_EQ(k.available, always) << k.name;
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{"auto", "cublas", "syrk", "quack", "cute_sm80"}));
  EXPECT_NE(get_ns_backend().find("CPU"), std::string::npos);
  EXPECT_NE(get_ns_backend().find("kernel=cpu-gemm"), std::string::npos) << get_ns_backend();

  setenv("DMUON_NS_KERNEL", "syrk", 1);
  EXPECT_EQ(get_backend_status().auto_choice, "syrk");
  EXPECT_EQ(NewtonSchulz().resolved_kernel(), "syrk");
  EXPECT_EQ(NewtonSchulz("gram", "cublas").resolved_kernel(), "cublas");  // explicit kernel wins over env
  setenv("DMUON_NS_KERNEL", "bogus", 1);
  EXPECT_THROW(NewtonSchulz().resolved_kernel(), c10::Error);
  unsetenv("DMUON_NS_KERNEL");
}

// ---- bad input -------------------------------------------------------------------------------------
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(NewtonSchulzTest, BadInputGivesClearErrors) {
  EXPECT_NE(error_of([] { newton_schulz(at::randn({5})); }).find("got a 1-D tensor"), std::string::npos);
  EXPECT_NE(error_of([] { newton_schulz(at::randn({0, 5})); }).find("empty dimension"), std::string::npos);
  EXPECT_NE(error_of([] { newton_schulz(at::ones({2, 3}, at::kInt)); }).find("unsupported dtype"), std::string::npos);
  NsOptions empty;
  empty.coefficients = Coefficients{};
  EXPECT_NE(error_of([&] { newton_schulz(at::randn({4, 6}), empty); }).find("coefficient list is empty"),
            std::string::npos);
  NsOptions bad_restart;
  bad_restart.restart_iterations = std::vector<int>{5};
  EXPECT_NE(error_of([&] { gram_newton_schulz(at::randn({4, 6}), bad_restart); }).find("restart iteration 5 is out of range"),
            std::string::npos);
  bad_restart.restart_iterations = std::vector<int>{-1};
  EXPECT_NE(error_of([&] { gram_newton_schulz(at::randn({4, 6}), bad_restart); }).find("out of range"),
            std::string::npos);
  EXPECT_NE(error_of([] { NewtonSchulz("fast"); }).find("unknown backend 'fast'"), std::string::npos);
  // the seed's CuTe-DSL kernels: a clear error naming what this build has
  for (const char* k : {"quack", "cute_sm80"}) {
    const std::string e = error_of([&] { NewtonSchulz("gram", k); });
    EXPECT_NE(e.find(std::string("kernel '") + k + "' is not in this build"), std::string::npos) << e;
    EXPECT_NE(e.find("Available here: \"auto\", \"cublas\""), std::string::npos) << e;
  }
  EXPECT_NE(error_of([] { NewtonSchulz("gram", "fastest"); }).find("unknown kernel 'fastest'"), std::string::npos);
  NsOptions zero_steps;
  zero_steps.steps = 0;
  EXPECT_NE(error_of([&] { newton_schulz(at::randn({4, 6}), zero_steps); }).find("invalid steps"), std::string::npos);
}

TEST(NewtonSchulzTest, NonFiniteInputIsAnErrorUnlessCheckDisabled) {
  at::Tensor G = at::randn({8, 12});
  G[3][4] = std::nan("");
  EXPECT_NE(error_of([&] { newton_schulz(G); }).find("NaN or Inf"), std::string::npos);
  at::Tensor H = at::randn({8, 12});
  H[0][0] = INFINITY;
  EXPECT_NE(error_of([&] { direct_newton_schulz(H); }).find("NaN or Inf"), std::string::npos);
  NsOptions o;
  o.check_finite = false;
  EXPECT_TRUE(at::isnan(newton_schulz(G, o)).all().item<bool>());
}

// A finite float32 matrix whose squares overflow float32 (|g| ~ 1.5e20 > 1.8e19): Newton-Schulz is scale
// invariant, so it is as accurate as for the matrix scaled down (its sums are taken in float64), with the check
// on or off, in every form; before, the normaliser was Inf and the result silently all zeros (or "NaN or Inf").
// float32: within the documented 1e-4 of the float64 result (measured <= 3e-5, as for the unscaled matrix);
// bfloat16: within one bfloat16 ulp (2^-8) of the unscaled matrix's output (measured <= 3e-4: the normalised
// inputs differ in the last float32 bit, which flips a few roundings of the output).
TEST(NewtonSchulzTest, Float32InputsWhoseSquaresOverflowAreNormalisedInFloat64) {
  at::manual_seed(61);
  const double huge = std::ldexp(1.0, 67);  // a power of two: big is G scaled exactly
  for (const auto& shape : std::vector<std::vector<int64_t>>{{24, 40}, {40, 24}, {32, 32}, {3, 16, 48}}) {
    const at::Tensor G = at::randn(shape);
    const at::Tensor big = G * huge;
    ASSERT_TRUE(at::isfinite(big).all().item<bool>());
    for (bool check : {true, false}) {
      NsOptions o;
      o.check_finite = check;
      const std::string what = c10::str(at::IntArrayRef(shape), check ? " checked" : " unchecked");
      const at::Tensor ref = newton_schulz(G.to(at::kDouble), o);
      const at::Tensor ref_direct = direct_newton_schulz(G.to(at::kDouble), o);
      EXPECT_LE(rel(newton_schulz(big, o), ref), 1e-4) << what;
      EXPECT_LE(rel(direct_newton_schulz(big, o), ref_direct), 1e-4) << what;
      EXPECT_LE(rel(newton_schulz(big.to(at::kBFloat16), o), newton_schulz(G.to(at::kBFloat16), o)), std::ldexp(1.0, -8))
          << what;
      if (shape.size() == 2 && shape[0] != shape[1]) {
        const GramFactors f = gram_newton_schulz_factors(big, o);
        EXPECT_LE(rel(apply_gram_factors(big, f, o), ref), 1e-4) << what;
        EXPECT_EQ(f.normalizer.scalar_type(), at::kFloat);  // as for any float32 input
        EXPECT_NEAR(f.normalizer.item<double>() / (G.to(at::kDouble).norm().item<double>() * huge), 1.0, 1e-6);
      }
    }
  }
  // a real NaN or Inf is still one
  at::Tensor bad = at::randn({8, 12}) * huge;
  bad[1][2] = INFINITY;
  EXPECT_NE(error_of([&] { newton_schulz(bad); }).find("NaN or Inf"), std::string::npos);
}

// ---- column-sharded Gram NS on Gloo ranks -------------------------------------------------------
// Shards the oriented global matrix by columns across `world` ranks (uneven split allowed) and
// checks every rank's output shard against the unsharded Gram result.
void check_sharded(int world, int64_t rows, int64_t cols, std::vector<int> restarts, bool batched) {
  at::manual_seed(100 + world);
  const int64_t B = batched ? 3 : 1;
  at::Tensor G = at::randn({B, rows, cols}, at::kDouble);
  NsOptions o;
  o.restart_iterations = restarts;
  const at::Tensor full = gram_newton_schulz(G, forced(o));
  const bool transposed = rows > cols;  // from the GLOBAL shape
  const int64_t long_dim = transposed ? rows : cols;
  std::vector<int64_t> starts(world + 1, 0);
  for (int r = 0; r < world; ++r) starts[r + 1] = starts[r] + long_dim / world + (r < long_dim % world ? 1 : 0);
  testing::run_ranks(world, [&](testing::RankContext& ctx) {
    const int64_t s = starts[ctx.rank], len = starts[ctx.rank + 1] - starts[ctx.rank];
    const int dim = transposed ? 1 : 2;  // tall: shard rows of G (= columns of G^T)
    at::Tensor local = G.narrow(dim, s, len);
    at::Tensor out = batched ? gram_newton_schulz_distributed_local_batched(local, ctx.pg, transposed, o)
                             : gram_newton_schulz_distributed_local(local.squeeze(0), ctx.pg, transposed, o);
    at::Tensor expect = full.narrow(dim, s, len);
    if (!batched) expect = expect.squeeze(0);
    const double err = rel(out, expect);
    if (!(err <= 1e-11))
      throw std::runtime_error("sharded mismatch " + std::to_string(err) + " on shard of " + std::to_string(len));
  });
}

// Shards that cannot be column blocks of one matrix (another row count, dtype or orientation on one rank) are an
// error on every rank before any all-reduce, naming what differs: on Gloo a size mismatch aborted the process of
// one rank ("Received data size doesn't match expected size") and left the others with "Connection reset".
TEST(NewtonSchulzTest, ColumnShardedGramRefusesShardsOfDifferentMatricesOnEveryRank) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    const std::string me = "rank " + std::to_string(ctx.rank) + ": gram_newton_schulz_distributed_local: ";
    auto run = [&](const at::Tensor& local, bool transposed) {
      return testing::error_of([&] { gram_newton_schulz_distributed_local(local, ctx.pg, transposed); });
    };
    std::string err = run(at::randn({ctx.rank == 0 ? 8 : 6, 4}, at::kDouble), false);
    testing::expect(err.rfind(me + "the ranks' shards differ in rows of the oriented shard (this rank's: " +
                                  (ctx.rank == 0 ? "8" : "6") + "): rank(s) 1 differ from the group's rank 0",
                              0) == 0,
                    err);
    err = run(at::randn({8, 4}, ctx.rank == 0 ? at::kDouble : at::kFloat), false);
    testing::expect(err.find("differ in dtype (this rank's: " + std::string(ctx.rank == 0 ? "Double" : "Float")) !=
                        std::string::npos,
                    err);
    err = run(at::randn({8, 8}, at::kDouble), ctx.rank == 1);
    testing::expect(err.find("differ in transposed") != std::string::npos, err);
    err = run(ctx.rank == 0 ? at::randn({8, 4}, at::kDouble) : at::randn({2, 8, 4}, at::kDouble), false);
    testing::expect(err.find(ctx.rank == 1 ? "rank 1: gram_newton_schulz_distributed_local: expected a 2-D tensor"
                                           : me + "rank(s) 1 refused the shard") != std::string::npos,
                    err);
    // and shards of one matrix run (their other sides may differ: 8 x 5 and 8 x 3)
    EXPECT_EQ(run(at::randn({8, ctx.rank == 0 ? 5 : 3}, at::kDouble), false), "");
    // a call that repeats an agreed one on rank 0 while rank 1's differs is refused too (an agreement cached per
    // rank let rank 0 skip the all-gather rank 1 made: rank 1's agreement met rank 0's Gram all-reduce)
    err = run(at::randn({ctx.rank == 0 ? 8 : 6, ctx.rank == 0 ? 5 : 3}, at::kDouble), false);
    testing::expect(err.find("the ranks' shards differ in rows of the oriented shard (this rank's: " +
                             std::string(ctx.rank == 0 ? "8" : "6")) != std::string::npos,
                    err);
  });
}

TEST(NewtonSchulzTest, ColumnShardedGramEqualsUnshardedOn2Ranks) {
  check_sharded(2, 24, 80, {2}, false);
  check_sharded(2, 80, 24, {1, 3}, false);
}
TEST(NewtonSchulzTest, ColumnShardedGramEqualsUnshardedOn3RanksUneven) {
  check_sharded(3, 20, 61, {2}, false);
  check_sharded(3, 61, 20, {}, false);
}
TEST(NewtonSchulzTest, ColumnShardedGramEqualsUnshardedOn4RanksOrientationFromGlobalShape) {
  // 30 x 40 is wide globally, but each local shard 30 x 10 is tall: orientation must not flip.
  check_sharded(4, 30, 40, {2}, false);
  check_sharded(4, 40, 30, {2}, false);
  check_sharded(4, 16, 64, {1, 2, 3, 4}, true);
}

}  // namespace
}  // namespace dmuon
