// Newton-Schulz kernels: direct and Gram forms, factor segments, column-sharded Gram.
// The math follows shared/docs/NEWTON_SCHULZ.md; see include/dmuon/newton_schulz.h for contracts.
#include "dmuon/newton_schulz.h"

#include "dmuon/env.h"
#include "dmuon/host_sync.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <set>
#include <sstream>

#include "ns/fused_cpu.h"
#include "ns/kernels.h"

namespace dmuon {

// ---- coefficients ------------------------------------------------------------------------------
const Coefficients POLAR_EXPRESS_UNMODIFIED_COEFFICIENTS = {
    {8.28721201814563, -23.595886519098837, 17.300387312530933},
    {4.107059111542203, -2.9478499167379106, 0.5448431082926601},
    {3.9486908534822946, -2.908902115962949, 0.5518191394370137},
    {3.3184196573706015, -2.488488024314874, 0.51004894012372},
    {2.300652019954817, -1.6689039845747493, 0.4188073119525673},
};

namespace {
Coefficients apply_safety_factor(const Coefficients& in, double f) {
  Coefficients out;
  out.reserve(in.size());
  for (const auto& [a, b, c] : in) out.push_back({a / f, b / std::pow(f, 3), c / std::pow(f, 5)});
  return out;
}
}  // namespace

const Coefficients POLAR_EXPRESS_COEFFICIENTS =
    apply_safety_factor(POLAR_EXPRESS_UNMODIFIED_COEFFICIENTS, kPolarExpressSafetyFactor);

const Coefficients YOU_COEFFICIENTS = {
    {4.0848, -6.8946, 2.9270}, {3.9505, -6.3029, 2.6377}, {3.7418, -5.5913, 2.3037},
    {2.8769, -3.1427, 1.2046}, {2.8366, -3.0525, 1.2012},
};

Coefficients resolve_coefficients(const NsOptions& opts) {
  Coefficients coeffs;
  if (opts.coefficients) {
    coeffs = *opts.coefficients;
    TORCH_CHECK_VALUE(!coeffs.empty(),
                "newton_schulz: the coefficient list is empty. Pass at least one (a, b, c) triple, or leave "
                "`coefficients` unset to use POLAR_EXPRESS_COEFFICIENTS.");
  } else {
    TORCH_CHECK_VALUE(opts.steps >= 1, "newton_schulz: invalid steps: ", opts.steps,
                ". Must be >= 1 (the number of Newton-Schulz iterations).");
    const auto& base = POLAR_EXPRESS_COEFFICIENTS;
    for (int i = 0; i < opts.steps; ++i) coeffs.push_back(base[std::min<size_t>(i, base.size() - 1)]);
  }
  for (size_t i = 0; i < coeffs.size(); ++i)
    for (double v : coeffs[i])
      TORCH_CHECK_VALUE(std::isfinite(v), "newton_schulz: coefficient triple ", i, " contains a non-finite value (", v,
                  "). Every (a, b, c) must be finite.");
  TORCH_CHECK_VALUE(std::isfinite(opts.eps) && opts.eps >= 0, "newton_schulz: invalid eps: ", opts.eps,
              ". Must be finite and >= 0 (1e-7 is the default).");
  return coeffs;
}

namespace detail {
namespace {

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

void validate_input(const at::Tensor& G, const char* fn) {
  TORCH_CHECK_VALUE(G.defined(), fn, ": the input tensor is undefined (a gradient that was never computed?).");
  TORCH_CHECK_VALUE(G.dim() >= 2, fn, ": expected a matrix [rows, cols] or a batch [..., rows, cols], got a ", G.dim(),
              "-D tensor of shape ", G.sizes(),
              ". Newton-Schulz needs matrices: route vectors (biases, norms) to AdamW, and view conv weights as "
              "[out, in*kh*kw].");
  TORCH_CHECK_VALUE(G.size(-1) > 0 && G.size(-2) > 0, fn, ": the matrix has an empty dimension (shape ", G.sizes(),
              ").");
  TORCH_CHECK_VALUE(is_float_type(G.scalar_type()), fn, ": unsupported dtype ", G.scalar_type(),
              "; expected float16, bfloat16, float32 or float64.");
}

}  // namespace

at::ScalarType default_compute_dtype(const at::Tensor& G, bool gram) {
  if (G.scalar_type() == at::kDouble) return at::kDouble;
  if (G.is_cuda()) return gram ? at::kHalf : at::kBFloat16;
  return at::kFloat;
}

Prepared prepare(const at::Tensor& G, const NsOptions& opts, bool gram, const char* fn,
                 std::optional<bool> force_transposed, const AllReduceSumFn* norm_allreduce) {
  validate_input(G, fn);
  const int64_t rows = G.size(-2), cols = G.size(-1);
  Prepared p;
  p.orig_sizes = G.sizes().vec();
  p.orig_dtype = G.scalar_type();
  p.transposed = force_transposed ? *force_transposed : rows > cols;
  p.compute_dtype = opts.compute_dtype ? *opts.compute_dtype : default_compute_dtype(G, gram);
  TORCH_CHECK_VALUE(is_float_type(p.compute_dtype), fn, ": unsupported compute dtype ", p.compute_dtype,
              "; expected float16, bfloat16, float32 or float64.");
  const auto norm_dtype = G.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor X = G.reshape({-1, rows, cols}).to(norm_dtype);
  if (p.transposed) X = X.transpose(-2, -1);
  const auto sum_squares = [&](const at::Tensor& x) {
    at::Tensor sq = x.square().sum({-2, -1}, /*keepdim=*/true);
    if (norm_allreduce) (*norm_allreduce)(sq);  // (every rank sees the same sums: they branch alike below)
    return sq;
  };
  at::Tensor sq = sum_squares(X);
  // One host read (where one is made): the sums are finite, and no normaliser is 0 (a zero matrix with
  // eps = 0 would give 0/0). A CPU tensor is read in place (no sync, no op).
  const auto verdict = [&](const at::Tensor& s) -> std::array<bool, 2> {
    if (s.is_cpu() && s.is_contiguous()) {
      bool finite = true, positive = true;
      const auto n = s.numel();
      for (int64_t i = 0; i < n; ++i) {
        const double v = s.scalar_type() == at::kDouble ? s.data_ptr<double>()[i] : s.data_ptr<float>()[i];
        finite = finite && std::isfinite(v);
        positive = positive && std::sqrt(v) + opts.eps > 0;
      }
      return {finite, positive};
    }
    const at::Tensor ok = detail::read_to_host(at::stack({at::isfinite(s).all(), s.sqrt().add_(opts.eps).gt(0).all()}));
    return {ok[0].item<bool>(), ok[1].item<bool>()};
  };
  std::optional<std::array<bool, 2>> checked;
  if (opts.check_finite || sq.is_cpu()) checked = verdict(sq);
  // A finite matrix whose float32 squares overflow (|g| > ~1.8e19): Newton-Schulz is scale invariant, so
  // it is normalised with its sums in float64 (rare: decided by the read above, never an extra sync).
  if (checked && !(*checked)[0] && norm_dtype == at::kFloat) {
    X = X.to(at::kDouble);
    sq = sum_squares(X);
    checked = verdict(sq);
  }
  p.normalizer = sq.sqrt().add_(opts.eps);
  if (opts.check_finite) {
    TORCH_CHECK((*checked)[0], fn, ": the input contains NaN or Inf (shape ", G.sizes(),
                "). A non-finite gradient usually means the loss diverged: lower the learning rate or clip "
                "gradients. In C++ NsOptions::check_finite=false lets NaN propagate instead.");
    TORCH_CHECK_VALUE((*checked)[1], fn, ": a matrix of the input (shape ", G.sizes(),
                      ") is all zeros and eps is 0, so normalising it would divide 0 by 0 (NaN). Pass eps > 0 "
                      "(the default is ", kDefaultNsEps, ").");
  }
  X = (X / p.normalizer).to(p.compute_dtype).contiguous();
  if (X.size(0) == 1) X = X.squeeze(0);  // single matrix: 2-D GEMMs
  p.X = X;
  p.normalizer = p.normalizer.to(norm_dtype).reshape(at::IntArrayRef(p.orig_sizes).slice(0, p.orig_sizes.size() - 2));
  return p;
}

at::Tensor finish(const at::Tensor& X, const Prepared& p) {
  at::Tensor out = X;
  if (p.transposed) out = out.transpose(-2, -1);
  return out.to(p.orig_dtype).reshape(p.orig_sizes).contiguous();
}

std::vector<bool> restart_mask(const NsOptions& opts, size_t steps) {
  std::vector<bool> mask(steps, false);
  if (!opts.restart_iterations) {  // default {2}; with fewer than 3 steps there is nothing to restart
    if (steps > 2) mask[2] = true;
    return mask;
  }
  for (int r : *opts.restart_iterations) {
    TORCH_CHECK_VALUE(r >= 0 && static_cast<size_t>(r) < steps, "gram_newton_schulz: restart iteration ", r,
                " is out of range for ", steps, " steps. Restart indices are 0-based steps in [0, ", steps - 1,
                "] before which the Gram matrix is recomputed ({2} is the default; {} disables restarts).");
    if (r > 0) mask[r] = true;
  }
  return mask;
}

std::vector<at::Tensor> gram_core(at::Tensor& X, const Coefficients& coeffs, const std::vector<bool>& restart,
                                  const GramFn& gram) {
  std::vector<at::Tensor> segments;
  const size_t T = coeffs.size();
  at::Tensor R = gram(X);
  at::Tensor Q;
  for (size_t i = 0; i < T; ++i) {
    const auto [a, b, c] = coeffs[i];
    if (i > 0 && restart[i]) {
      segments.push_back(Q);
      X = kernels::mm(Q, X);
      R = gram(X);
      Q = at::Tensor();
    }
    at::Tensor Z = kernels::addmm(R, R, R, b, c);  // b R + c R^2
    if (!Q.defined()) {
      Q = Z.clone();
      Q.diagonal(0, -2, -1).add_(a);  // window start: Z + aI, no GEMM
    } else {
      Q = kernels::addmm(Q, Q, Z, a, 1.0);  // Q Z + a Q
    }
    if (i + 1 < T && !restart[i + 1]) {
      at::Tensor RZ = kernels::addmm(R, R, Z, a, 1.0);  // R q(R)
      R = kernels::addmm(RZ, Z, RZ, a, 1.0);           // q(R) R q(R)
    }
  }
  segments.push_back(Q);
  X = kernels::mm(Q, X);
  return segments;
}

at::Tensor direct_core(at::Tensor X, const Coefficients& coeffs, const std::string& kernel) {
  for (const auto& [a, b, c] : coeffs) {
    at::Tensor A = kernels::gram(X, kernel);       // X X^T
    at::Tensor B = kernels::addmm(A, A, A, b, c);  // b A + c A A
    X = kernels::addmm(X, B, X, a, 1.0);           // a X + B X
  }
  return X;
}

}  // namespace detail

// ---- public entry points ---------------------------------------------------------------------------
at::Tensor direct_newton_schulz(const at::Tensor& G, const NsOptions& opts) {
  const Coefficients coeffs = resolve_coefficients(opts);
  detail::Prepared p = detail::prepare(G, opts, /*gram=*/false, "direct_newton_schulz");
  const std::string kernel = detail::kernels::resolve_kernel(opts.kernel, p.X);
  if (detail::fused_cpu::applies(opts, kernel, p.X)) return detail::finish(detail::fused_cpu::direct(p.X, coeffs), p);
  return detail::finish(detail::direct_core(p.X, coeffs, kernel), p);
}

at::Tensor direct_newton_schulz(const at::Tensor& G, int steps, double eps,
                                const std::optional<Coefficients>& coefficients) {
  NsOptions o;
  o.steps = steps;
  o.eps = eps;
  o.coefficients = coefficients;
  return direct_newton_schulz(G, o);
}

at::Tensor gram_newton_schulz(const at::Tensor& G, const NsOptions& opts) {
  detail::validate_input(G, "gram_newton_schulz");
  if (!opts.force_gram && G.size(-1) == G.size(-2)) {
    NsOptions d = opts;  // square: Gram saves nothing and is less accurate
    if (!d.compute_dtype) d.compute_dtype = detail::default_compute_dtype(G, /*gram=*/false);
    return direct_newton_schulz(G, d);
  }
  const Coefficients coeffs = resolve_coefficients(opts);
  const std::vector<bool> restart = detail::restart_mask(opts, coeffs.size());
  detail::Prepared p = detail::prepare(G, opts, /*gram=*/true, "gram_newton_schulz");
  const std::string kernel = detail::kernels::resolve_kernel(opts.kernel, p.X);
  if (detail::fused_cpu::applies(opts, kernel, p.X)) return detail::finish(detail::fused_cpu::gram(p.X, coeffs, restart, nullptr), p);
  at::Tensor X = p.X;
  detail::gram_core(X, coeffs, restart, [&](const at::Tensor& x) { return detail::kernels::gram(x, kernel); });
  return detail::finish(X, p);
}

at::Tensor gram_newton_schulz(const at::Tensor& G, int steps, double eps,
                              const std::optional<Coefficients>& coefficients,
                              const std::optional<std::vector<int>>& restart_iterations, bool deterministic) {
  NsOptions o;
  o.steps = steps;
  o.eps = eps;
  o.coefficients = coefficients;
  o.restart_iterations = restart_iterations;
  if (deterministic) o.kernel = "cublas";
  return gram_newton_schulz(G, o);
}

at::Tensor newton_schulz(const at::Tensor& G, const NsOptions& opts) { return gram_newton_schulz(G, opts); }

GramFactors gram_newton_schulz_factors(const at::Tensor& G, const NsOptions& opts) {
  const Coefficients coeffs = resolve_coefficients(opts);
  const std::vector<bool> restart = detail::restart_mask(opts, coeffs.size());
  detail::Prepared p = detail::prepare(G, opts, /*gram=*/true, "gram_newton_schulz_factors");
  const std::string kernel = detail::kernels::resolve_kernel(opts.kernel, p.X);
  at::Tensor X = p.X;
  GramFactors f;
  if (detail::fused_cpu::applies(opts, kernel, X))
    detail::fused_cpu::gram(X, coeffs, restart, &f.segments);
  else
    f.segments =
        detail::gram_core(X, coeffs, restart, [&](const at::Tensor& x) { return detail::kernels::gram(x, kernel); });
  f.transposed = p.transposed;
  f.normalizer = p.normalizer;
  return f;
}

at::Tensor apply_gram_factors(const at::Tensor& G, const GramFactors& f, const NsOptions& opts) {
  detail::Prepared p = detail::prepare(G, opts, /*gram=*/true, "apply_gram_factors", f.transposed);
  // The same GEMMs as gram_newton_schulz with these options, so the result is bit for bit its output.
  if (detail::fused_cpu::applies(opts, detail::kernels::resolve_kernel(opts.kernel, p.X), p.X))
    return detail::finish(detail::fused_cpu::apply(p.X, f.segments), p);
  at::Tensor X = p.X;
  for (const auto& seg : f.segments) X = detail::kernels::mm(seg, X);
  return detail::finish(X, p);
}

// ---- column-sharded Gram NS -----------------------------------------------------------------------
namespace {
at::Tensor distributed_impl(const at::Tensor& G_local, const AllReduceSumFn& allreduce_sum, bool transposed,
                            const NsOptions& opts, const char* fn) {
  TORCH_CHECK(static_cast<bool>(allreduce_sum), fn, ": no all-reduce function was given.");
  const Coefficients coeffs = resolve_coefficients(opts);
  const std::vector<bool> restart = detail::restart_mask(opts, coeffs.size());
  detail::Prepared p = detail::prepare(G_local, opts, /*gram=*/true, fn, transposed, &allreduce_sum);
  at::Tensor X = p.X;
  detail::gram_core(X, coeffs, restart, [&](const at::Tensor& x) {
    at::Tensor R = detail::kernels::gram(x, "cublas");
    allreduce_sum(R);
    return R;
  });
  return detail::finish(X, p);
}

}  // namespace

at::Tensor gram_newton_schulz_distributed_local(const at::Tensor& G_local, const AllReduceSumFn& allreduce_sum,
                                                bool transposed, const NsOptions& opts) {
  return distributed_impl(G_local, allreduce_sum, transposed, opts, "gram_newton_schulz_distributed_local");
}

at::Tensor gram_newton_schulz_distributed_local_batched(const at::Tensor& G_local, const AllReduceSumFn& allreduce_sum,
                                                        bool transposed, const NsOptions& opts) {
  TORCH_CHECK_VALUE(G_local.dim() == 3, "gram_newton_schulz_distributed_local_batched: expected a 3-D tensor [batch, rows, "
              "cols], got shape ", G_local.sizes(), ". Use gram_newton_schulz_distributed_local for one matrix.");
  return distributed_impl(G_local, allreduce_sum, transposed, opts, "gram_newton_schulz_distributed_local_batched");
}

// ---- NewtonSchulz ---------------------------------------------------------------------------------
NewtonSchulz::NewtonSchulz(std::string backend, std::string kernel, std::optional<Coefficients> coefficients,
                           std::optional<std::vector<int>> restart_iterations, bool deterministic,
                           std::optional<at::ScalarType> compute_dtype)
    : backend_(std::move(backend)) {
  TORCH_CHECK_VALUE(backend_ == "gram" || backend_ == "direct", "NewtonSchulz: unknown backend '", backend_,
              "'. Use \"gram\" (Gram-space NS with restarts, the default) or \"direct\" (classic NS).");
  detail::kernels::validate_kernel_name(kernel, "NewtonSchulz");
  if (deterministic) {
    if (kernel == "auto") {
      kernel = "cublas";
    } else if (kernel != "cublas") {
      TORCH_WARN("NewtonSchulz: deterministic=true asks for kernel=\"cublas\" but kernel=\"", kernel,
                 "\" was given explicitly; the explicit kernel wins.");
    }
  }
  opts_.kernel = kernel;
  opts_.coefficients = std::move(coefficients);
  opts_.restart_iterations = std::move(restart_iterations);
  opts_.compute_dtype = compute_dtype;
  if (opts_.coefficients) resolve_coefficients(opts_);  // validate early
  if (opts_.restart_iterations && backend_ == "gram") {
    // against the coefficients' count when given; else against the most steps any caller may ask for (the
    // count is the caller's: Muon checks each group's ns_steps)
    detail::restart_mask(opts_, opts_.coefficients ? resolve_coefficients(opts_).size() : size_t{1000});
  }
}

at::Tensor NewtonSchulz::local(const at::Tensor& G, int steps) const {
  NsOptions o = opts_;
  o.steps = steps;
  return backend_ == "gram" ? gram_newton_schulz(G, o) : direct_newton_schulz(G, o);
}

std::string NewtonSchulz::resolved_kernel(c10::DeviceType device) const {
  return detail::kernels::resolve_kernel_for(opts_.kernel, device);
}

std::string NewtonSchulz::describe(c10::DeviceType device) const {
  std::ostringstream s;
  s << (backend_ == "gram" ? "Gram NS" : "Direct NS")
    << " · kernel=" << detail::kernels::kernel_label(resolved_kernel(device), device);
  return s.str();
}

}  // namespace dmuon

