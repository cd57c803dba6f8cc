// GEMM building blocks, SYRK paths and the NS backend status.
#include "ns/kernels.h"

#include <c10/util/Exception.h>

#include <sstream>

#include "dmuon/env.h"

#if DMUON_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>
#include <tuple>
#endif

#if DMUON_HAVE_CPU_BLAS
extern "C" {
void ssyrk_(const char* uplo, const char* trans, const int* n, const int* k, const float* alpha, const float* a,
            const int* lda, const float* beta, float* c, const int* ldc);
void dsyrk_(const char* uplo, const char* trans, const int* n, const int* k, const double* alpha, const double* a,
            const int* lda, const double* beta, double* c, const int* ldc);
}
#endif

namespace dmuon::detail::kernels {

namespace {
// 16-bit GEMMs on the CPU: LibTorch's CPU fallback GEMM (used where oneDNN has no bf16/fp16 path,
// e.g. CPUs without AVX-512) accumulates some layouts in the 16-bit type, 6x less accurate than
// with fp32 accumulation and amplified by NS (measured: bf16 direct NS 0.63 relative error against
// float64 on an AVX2 EPYC, 0.010 with fp32 accumulation). So the CPU computes them the way GPU tensor
// cores do: 16-bit inputs, fp32 accumulation, the result rounded to the 16-bit type. Same numbers on
// every CPU; on CUDA the native kernels already accumulate in fp32.
bool widen_on_cpu(const at::Tensor& A) {
  return !A.is_cuda() && (A.scalar_type() == at::kBFloat16 || A.scalar_type() == at::kHalf);
}
}  // namespace

at::Tensor mm(const at::Tensor& A, const at::Tensor& B) {
  if (widen_on_cpu(A)) return kernels::mm(A.to(at::kFloat), B.to(at::kFloat)).to(A.scalar_type());
  return A.dim() == 2 ? at::mm(A, B) : at::bmm(A, B);
}

at::Tensor addmm(const at::Tensor& C, const at::Tensor& A, const at::Tensor& B, double beta, double alpha) {
  if (widen_on_cpu(A))
    return kernels::addmm(C.to(at::kFloat), A.to(at::kFloat), B.to(at::kFloat), beta, alpha).to(A.scalar_type());
  return A.dim() == 2 ? at::addmm(C, A, B, beta, alpha) : at::baddbmm(C, A, B, beta, alpha);
}

namespace {

// The SYRK kernels fill one triangle; mirror it so the result is exactly symmetric.
// Row-major lower triangle valid on entry.
at::Tensor mirror_lower(const at::Tensor& C) { return C.tril().add_(C.tril(-1).transpose(0, 1)); }

#if DMUON_HAVE_CPU_BLAS
template <typename T, typename Fn>
at::Tensor cpu_syrk_impl(const at::Tensor& X, Fn fn) {
  const at::Tensor Xc = X.contiguous();
  const int m = static_cast<int>(Xc.size(0)), k = static_cast<int>(Xc.size(1));
  at::Tensor C = at::empty({m, m}, Xc.options());
  const T one = 1, zero = 0;
  const char uplo = 'U', trans = 'T';
  // Row-major X[m,k] is the column-major k x m matrix Xt (ld k); X X^T = Xt^T Xt. The column-major
  // upper triangle is the row-major lower triangle.
  fn(&uplo, &trans, &m, &k, &one, Xc.data_ptr<T>(), &k, &zero, C.data_ptr<T>(), &m);
  return mirror_lower(C);
}
#endif

#if DMUON_WITH_CUDA
at::Tensor cuda_syrk(const at::Tensor& X) {
  const c10::cuda::CUDAGuard guard(X.device());  // the handle and stream of X's device
  const at::Tensor Xc = X.contiguous();
  const int m = static_cast<int>(Xc.size(0)), k = static_cast<int>(Xc.size(1));
  at::Tensor C = at::empty({m, m}, Xc.options());
  cublasHandle_t h = at::cuda::getCurrentCUDABlasHandle();  // bound to the current stream
  if (Xc.scalar_type() == at::kFloat) {
    const float one = 1, zero = 0;
    TORCH_CUDABLAS_CHECK(cublasSsyrk(h, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_T, m, k, &one, Xc.data_ptr<float>(), k,
                                     &zero, C.data_ptr<float>(), m));
  } else {
    const double one = 1, zero = 0;
    TORCH_CUDABLAS_CHECK(cublasDsyrk(h, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_T, m, k, &one, Xc.data_ptr<double>(), k,
                                     &zero, C.data_ptr<double>(), m));
  }
  return mirror_lower(C);
}
#endif

// Where a BLAS SYRK takes X: a 2-D fp32/fp64 matrix on a device with one.
bool blas_syrk_takes(const at::Tensor& X) {
  const bool f = X.scalar_type() == at::kFloat || X.scalar_type() == at::kDouble;
  if (!f || X.dim() != 2) return false;
  if (X.is_cuda()) return cuda_syrk_available();
  return X.device().is_cpu() && cpu_blas_syrk_available();
}

// The symmetric product of what no BLAS SYRK takes (16-bit inputs, batches): block_triangle_gram.
bool triangle_takes(const at::Tensor& X) {
  return (X.dim() == 2 || X.dim() == 3) && at::isFloatingType(X.scalar_type()) &&
         block_triangle_depth(X.size(-2)) > 0;
}

bool syrk_supports(const at::Tensor& X) { return blas_syrk_takes(X) || triangle_takes(X); }

}  // namespace

int block_triangle_depth(int64_t m) {
  int d = 0;
  while (d < kBlockTriangleMaxDepth && m % (int64_t{2} << d) == 0 && m / (int64_t{2} << d) >= kBlockTriangleMinBlock)
    ++d;
  return d;
}

at::Tensor block_triangle_gram(const at::Tensor& X_in, int depth) {
  TORCH_INTERNAL_ASSERT(X_in.dim() == 2 || X_in.dim() == 3);
  const at::Tensor X = (X_in.dim() == 2 ? X_in.unsqueeze(0) : X_in).contiguous();
  const int64_t B = X.size(0), m = X.size(1), k = X.size(2);
  TORCH_INTERNAL_ASSERT(depth >= 0 && m % (int64_t{1} << depth) == 0);
  at::Tensor C = at::empty({B, m, m}, X.options());
  const int64_t off = C.storage_offset();
  // level l: the 2^l sibling pairs of row blocks of s = m / 2^(l+1) rows (upper A, lower L): the
  // block L A^T below the diagonal and its transpose above, for every pair in one batched GEMM
  for (int l = 0; l < depth; ++l) {
    const int64_t n = int64_t{1} << l, s = m / (2 * n);
    const at::Tensor V = X.view({B, n, 2, s, k});
    const at::Tensor A = V.select(2, 0).reshape({B * n, s, k}), L = V.select(2, 1).reshape({B * n, s, k});
    const at::Tensor P = kernels::mm(L, A.transpose(1, 2)).view({B, n, s, s});
    const std::vector<int64_t> sizes = {B, n, s, s};
    C.as_strided(sizes, {m * m, 2 * s * m + 2 * s, m, 1}, off + s * m).copy_(P);                  // below
    C.as_strided(sizes, {m * m, 2 * s * m + 2 * s, m, 1}, off + s).copy_(P.transpose(-1, -2));  // above
  }
  // the 2^depth diagonal blocks, each made exactly symmetric from its lower triangle
  const int64_t n = int64_t{1} << depth, s = m / n;
  const at::Tensor V = X.view({B * n, s, k});
  const at::Tensor D = kernels::mm(V, V.transpose(1, 2));
  const at::Tensor sym = D.tril().add_(D.tril(-1).transpose(-1, -2)).view({B, n, s, s});
  C.as_strided({B, n, s, s}, {m * m, s * m + s, m, 1}, off).copy_(sym);
  return X_in.dim() == 2 ? C.squeeze(0) : C;
}

bool cpu_blas_syrk_available() { return DMUON_HAVE_CPU_BLAS != 0; }

bool cuda_syrk_available() {
#if DMUON_WITH_CUDA
  return at::cuda::is_available();
#else
  return false;
#endif
}

namespace {
at::Tensor syrk_gram(const at::Tensor& X) {
  if (!blas_syrk_takes(X)) return block_triangle_gram(X, block_triangle_depth(X.size(-2)));
#if DMUON_WITH_CUDA
  if (X.is_cuda()) return cuda_syrk(X);
#endif
#if DMUON_HAVE_CPU_BLAS
  if (X.scalar_type() == at::kFloat) return cpu_syrk_impl<float>(X, ssyrk_);
  return cpu_syrk_impl<double>(X, dsyrk_);
#else
  TORCH_INTERNAL_ASSERT(false, "syrk_gram without a SYRK (blas_syrk_takes is false)");
  return {};
#endif
}

bool always() { return true; }
bool never() { return false; }
std::string syrk_detail() {
  std::string d = "symmetric rank-k update for X X^T (exactly symmetric result): cuBLAS SYRK on CUDA ";
  d += cuda_syrk_available() ? "(available)" : "(not here: no CUDA device or a CPU-only build)";
  d += ", CPU BLAS syrk ";
  d += cpu_blas_syrk_available() ? "(available)" : "(not here: LibTorch's BLAS is not linked for it)";
  return d + " for 2-D fp32/fp64; 16-bit inputs and batches (no BLAS SYRK takes them) compute the lower block "
             "triangle with batched GEMMs (56% of the FLOPs at depth 3; rows a multiple of " +
             std::to_string(2 * kBlockTriangleMinBlock) + "); other inputs take the plain GEMMs";
}
}  // namespace

// The kernel table. Order: the named kernels as get_backend_status() lists them (after "auto"),
// then those the plain path picks by itself.
const std::vector<NsKernel>& kernel_rows() {
  static const std::vector<NsKernel> rows = {
      {"cublas", "cpu-gemm", "cublas", always,
       [] { return std::string("plain GEMMs (cuBLAS on CUDA, the CPU BLAS on the CPU), bit-exact across runs; "
                               "always available"); }},
      {"syrk", "cpu-blas-syrk", "cublas-syrk", always, syrk_detail, syrk_supports, syrk_gram},
      {"quack", "", "", never,
       [] { return std::string("Tri Dao's quack SYRK (SM90+): a Python CuTe-DSL package that this C++ library does "
                               "not bind; on SM90 \"syrk\" (cuBLAS SYRK) or \"auto\" is the equivalent here"); }},
      {"cute_sm80", "", "", never,
       [] { return std::string("the Python DMuon's CuTe-DSL SYRK for SM80/87, not part of this C++ library; on SM80 "
                               "\"syrk\" (cuBLAS SYRK) or \"auto\" is the equivalent here"); }},
      {"", "cpu-fused", "", always,
       [] { return std::string("fused small-matrix NS on the CPU (fused_cpu.h): the plain path's whole iterations "
                               "for matrices up to 64 rows, unless NsOptions::cpu_fused or DMUON_NS_CPU_FUSED=0 "
                               "turn it off"); },
       nullptr, nullptr, /*whole=*/true},
  };
  return rows;
}

const NsKernel* find_kernel(const std::string& name) {
  if (name.empty()) return nullptr;
  for (const NsKernel& k : kernel_rows())
    if (name == k.name) return &k;
  return nullptr;
}

at::Tensor gram(const at::Tensor& X, const std::string& kernel) {
  const NsKernel* k = find_kernel(kernel);
  if (k != nullptr && k->gram != nullptr && (k->supports == nullptr || k->supports(X))) return k->gram(X);
  return kernels::mm(X, X.transpose(-2, -1));
}

std::vector<KernelStatus> kernel_table() {
  std::vector<KernelStatus> out = {
      {"auto", true, "the platform's choice, overridable by DMUON_NS_KERNEL; on CUDA it measures cublas against syrk "
                     "once per shape and dtype and keeps the faster"}};
  for (const NsKernel& k : kernel_rows())
    if (*k.name) out.push_back({k.name, k.available(), k.detail()});
  return out;
}

void validate_kernel_name(const std::string& kernel, const char* who) {
  const NsKernel* k = find_kernel(kernel);
  // a kernel with a Gram product of its own is accepted where it cannot run: it takes the plain GEMMs
  if (kernel == "auto" || (k != nullptr && (k->available() || k->gram != nullptr))) return;
  std::string here;
  for (const KernelStatus& s : kernel_table())
    if (s.available) here += (here.empty() ? "\"" : ", \"") + s.name + "\"";
  TORCH_CHECK_VALUE(k == nullptr, who, ": kernel '", kernel, "' is not in this build: ", k->detail(),
              ". Available here: ", here, " (get_backend_status() lists every kernel).");
  TORCH_CHECK_VALUE(false, who, ": unknown kernel '", kernel, "'. Use \"auto\" (platform choice, overridable by "
              "DMUON_NS_KERNEL), \"cublas\" (plain GEMMs, bit-exact across runs) or \"syrk\" (symmetric rank-k "
              "update for X X^T); available here: ", here, ".");
}

std::string resolve_kernel_for(const std::string& requested, c10::DeviceType device) {
  validate_kernel_name(requested, "newton_schulz");
  if (requested != "auto") return requested;
  const std::string env = env::ns_kernel();
  if (!env.empty() && env != "auto") {
    validate_kernel_name(env, "DMUON_NS_KERNEL");
    return env;
  }
  // Measured (docs/PERF.md): the plain GEMM path is at least as fast as SYRK + mirror on the
  // CPU BLAS this project builds with. So "auto" names the plain path; on CUDA resolve_kernel then
  // measures both kernels per shape where "syrk" takes the input and keeps the faster.
  (void)device;
  return "cublas";
}

std::string kernel_label(const std::string& kernel, c10::DeviceType device) {
  const NsKernel* k = find_kernel(kernel);
  if (k == nullptr) k = find_kernel("cublas");  // the plain path ("cublas" is the API's name for it)
  return device == c10::DeviceType::CUDA ? k->cuda_label : k->cpu_label;
}

#if DMUON_WITH_CUDA
namespace {
// "auto" on CUDA, where "syrk" takes X (cuBLAS SYRK for 2-D fp32/fp64, the block triangle for the
// default 16-bit compute dtypes and batches): time both kernels once per device, shape and dtype
// (CUDA events on the current stream, best of 3 after a warm-up) and keep the faster.
// One host wait per new shape, never again for it.
std::string measured_cuda_choice(const at::Tensor& X) {
  static std::mutex mu;
  static std::map<std::tuple<int, std::vector<int64_t>, int>, std::string> chosen;
  const auto key = std::make_tuple(static_cast<int>(X.device().index()), X.sizes().vec(),
                                   static_cast<int>(X.scalar_type()));
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = chosen.find(key);
    if (it != chosen.end()) return it->second;
  }
  const c10::cuda::CUDAGuard guard(X.device());  // events and stream of X's device
  // inside a CUDA graph capture (a first call of a shape with NsGraphOptions::warmup 0) timing would
  // synchronise and break the capture: the plain GEMMs, not remembered, so a later eager call measures
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(), &capturing) == cudaSuccess &&
      capturing != cudaStreamCaptureStatusNone)
    return "cublas";
  auto best_ms = [&](const std::string& kernel) {
    (void)gram(X, kernel);  // warm-up (cuBLAS heuristics, allocator)
    float best = 1e30f;
    for (int r = 0; r < 3; ++r) {
      at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
      const auto stream = at::cuda::getCurrentCUDAStream();
      start.record(stream);
      (void)gram(X, kernel);
      stop.record(stream);
      stop.synchronize();
      best = std::min(best, start.elapsed_time(stop));
    }
    return best;
  };
  const std::string k = best_ms("syrk") < best_ms("cublas") ? "syrk" : "cublas";
  std::lock_guard<std::mutex> g(mu);
  chosen.emplace(key, k);
  return k;
}
}  // namespace
#endif

