// newton_schulz.h -- Newton-Schulz orthogonalisation for Muon: direct and Gram-space forms.
//
// For G = U S V^T, every function here returns U f(S/(|G|_F + eps)) V^T, where f is the composition
// of the odd quintics p_t(x) = a_t x + b_t x^3 + c_t x^5, one per (a, b, c) coefficient triple.
// This is NOT the exact polar factor U V^T: five steps map singular values into roughly
// [0.73, 1.124] (Polar Express x1.05) or [0.48, 1.145] (YOU) on [1e-3, 1]; that is by design.
//
// Front end shared by every form:
//   * orientation: if rows > cols (strictly) work on X = G^T so the Gram X X^T is the small side;
//     the result is transposed back. Square matrices are not transposed.
//   * normalisation in fp32 (fp64 for fp64 input): X <- X / (|X|_F + eps), eps added to the norm.
//   * the iteration runs in a compute dtype (fp32 on CPU; fp16 for Gram and bf16 for direct on CUDA,
//     as the reference pipelines do; fp64 input always computes in fp64); output has the input dtype.
//   * leading batch dimensions are supported: a [..., m, n] input is a batch of m x n matrices, each
//     normalised and oriented on its own (e.g. stacked MoE experts).
//
// Direct form (KellerJordan/Moonlight): per step A = X X^T, B = b A + c A A, X <- a X + B X.
// Gram form (Dao-AILab/gram-newton-schulz): iterate on the m x m Gram matrix R = X X^T and the
// accumulated left factor Q; touch the m x n matrix only at restarts and at the end. Restarts
// (default {2}: before 0-based step 2) re-materialise X <- Q X and recompute R from scratch, which
// bounds the growth of rounding errors in half precision. Square inputs go to the direct form
// (Gram saves nothing there and is less accurate).
//
// Non-finite input (NaN or Inf anywhere) is an error by default (c10::Error naming the function and
// the shape), detected from the Frobenius norm that normalisation computes anyway. With
// NsOptions::check_finite = false the NaN propagates to the output instead (no host sync on GPU).
//
// Coefficients and references: Polar Express (Amsel et al., arXiv:2505.16932) first 5 steps with a
// 1.05 safety factor on all five, p(x) -> p(x/1.05); YOU (@YouJiacheng) 5 steps.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <functional>
#include <optional>
#include <string>
#include <vector>


