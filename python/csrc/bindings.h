// The Python module dmuon._C: pybind11 (torch's bundled copy, so torch's own casters -- tensors,
// dtypes, ProcessGroup -- are the ones in use) over dmuon's C++ core. One file per area.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace dmuon::python {

namespace py = pybind11;

// C++ exceptions as Python ones: c10::ValueError / std::invalid_argument -> ValueError,
// c10::TypeError -> TypeError, other c10::Error / std::exception -> RuntimeError; the message without
// the C++ backtrace.
void register_errors(py::module_& m);
// Newton-Schulz: the functions, NewtonSchulz, the coefficient lists, the backend status.
void bind_newton_schulz(py::module_& m);
// Meshes over torch.distributed groups, dedicated ownership of a Python model, boundary scopes, Muon.
void bind_runtime(py::module_& m);

}  // namespace dmuon::python
