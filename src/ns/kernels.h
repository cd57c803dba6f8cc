// Internal: the GEMM building blocks of the NS kernels and the kernel dispatch.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/newton_schulz.h"

namespace dmuon::detail {

// A normalised, oriented input ready for the iteration.
struct Prepared {
  at::Tensor X;                    // [m, n] or [B, m, n], m <= n unless forced, compute dtype
  at::Tensor normalizer;           // |G|_F + eps, shape = G's batch dims
  bool transposed = false;
  at::ScalarType compute_dtype = at::kFloat;
  at::ScalarType orig_dtype = at::kFloat;
  std::vector<int64_t> orig_sizes;
};

at::ScalarType default_compute_dtype(const at::Tensor& G, bool gram);
// Validates, orients (rows > cols, or as forced), normalises in fp32/fp64 (the squared norm goes
// through `norm_allreduce` when given: the column-sharded form) and casts to the compute dtype.
Prepared prepare(const at::Tensor& G, const NsOptions& opts, bool gram, const char* fn,
                 std::optional<bool> force_transposed = std::nullopt,
                 const AllReduceSumFn* norm_allreduce = nullptr);
// Orients back, casts to the input dtype, restores the input shape.
at::Tensor finish(const at::Tensor& X, const Prepared& p);
std::vector<bool> restart_mask(const NsOptions& opts, size_t steps);

using GramFn = std::function<at::Tensor(const at::Tensor&)>;
// Gram-space loop; X is replaced by the final output; returns the window factor segments.
std::vector<at::Tensor> gram_core(at::Tensor& X, const Coefficients& coeffs, const std::vector<bool>& restart,
                                  const GramFn& gram);
at::Tensor direct_core(at::Tensor X, const Coefficients& coeffs, const std::string& kernel);

namespace kernels {
// A @ B for [m,k]x[k,n] or batched [B,m,k]x[B,k,n].
at::Tensor mm(const at::Tensor& A, const at::Tensor& B);
// beta * C + alpha * (A @ B), one fused BLAS call (addmm / baddbmm).
at::Tensor addmm(const at::Tensor& C, const at::Tensor& A, const at::Tensor& B, double beta, double alpha);
// X X^T; kernel "syrk" uses a symmetric rank-k update where available (exactly symmetric result).
at::Tensor gram(const at::Tensor& X, const std::string& kernel);
void validate_kernel_name(const std::string& kernel, const char* who);  // clear error listing what is here
std::vector<KernelStatus> kernel_table();  // every kernel name the API knows, with its availability
// The name of what a resolved kernel ("cublas" | "syrk") runs on `device`: "cublas" /
// "cublas-syrk" on CUDA, "cpu-gemm" / "cpu-blas-syrk" on the CPU.
std::string kernel_label(const std::string& kernel, c10::DeviceType device);
// "auto" -> DMUON_NS_KERNEL or the platform choice; the result is "cublas" or "syrk", and "syrk"
// falls back to "cublas" for tensors it cannot handle (half dtypes, batches, no BLAS).
std::string resolve_kernel(const std::string& requested, const at::Tensor& X);
std::string resolve_kernel_for(const std::string& requested, c10::DeviceType device);
bool cpu_blas_syrk_available();
bool cuda_syrk_available();
}  // namespace kernels

}  // namespace dmuon::detail
