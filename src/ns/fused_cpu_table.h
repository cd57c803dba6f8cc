// Internal: the entry points of the fused CPU NS kernels (fused_cpu_kernel.inc), one table per ISA.
// This header is included by the kernel TUs, so it may include nothing (see the .inc's note).
#pragma once

namespace dmuon::detail::fused_cpu {

struct Table {
  const char* isa;  // "avx2" | "generic"
  void (*direct_f32)(float* X, float* work, int M, int N, const double* coeffs, int steps);
  void (*direct_f64)(double* X, double* work, int M, int N, const double* coeffs, int steps);
  int (*gram_f32)(float* X, float* work, int m, int M, int N, const double* coeffs, const unsigned char* restart,
                  int steps, float* segments);
  int (*gram_f64)(double* X, double* work, int m, int M, int N, const double* coeffs, const unsigned char* restart,
                  int steps, double* segments);
  void (*apply_f32)(const float* Q, float* X, float* work, int M, int N);
  void (*apply_f64)(const double* Q, double* X, double* work, int M, int N);
};

const Table* generic_table();
const Table* avx2_table();  // nullptr where this build has no AVX2 copy (not x86-64)

}  // namespace dmuon::detail::fused_cpu
