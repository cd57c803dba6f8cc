// The fused CPU NS kernels compiled with AVX2 and FMA (src/CMakeLists.txt sets -mavx2 -mfma for this
// file on x86-64); fused_cpu.cpp calls them only where the CPU reports both. Elsewhere this file
// compiles to an empty table.
#include "ns/fused_cpu_table.h"

namespace dmuon::detail::fused_cpu {
#if defined(__AVX2__) && defined(__FMA__)
namespace avx2 {
#define FUSED_CPU_ISA "avx2"
#include "ns/fused_cpu_kernel.inc"
#undef FUSED_CPU_ISA
}  // namespace avx2

const Table* avx2_table() { return avx2::this_copy(); }
#else
const Table* avx2_table() { return nullptr; }
#endif
}  // namespace dmuon::detail::fused_cpu
