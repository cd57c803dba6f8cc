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

// One NS kernel: a row of the kernel table (kernels.cpp). A kernel supplies the Gram product X X^T
// of the iteration (`gram`), or runs whole iterations (`whole`: the fused CPU kernel, dispatched by
// newton_schulz.cpp). A new kernel is its implementation and one row (docs/ARCHITECTURE.md).
struct NsKernel {
  const char* name;        // as NsOptions::kernel / DMUON_NS_KERNEL select it; "" = never named: the
                           // plain path picks it by itself (the fused CPU kernel)
  const char* cpu_label;   // what runs on each device, as describe() / get_ns_backend() print it
  const char* cuda_label;  //   ("" where it cannot run)
  bool (*available)();     // in this build, on this machine
  std::string (*detail)(); // what it is, and why not when unavailable
  // inputs its Gram product takes (others take the plain GEMMs); null: every input
  bool (*supports)(const at::Tensor& X) = nullptr;
  at::Tensor (*gram)(const at::Tensor& X) = nullptr;  // X X^T; null: the plain GEMMs (or `whole`)
  bool whole = false;                                 // runs whole iterations, not a Gram product
};
const std::vector<NsKernel>& kernel_rows();
const NsKernel* find_kernel(const std::string& name);  // a named row; null for "auto" and unknown names

// X X^T with the resolved kernel: its Gram product where it supports X, else plain GEMMs.
at::Tensor gram(const at::Tensor& X, const std::string& kernel);
void validate_kernel_name(const std::string& kernel, const char* who);  // clear error listing what is here
std::vector<KernelStatus> kernel_table();  // "auto" and every named kernel, with its availability
// The name of what a resolved kernel runs on `device` (its row's label): "cublas" / "cublas-syrk"
// on CUDA, "cpu-gemm" / "cpu-blas-syrk" on the CPU.
std::string kernel_label(const std::string& kernel, c10::DeviceType device);
// "auto" -> DMUON_NS_KERNEL or the platform choice; the result names an available row, and a
// kernel falls back to the plain GEMMs ("cublas") for tensors it does not support.
std::string resolve_kernel(const std::string& requested, const at::Tensor& X);
std::string resolve_kernel_for(const std::string& requested, c10::DeviceType device);
bool cpu_blas_syrk_available();
bool cuda_syrk_available();

// X X^T ([m, k] or [B, m, k], any floating dtype; 16-bit on the CPU through mm's fp32 accumulation)
// from the lower block triangle: the rows split in halves `depth` times, each level's sibling blocks
// L A^T in one batched GEMM (mirrored above the diagonal), the 2^depth diagonal blocks in one more,
// each made exactly symmetric. FLOPs: 1/2 + 1/2^(depth+1) of the full product (depth 3: 56%). The
// "syrk" kernel's product where no BLAS SYRK takes the input (16-bit: the default CUDA compute
// dtypes; batches). m must be a multiple of 2^depth.
at::Tensor block_triangle_gram(const at::Tensor& X, int depth);
inline constexpr int kBlockTriangleMaxDepth = 3;
inline constexpr int64_t kBlockTriangleMinBlock = 128;  // rows per block: smaller GEMMs waste tensor-core tiles
// The depth block_triangle_gram takes for m rows: the largest <= kBlockTriangleMaxDepth leaving blocks of
// at least kBlockTriangleMinBlock rows that divide m evenly; 0: none (the plain product).
int block_triangle_depth(int64_t m);
}  // namespace kernels

}  // namespace dmuon::detail
