// dmuon._C: Newton-Schulz (dmuon/newton_schulz.h) for Python, with the API reference's names,
// keyword arguments and defaults.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "dmuon/communicator.h"
#include "dmuon/newton_schulz.h"

namespace dmuon::python {

namespace {

using namespace pybind11::literals;

NsOptions ns_options(int steps, double eps, std::optional<Coefficients> coefficients,
                     std::optional<std::vector<int>> restart_iterations, bool deterministic) {
  NsOptions o;
  o.steps = steps;
  o.eps = eps;
  o.coefficients = std::move(coefficients);
  o.restart_iterations = std::move(restart_iterations);
  if (deterministic) o.kernel = "cublas";
  return o;
}

// The API reference's Gram-space functions ignore `steps`: the iterations are len(coefficients), the
// five defaults when unset (direct_newton_schulz and NewtonSchulz.local keep their steps).
int gram_steps(const std::optional<Coefficients>& coefficients) {
  return coefficients ? static_cast<int>(coefficients->size()) : kDefaultNsSteps;
}

py::dict backend_status_dict() {
  const BackendStatus s = get_backend_status();
  py::list kernels;
  for (const KernelStatus& k : s.kernels)
    kernels.append(py::dict("name"_a = k.name, "available"_a = k.available, "detail"_a = k.detail));
  return py::dict("sm_version"_a = s.sm_version, "device"_a = s.device, "auto_choice"_a = s.auto_choice,
                  "cuda_available"_a = s.cuda_available, "cublas_syrk_available"_a = s.cublas_syrk_available,
                  "cpu_blas_syrk_available"_a = s.cpu_blas_syrk_available,
                  "cublas_always_available"_a = s.cublas_always_available, "env_override"_a = s.env_override,
                  "quack_available"_a = s.quack_available, "cute_sm80_available"_a = s.cute_sm80_available,
                  "kernels"_a = kernels);
}

}  // namespace

void bind_newton_schulz(py::module_& m) {
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.attr("YOU_COEFFICIENTS") = py::cast(YOU_COEFFICIENTS);
  m.attr("POLAR_EXPRESS_COEFFICIENTS") = py::cast(POLAR_EXPRESS_COEFFICIENTS);

  m.def(
      "newton_schulz",
      [](const at::Tensor& G, int /*steps*/, double eps, std::optional<Coefficients> coefficients,
         std::optional<std::vector<int>> restart_iterations) {
        const int steps = gram_steps(coefficients);
        return newton_schulz(G, ns_options(steps, eps, std::move(coefficients), std::move(restart_iterations), false));
      },
      "Orthogonalise G (shape [..., m, n]) by Newton-Schulz: the Gram-space form (direct for square matrices). "
      "steps is ignored, as in the API reference: len(coefficients) iterations (the 5 defaults when unset).",
      "G"_a, "steps"_a = kDefaultNsSteps, "eps"_a = kDefaultNsEps, "coefficients"_a = py::none(),
      "restart_iterations"_a = py::none(), release);
  m.def(
      "direct_newton_schulz",
      [](const at::Tensor& G, int steps, double eps, std::optional<Coefficients> coefficients) {
        return direct_newton_schulz(G, steps, eps, coefficients);
      },
      "Classic parameter-space Newton-Schulz (the Muon/Moonlight formulation).", "G"_a, "steps"_a = kDefaultNsSteps,
      "eps"_a = kDefaultNsEps, "coefficients"_a = py::none(), release);
  m.def(
      "gram_newton_schulz",
      [](const at::Tensor& G, int /*steps*/, double eps, std::optional<Coefficients> coefficients,
         std::optional<std::vector<int>> restart_iterations, bool deterministic) {
        return gram_newton_schulz(G, gram_steps(coefficients), eps, coefficients, restart_iterations, deterministic);
      },
      "Gram-space Newton-Schulz on a full matrix: per-step coefficients, Gram restarts (default [2]); "
      "deterministic=True uses plain GEMMs only. steps is ignored: len(coefficients) iterations.",
      "G"_a, "steps"_a = kDefaultNsSteps, "eps"_a = kDefaultNsEps, "coefficients"_a = py::none(),
      "restart_iterations"_a = py::none(), "deterministic"_a = false, release);
  m.def(
      "gram_newton_schulz_factors",
      [](const at::Tensor& G, int /*steps*/, double eps, std::optional<Coefficients> coefficients,
         std::optional<std::vector<int>> restart_iterations, bool deterministic) {
        GramFactors f;
        {
          const int steps = gram_steps(coefficients);
          py::gil_scoped_release nogil;
          f = gram_newton_schulz_factors(
              G, ns_options(steps, eps, std::move(coefficients), std::move(restart_iterations), deterministic));
        }
        py::tuple segments(f.segments.size());
        for (size_t i = 0; i < f.segments.size(); ++i) segments[i] = py::cast(f.segments[i]);
        return py::make_tuple(segments, f.transposed, f.normalizer);
      },
      "Gram Newton-Schulz split into its per-restart-window left factors: (factor_segments, transposed, "
      "normalizer); applying the segments in order to the normalised, oriented G gives gram_newton_schulz(G) "
      "(a square G: gram_newton_schulz runs the direct form there, equal to the factors' Gram form only to "
      "rounding, ~1e-4 relative in float32).",
      "G"_a, "steps"_a = kDefaultNsSteps, "eps"_a = kDefaultNsEps, "coefficients"_a = py::none(),
      "restart_iterations"_a = py::none(), "deterministic"_a = false);
  m.def(
      "_gram_newton_schulz_distributed_local",
      [](const at::Tensor& G_local, const c10::intrusive_ptr<c10d::ProcessGroup>& group, bool transposed, int /*steps*/,
         double eps, std::optional<Coefficients> coefficients, std::optional<std::vector<int>> restart_iterations,
         bool batched) {
        const auto [backend, timeout] = backend_of(group, G_local.device());  // reads the default group: GIL held
        const int steps = gram_steps(coefficients);  // as gram_newton_schulz: steps is ignored
        const NsOptions o = ns_options(steps, eps, std::move(coefficients), std::move(restart_iterations), false);
        py::gil_scoped_release nogil;
        return batched ? gram_newton_schulz_distributed_local_batched(G_local, backend, transposed, o, timeout)
                       : gram_newton_schulz_distributed_local(G_local, backend, transposed, o, timeout);
      },
      "G_local"_a, "group"_a, "transposed"_a, "steps"_a, "eps"_a, "coefficients"_a, "restart_iterations"_a,
      "batched"_a);

  py::class_<NewtonSchulz>(m, "NewtonSchulz",
                           "A configured Newton-Schulz: backend 'gram' (default) or 'direct', kernel 'auto' | "
                           "'cublas' | 'syrk' (DMUON_NS_KERNEL overrides 'auto'), coefficients, Gram restart "
                           "iterations; deterministic=True is kernel='cublas'. Pass it to Muon(ns_backend=...).")
      .def(py::init([](const std::string& backend, const std::string& kernel, std::optional<Coefficients> coefficients,
                       std::optional<std::vector<int>> restart_iterations, bool deterministic) {
             torch::PyWarningHandler warnings;  // the core's TORCH_WARN as a Python UserWarning (warnings.warn)
             try {
               return NewtonSchulz(backend, kernel, std::move(coefficients), std::move(restart_iterations),
                                   deterministic);
             } catch (...) {
               warnings.set_in_exception();  // the error wins: the handler must not throw a warning over it
               throw;
             }
           }),
           "backend"_a = "gram", "kernel"_a = "auto", "coefficients"_a = py::none(),
           "restart_iterations"_a = py::none(), "deterministic"_a = false)
      .def("local", &NewtonSchulz::local, "NS of a full (un-sharded) matrix or a batch [..., m, n].", "G"_a,
           "steps"_a = kDefaultNsSteps, release)
      .def_property_readonly("backend", &NewtonSchulz::backend)
      .def_property_readonly("kernel", [](const NewtonSchulz& n) { return n.options().kernel; })
      .def_property_readonly("coefficients", [](const NewtonSchulz& n) { return n.options().coefficients; })
      .def_property_readonly("restart_iterations",
                             [](const NewtonSchulz& n) { return n.options().restart_iterations; })
      .def(
          "resolved_kernel",
          [](const NewtonSchulz& n, const std::string& device) { return n.resolved_kernel(at::Device(device).type()); },
          "The kernel this object runs on `device` ('cpu' or 'cuda'), after 'auto' and DMUON_NS_KERNEL.",
          "device"_a = "cpu")
      .def(
          "describe",
          [](const NewtonSchulz& n, const std::string& device) { return n.describe(at::Device(device).type()); },
          "One line naming what runs on `device`, e.g. 'Gram NS · kernel=cpu-gemm'.", "device"_a = "cpu")
      .def("__repr__", [](const NewtonSchulz& n) {
        return "NewtonSchulz(backend='" + n.backend() + "', kernel='" + n.options().kernel + "')";
      });

  m.def("get_ns_backend", &get_ns_backend,
        "One line naming the NS kernel that runs here, e.g. 'Gram NS · kernel=cpu-gemm (CPU, universal plain-GEMM "
        "path)'.");
  m.def("get_backend_status", &backend_status_dict,
        "The NS kernel dispatch state as a dict: sm_version, auto_choice, availability flags, and 'kernels' (every "
        "kernel name with its availability and what it is).");
}

}  // namespace dmuon::python
