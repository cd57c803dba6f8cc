// The Python module dmuon._C: pybind11 (torch's bundled copy, so torch's own casters -- tensors,
// dtypes, ProcessGroup -- are the ones in use) over dmuon's C++ core. One file per area.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <exception>
#include <memory>
#include <utility>
#include <vector>

#include "dmuon/communicator.h"

namespace dmuon {
class Runtime;  // the runtime of a dedicated model (model_view.h)
}  // namespace dmuon

namespace dmuon::python {

namespace py = pybind11;

// C++ exceptions as Python ones: c10::ValueError / std::invalid_argument -> ValueError,
// c10::TypeError -> TypeError, other c10::Error / std::exception -> RuntimeError; the message without
// the C++ backtrace.
void register_errors(py::module_& m);
// dmuon's collective timeout over a Python group: DMUON_COLLECTIVE_TIMEOUT (seconds) when set, else
// the shorter of the group's own timeout and the default group's (what init_process_group was given;
// torch gives new groups its built-in default instead), else dmuon's default. Call with the GIL held.
std::chrono::milliseconds collective_timeout(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Device& device);
// The Python group's backend for `device`, and collective_timeout(); a null group: a null backend.
std::pair<CommPtr, std::chrono::milliseconds> backend_of(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                         const at::Device& device);
// A Communicator over a Python group (null: nullptr), `global_ranks` its members' global ranks in
// group-rank order (for messages).
std::shared_ptr<Communicator> communicator_of(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                              std::vector<int> global_ranks, const at::Device& device,
                                              const std::string& name);
// The runtime of one dedicated Python model (Runtime is internal: an opaque handle, dmuon._C._Runtime).
struct RuntimeHandle {
  std::shared_ptr<Runtime> runtime;
};

// Ctrl-C while the host waits for a CPU collective ends the wait with Interrupted (set_wait_interrupt_check),
// which reaches Python as KeyboardInterrupt (register_errors).
struct Interrupted : std::exception {
  const char* what() const noexcept override;
};
void install_interrupt_check();

// Newton-Schulz: the functions, NewtonSchulz, the coefficient lists, the backend status.
void bind_newton_schulz(py::module_& m);
// Meshes over torch.distributed groups, dedicated ownership of a Python model, boundary scopes, Muon.
void bind_runtime(py::module_& m);
// Gradient clipping: Muon's gradients for Python strategies, segmented (bucket) clipping.
void bind_clip(py::module_& m);
// The forward hooks of a dedicated Python model's modules (after bind_runtime: they take a _Runtime).
void bind_hooks(py::module_& m);

}  // namespace dmuon::python