namespace dmuon {

using Coefficient = std::array<double, 3>;  // (a, b, c)
using Coefficients = std::vector<Coefficient>;

// Polar Express, 5 steps, safety factor 1.05 applied to all five: (a/f, b/f^3, c/f^5).
extern const Coefficients POLAR_EXPRESS_COEFFICIENTS;
// The unmodified first five Polar Express steps (the paper's list), for reference and tests.
extern const Coefficients POLAR_EXPRESS_UNMODIFIED_COEFFICIENTS;
extern const Coefficients YOU_COEFFICIENTS;
inline constexpr double kPolarExpressSafetyFactor = 1.05;
inline constexpr double kDefaultNsEps = 1e-7;
inline constexpr int kDefaultNsSteps = 5;

// Options shared by every NS entry point. Unset fields take the defaults documented here.
struct NsOptions {
  // Number of steps; used only when `coefficients` is unset: the first `steps` triples of
  // POLAR_EXPRESS_COEFFICIENTS, the last triple repeated beyond five. With explicit coefficients
  // the list's length is the number of steps.
  int steps = kDefaultNsSteps;
  double eps = kDefaultNsEps;
  std::optional<Coefficients> coefficients;
  // Gram only: 0-based step indices before which the Gram matrix is recomputed; default {2}.
  // Index 0 is ignored (every run starts with a fresh Gram matrix). Must be < number of steps.
  std::optional<std::vector<int>> restart_iterations;
  // Dtype of the iteration. Unset: fp64 for fp64 input, else fp32 on CPU, fp16 (Gram) / bf16
  // (direct) on CUDA.
  std::optional<at::ScalarType> compute_dtype;
  // "auto" | "cublas" (plain GEMMs everywhere; bit-exact across runs) | "syrk" (symmetric rank-k
  // update for X X^T via cuBLAS on CUDA or the system BLAS on CPU, fp32/fp64 compute, 2-D only).
  std::string kernel = "auto";
  bool check_finite = true;
  // CPU, kernel "cublas" (what "auto" resolves to there): matrices whose Gram side is at most 64
  // (float32/float64, a few thousand columns at most) run through a fused kernel -- every NS step of
  // one matrix in a single pass on cache-resident buffers, one register-tiled GEMM loop (AVX2 + FMA
  // where the CPU has them), a stack matrix by matrix over ATen's intra-op threads -- instead of ~30
  // ATen calls whose per-call cost is most of a small matrix's NS time (docs/PERF.md). Same math;
  // deterministic; equal to the ATen path to rounding (float64 ~1e-15 relative). false, or
  // DMUON_NS_CPU_FUSED=0, keeps one ATen call per GEMM.
  bool cpu_fused = true;
  // Gram only: run the Gram algorithm on square inputs too (normally they go to the direct form,
  // which is as fast and more accurate there). For tests and benchmarks.
  bool force_gram = false;
};

// The coefficient list actually used for `opts` (validated: non-empty, finite).
Coefficients resolve_coefficients(const NsOptions& opts);

// Classic parameter-space NS. Any dtype; shape [..., m, n] with m, n >= 1.
at::Tensor direct_newton_schulz(const at::Tensor& G, const NsOptions& opts = {});
at::Tensor direct_newton_schulz(const at::Tensor& G, int steps, double eps = kDefaultNsEps,
                                const std::optional<Coefficients>& coefficients = std::nullopt);

// Gram-space NS on a full matrix (square inputs are computed by the direct form unless
// NsOptions::force_gram).
at::Tensor gram_newton_schulz(const at::Tensor& G, const NsOptions& opts = {});
at::Tensor gram_newton_schulz(const at::Tensor& G, int steps, double eps = kDefaultNsEps,
                              const std::optional<Coefficients>& coefficients = std::nullopt,
                              const std::optional<std::vector<int>>& restart_iterations = std::nullopt,
                              bool deterministic = false);

// Default public entry: Gram form (direct for square matrices).
at::Tensor newton_schulz(const at::Tensor& G, const NsOptions& opts = {});

// Gram NS split into its per-window left factors. The output of gram_newton_schulz(G) equals
//   orient_back( Q_w ... Q_2 Q_1 X0 ) * 1   with X0 = orient(G) / normalizer (cast to compute dtype),
// applied one segment at a time in order (segments[0] first). Reproduces gram_newton_schulz
// bit for bit when applied in the same dtype with the same GEMMs (see apply_gram_factors) for
// rectangular G, or square G with NsOptions::force_gram; a square G without it goes to the direct form
// in gram_newton_schulz, which the factors (always the Gram form) equal only to the iteration's
// rounding (fp64 ~1e-13, fp32 ~1e-4 relative).
struct GramFactors {
  std::vector<at::Tensor> segments;  // each [..., m, m] in the compute dtype, m = min(rows, cols)
  bool transposed = false;           // true when rows > cols: the oriented matrix is G^T
  at::Tensor normalizer;             // |G|_F + eps in fp32 (fp64 for fp64 input), shape [...]
};
GramFactors gram_newton_schulz_factors(const at::Tensor& G, const NsOptions& opts = {});
// Applies the factors to G (normalise, orient, multiply segment by segment, orient back, cast to
// G's dtype). Equals gram_newton_schulz(G, opts) for the same opts (square G: see above).
at::Tensor apply_gram_factors(const at::Tensor& G, const GramFactors& f, const NsOptions& opts = {});

// ---- column-sharded Gram NS (tensor-parallel shard owners) ---------------------------------
// The full logical matrix is oriented like gram_newton_schulz; `transposed` says whether the
// global matrix has rows > cols (decide from the GLOBAL shape, never the local one). The oriented
// local shard (G_local^T if transposed, else G_local) must be a column block of the oriented full
// matrix. Only the scalar |X|_F^2 and the small m x m Gram matrix (initially and at each restart)
// are summed across the group; Q is computed redundantly on every rank; the return value is this
// rank's shard of the full NS output, in G_local's layout and dtype.
//
// The all-reduce is a function (in-place sum over the group), so this layer issues no collective
// itself: comm/ adapts a Communicator (allreduce_sum_fn, and the overloads on a process group in
// dmuon/communicator.h), which counts the bytes and applies the group's timeout.
//
// collective: all ranks of the group, same order; blocking; every rank gets its own valid shard.
using AllReduceSumFn = std::function<void(at::Tensor&)>;  // in-place sum over the group
at::Tensor gram_newton_schulz_distributed_local(const at::Tensor& G_local, const AllReduceSumFn& allreduce_sum,
                                                bool transposed, const NsOptions& opts = {});
// Batched: G_local is [batch, rows, cols], all with the same logical orientation; one all-reduce
// per stage carries the whole batch.
at::Tensor gram_newton_schulz_distributed_local_batched(const at::Tensor& G_local,
                                                        const AllReduceSumFn& allreduce_sum, bool transposed,
                                                        const NsOptions& opts = {});

// ---- configurable backend object (what Muon takes) -------------------------------------------
class NewtonSchulz {
 public:
  // backend: "gram" | "direct"; kernel: "auto" | "cublas" | "syrk". `deterministic` is the
  // back-compat alias for kernel="cublas" (explicit kernel wins; a disagreement is warned about).
  explicit NewtonSchulz(std::string backend = "gram", std::string kernel = "auto",
                        std::optional<Coefficients> coefficients = std::nullopt,
                        std::optional<std::vector<int>> restart_iterations = std::nullopt,
                        bool deterministic = false, std::optional<at::ScalarType> compute_dtype = std::nullopt);