std::string resolve_kernel(const std::string& requested, const at::Tensor& X) {
  std::string k = resolve_kernel_for(requested, X.device().type());
#if DMUON_WITH_CUDA
  const std::string env = env::ns_kernel();
  if (requested == "auto" && (env.empty() || env == "auto") && X.is_cuda() && syrk_supports(X))
    k = measured_cuda_choice(X);
#endif
  const NsKernel* row = find_kernel(k);
  if (row != nullptr && row->supports != nullptr && !row->supports(X)) k = "cublas";
  return k;
}

}  // namespace dmuon::detail::kernels

namespace dmuon {

BackendStatus get_backend_status() {
  BackendStatus s;
#if DMUON_WITH_CUDA
  s.cuda_available = at::cuda::is_available();
  if (s.cuda_available) {
    const auto* prop = at::cuda::getCurrentDeviceProperties();
    s.sm_version = prop->major * 10 + prop->minor;
    s.device = "cuda:" + std::to_string(at::cuda::current_device());
  }
#endif
  if (s.device.empty()) s.device = "cpu";
  s.cublas_syrk_available = detail::kernels::cuda_syrk_available();
  s.cpu_blas_syrk_available = detail::kernels::cpu_blas_syrk_available();
  s.env_override = env::ns_kernel();
  s.auto_choice = detail::kernels::resolve_kernel_for(
      "auto", s.cuda_available ? c10::DeviceType::CUDA : c10::DeviceType::CPU);
  s.kernels = detail::kernels::kernel_table();
  return s;
}

std::string get_ns_backend() {
  const BackendStatus s = get_backend_status();
  std::ostringstream o;
  o << "Gram NS · kernel="
    << detail::kernels::kernel_label(s.auto_choice, s.cuda_available ? c10::DeviceType::CUDA : c10::DeviceType::CPU)
    << " (";
  if (s.sm_version > 0)
    o << "SM" << s.sm_version;
  else
    o << "CPU";
  o << ", " << (s.auto_choice == "syrk" ? "symmetric rank-k Gram products" : "universal plain-GEMM path") << ")";
  return o.str();
}

}  // namespace dmuon
