// Internal: fused small-matrix Newton-Schulz on the CPU (the "fused" kernel).
//
// ATen runs each of NS's ~30 small GEMMs and element-wise ops as its own call: for a 32 x 32 matrix
// the per-call cost (dispatch, allocation, BLAS setup) is ~10x the multiply-adds (docs/PERF.md). The
// fused kernel runs all steps of one matrix on buffers that stay in cache, with one register-tiled
// GEMM loop (AVX2 + FMA where the CPU has them, chosen at run time), and a stacked batch matrix by
// matrix (in parallel over ATen's intra-op threads). Same recursions as detail::direct_core and
// detail::gram_core; results agree with the ATen path to rounding (float64 ~1e-15).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "dmuon/newton_schulz.h"

namespace dmuon::detail::fused_cpu {

// Shapes the fused kernel takes: Gram side (rows after orientation) up to kMaxSide, up to kMaxElems
// elements per matrix (the working set, ~3 m n elements, then fits the L2 cache); bigger matrices
// are FLOP-bound and ATen's BLAS GEMMs are faster there.
inline constexpr int64_t kMaxSide = 64;
inline constexpr int64_t kMaxElems = 64 * 1024;

// X: a prepared NS input ([m, n] or [B, m, n], m <= n): CPU, float32 or float64, within the limits.
bool supports(const at::Tensor& X);
// Whether NS of the prepared X with `opts` and the resolved `kernel` runs here: supports(X), kernel
// "cublas" (the plain-GEMM path), NsOptions::cpu_fused and DMUON_NS_CPU_FUSED not 0.
bool applies(const NsOptions& opts, const std::string& kernel, const at::Tensor& X);
// "avx2" or "generic": the copy of the kernels this CPU runs.
const char* isa();
// Tests: run the "generic" or "avx2" copy ("" = the CPU's best). False where that copy cannot run
// here. Process-wide; not for concurrent use with running NS.
bool select_isa(const std::string& isa);

// Direct NS of a prepared X (a new tensor; X is not modified).
at::Tensor direct(const at::Tensor& X, const Coefficients& coeffs);
// Gram NS of a prepared X; segments (nullable) receives each window's left factor, [.., m, m].
at::Tensor gram(const at::Tensor& X, const Coefficients& coeffs, const std::vector<bool>& restart,
                std::vector<at::Tensor>* segments);
// X <- Q_w ... Q_1 X with the factors gram() returned: bit for bit gram()'s output.
at::Tensor apply(const at::Tensor& X, const std::vector<at::Tensor>& segments);

}  // namespace dmuon::detail::fused_cpu