  // NS on a full (un-sharded) matrix or a batch [..., m, n].
  at::Tensor local(const at::Tensor& G, int steps = kDefaultNsSteps) const;

  const std::string& backend() const { return backend_; }
  // The kernel this object will use on `device` ("cublas" or "syrk"), after auto/env resolution.
  std::string resolved_kernel(c10::DeviceType device = c10::DeviceType::CPU) const;
  const NsOptions& options() const { return opts_; }
  // Muon checks all its gradients for NaN/Inf in one host read per step and turns the per-matrix
  // check (one host sync per call on CUDA) off here.
  void set_check_finite(bool on) { opts_.check_finite = on; }
  // One line naming what runs on `device`, e.g. "Gram NS · kernel=cpu-gemm" on the CPU,
  // "Gram NS · kernel=cublas" on CUDA.
  std::string describe(c10::DeviceType device = c10::DeviceType::CPU) const;

 private:
  std::string backend_;
  NsOptions opts_;
};

// Many matrices at once (stacked where it pays): dmuon/ns_runner.h.

// ---- backend status ---------------------------------------------------------------------------
// One NS kernel name the API knows (this build's and the GPU-only ones of other builds), and whether it runs here.
struct KernelStatus {
  std::string name;         // "auto" | "cublas" | "syrk" | "quack" | "cute_sm80"
  bool available = false;   // usable as NewtonSchulz(kernel=name) / DMUON_NS_KERNEL in this build
  std::string detail;       // what it is, and why not when unavailable
};

struct BackendStatus {
  int sm_version = 0;              // compute capability * 10 of the current CUDA device, 0 on CPU
  std::string device;              // "cpu" or "cuda:N"
  std::string auto_choice;         // what kernel="auto" resolves to (after DMUON_NS_KERNEL)
  bool cuda_available = false;
  bool cublas_syrk_available = false;  // CUDA build with a device
  bool cpu_blas_syrk_available = false;
  bool cublas_always_available = true;  // the plain-GEMM path: always there
  std::string env_override;        // value of DMUON_NS_KERNEL ("" when unset)
  // The CuTe-DSL kernels (quack, cute_sm80) are Python packages; this C++ build has neither (always false).
  bool quack_available = false;
  bool cute_sm80_available = false;
  std::vector<KernelStatus> kernels;  // every kernel name, this build's first
};
BackendStatus get_backend_status();
// "Gram NS · kernel=<what runs: cublas | cublas-syrk | cpu-gemm | cpu-blas-syrk> (<SMxx|CPU>, <detail>)"
std::string get_ns_backend();

}  // namespace dmuon
