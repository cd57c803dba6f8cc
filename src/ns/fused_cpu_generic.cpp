// The fused CPU NS kernels compiled for the build's baseline ISA (fused_cpu_kernel.inc).
#include "ns/fused_cpu_table.h"

namespace dmuon::detail::fused_cpu {
namespace generic {
#define FUSED_CPU_ISA "generic"
#include "ns/fused_cpu_kernel.inc"
#undef FUSED_CPU_ISA
}  // namespace generic

const Table* generic_table() { return generic::this_copy(); }

}  // namespace dmuon::detail::fused_cpu
