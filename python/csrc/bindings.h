// The Python module dmuon._C: pybind11 (torch's bundled copy, so torch's own casters -- tensors,
// dtypes, ProcessGroup -- are the ones in use) over dmuon's C++ core. One file per area.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
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
// the C++ backtrace. A PythonCallerError is raised again as the Python exception it carries.
void register_errors(py::module_& m);

// A ValueError or TypeError (or a subclass) that a Python callable dmuon calls (a predicate, a resolver,
// a policy function) raised: a caller mistake, so the C++ core treats it as one (std::invalid_argument:
// the other ranks of a collective setup raise ValueError too), and Python gets the original exception
// back, type, message and traceback (register_errors).
struct PythonCallerError : std::invalid_argument {
  explicit PythonCallerError(py::error_already_set e)
      : std::invalid_argument(e.what()), error(std::make_shared<py::error_already_set>(std::move(e))) {}
  std::shared_ptr<py::error_already_set> error;
};

// `f` (a Python callable behind a std::function) with its ValueError / TypeError turned into a
// PythonCallerError; other exceptions pass unchanged. An empty `f` stays empty.
template <class R, class... A>
std::function<R(A...)> caller_mistakes_kept(std::function<R(A...)> f) {
  if (!f) return f;
  return [f = std::move(f)](A... a) -> R {
    try {
      return f(std::forward<A>(a)...);
    } catch (py::error_already_set& e) {
      py::gil_scoped_acquire gil;
      if (e.matches(PyExc_ValueError) || e.matches(PyExc_TypeError)) throw PythonCallerError(std::move(e));
      throw;
    }
  };
}
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
