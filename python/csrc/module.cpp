// dmuon._C: the module's entry point and the translation of C++ errors into Python exceptions.
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <stdexcept>

#include "bindings.h"
#include "dmuon/muon.h"

namespace dmuon::python {

void register_errors(py::module_& m) {
  // Muon.step's verdict on a non-finite gradient (every rank raises it): a RuntimeError, told apart by type
  static PyObject* non_finite = PyErr_NewExceptionWithDoc(
      "dmuon.NonFiniteGradientError",
      "Raised by Muon.step on every rank when a dedicated matrix's averaged gradient holds NaN or Inf on any "
      "rank: that matrix was skipped, the step's other updates were applied.",
      PyExc_RuntimeError, nullptr);
  if (non_finite == nullptr) throw py::error_already_set();
  m.attr("NonFiniteGradientError") = py::handle(non_finite);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Interrupted&) {
      // Python's own SIGINT handler ran too: let it raise (KeyboardInterrupt, or what the user installed)
      if (PyErr_CheckSignals() == 0) PyErr_SetNone(PyExc_KeyboardInterrupt);
    } catch (const PythonCallerError& e) {
      e.error->restore();  // the user's own exception, as their callable raised it
    } catch (const NonFiniteGradientError& e) {
      PyErr_SetString(non_finite, e.what_without_backtrace());
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
    // anything else: pybind11's own translators (std::exception -> RuntimeError, ...)
  });
}

}  // namespace dmuon::python

PYBIND11_MODULE(_C, m) {
  m.doc() = "dmuon's native core (use the `dmuon` package, not this module)";
  m.attr("__version__") = DMUON_VERSION;
  // the torch this module was compiled against: dmuon/__init__.py refuses another minor version
  m.attr("_torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
  dmuon::python::register_errors(m);
  dmuon::python::bind_newton_schulz(m);
  dmuon::python::bind_runtime(m);
  dmuon::python::bind_clip(m);
  dmuon::python::bind_hooks(m);
  dmuon::python::install_interrupt_check();
}
