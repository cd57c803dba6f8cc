// The forward hooks of a dedicated Python model's modules, in C++: one object per hooked module whose
// `pre` and `post` are registered as its forward pre-hook and forward hook (with_kwargs, always_call).
// Each is one pybind11 call that enters or leaves the module's boundary scope (dmuon::forward's, resolved
// once at install time): tensors cross as the Python objects' own at::Tensor, no argument is copied
// unless the boundary changes it, and the runtime's work runs without the GIL.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "dmuon/dedicate.h"

namespace dmuon::python {

namespace {

using namespace pybind11::literals;

bool is_tensor(py::handle h) { return THPVariable_Check(h.ptr()); }

py::object to_python(at::Tensor t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t))); }

// The caller's object when `value` is its very tensor (the boundary changed nothing), else a new one.
py::object passed_on(py::handle original, const at::Tensor& value) {
  if (value.is_same(THPVariable_Unpack(original.ptr()))) return py::reinterpret_borrow<py::object>(original);
  return to_python(value);
}

// `items` as a sequence of `like`'s type: a tuple, a list, a named tuple (its _make), another tuple subclass.
py::object same_sequence(const py::object& like, const py::list& items) {
  if (PyList_CheckExact(like.ptr())) return items;
  if (PyTuple_CheckExact(like.ptr())) return py::tuple(items);
  if (py::hasattr(like, "_make")) return like.attr("_make")(items);
  return py::type::of(like)(items);
}

constexpr int kMaxOutputDepth = 4;  // nesting searched for an output's tensors

bool is_sequence(py::handle h) { return py::isinstance<py::tuple>(h) || py::isinstance<py::list>(h); }

// A dataclass instance (not a dict: a transformers ModelOutput is both, and walked as a dict): its fields'
// names, in declaration order, that are set (an init=False field may not be); empty for anything else. By
// its class (dataclasses.is_dataclass(type(h))): a proxy's or mock's __getattr__ does not make it one.
std::vector<std::string> dataclass_fields(py::handle h) {
  std::vector<std::string> names;
  // (the class attribute first: a cheap test for every leaf of every boundary's inputs and outputs)
  if (h.is_none() || py::isinstance<py::dict>(h) || PyType_Check(h.ptr()) ||
      !py::hasattr(py::type::of(h), "__dataclass_fields__"))
    return names;
  const py::module_ dataclasses = py::module_::import("dataclasses");
  if (!dataclasses.attr("is_dataclass")(py::type::of(h)).cast<bool>()) return names;
  for (py::handle f : dataclasses.attr("fields")(h)) {
    const py::str name = f.attr("name");
    if (py::hasattr(h, name)) names.push_back(name);
  }
  return names;
}

// The tensors of a boundary's output, depth first (a dict's in its order).
void collect(py::handle obj, std::vector<at::Tensor>& out, int depth) {
  if (is_tensor(obj)) {
    out.push_back(THPVariable_Unpack(obj.ptr()));
  } else if (depth < kMaxOutputDepth && is_sequence(obj)) {
    for (py::handle item : obj) collect(item, out, depth + 1);
  } else if (depth < kMaxOutputDepth && py::isinstance<py::dict>(obj)) {
    for (auto item : py::reinterpret_borrow<py::dict>(obj)) collect(item.second, out, depth + 1);
  } else if (depth < kMaxOutputDepth) {
    for (const std::string& name : dataclass_fields(obj)) collect(obj.attr(name.c_str()), out, depth + 1);
  }
}

// `obj` with the tensors collect() found replaced by `values[k...]` where they changed: the caller's
// object where nothing did, else a new one of its type -- a tuple / list / named tuple, or a shallow copy
// of a dict (copy.copy: a ModelOutput keeps its fields and attributes in step) or of a dataclass; the caller's containers
// are never changed (a dict the module keeps, or was given, passes on as it was).
py::object rebuild(const py::object& obj, const std::vector<at::Tensor>& values, size_t& k, int depth) {
  if (is_tensor(obj)) {
    TORCH_CHECK(k < values.size(), "dmuon: a hook boundary's output changed while its forward hook ran (more "
                "tensors than were found in it); return a fresh tuple, list or dict from forward.");
    return passed_on(obj, values[k++]);
  }
  if (depth < kMaxOutputDepth && is_sequence(obj)) {
    py::list items;
    bool changed = false;
    for (py::handle item : py::tuple(obj)) {  // (a snapshot: a list is not read while Python code runs)
      py::object now = rebuild(py::reinterpret_borrow<py::object>(item), values, k, depth + 1);
      changed = changed || !now.is(item);
      items.append(now);
    }
    return changed ? same_sequence(obj, items) : obj;
  }
  if (depth < kMaxOutputDepth && py::isinstance<py::dict>(obj)) {
    std::vector<std::pair<py::object, py::object>> entries, changed;  // (owned: the walk may run Python code)
    for (auto item : py::reinterpret_borrow<py::dict>(obj))
      entries.emplace_back(py::reinterpret_borrow<py::object>(item.first), py::reinterpret_borrow<py::object>(item.second));
    for (auto& [key, value] : entries) {
      py::object now = rebuild(value, values, k, depth + 1);
      if (!now.is(value)) changed.emplace_back(key, now);
    }
    if (changed.empty()) return obj;
    py::object copy = py::module_::import("copy").attr("copy")(obj);
    for (auto& [key, value] : changed) copy[key] = value;
    return copy;
  }
  if (depth < kMaxOutputDepth) {  // a dataclass: a shallow copy with the changed fields (frozen ones too)
    std::vector<std::pair<std::string, py::object>> changed;
    for (const std::string& name : dataclass_fields(obj)) {
      py::object value = obj.attr(name.c_str());
      py::object now = rebuild(value, values, k, depth + 1);
      if (!now.is(value)) changed.emplace_back(name, now);
    }
    if (changed.empty()) return obj;
    py::object copy = py::module_::import("copy").attr("copy")(obj);
    py::object set = py::module_::import("builtins").attr("object").attr("__setattr__");
    for (auto& [name, value] : changed) set(copy, name, value);
    return copy;
  }
  return obj;
}

class ForwardHooks {
 public:
  ForwardHooks(const RuntimeHandle& runtime, const std::string& module, py::object guard)
      : site_(detail::boundary_site(runtime.runtime, module)), guard_(std::move(guard)) {}

  // The forward pre-hook: enters a new scope (a module may run several times in one forward: a stack).
  // On a boundary the first tensor argument (positional, else keyword) carries its post-backward hook and
  // the other tensor arguments get its input cast. Returns None when no argument changed.
  // The core's warnings (TORCH_WARN: a backward that raised was dropped) reach Python as UserWarnings.
  py::object pre(py::handle module, const py::tuple& args, const py::dict& kwargs) {
    torch::PyWarningHandler warnings;
    try {
      return enter(module, args, kwargs);
    } catch (...) {
      warnings.set_in_exception();  // the error wins: the handler must not throw a warning over it
      throw;
    }
  }

  // The forward hook (always_call: also when the forward raised, with output None): leaves the newest
  // scope. On a boundary every tensor of the output -- a tensor, or one inside tuples, lists, named tuples
  // and dicts (a transformers ModelOutput) -- gets its output cast, and those requiring grad the
  // pre-backward hook (a hook on the tensor itself: it runs before the block's backward whichever of them
  // the loss uses, and the caller may still change them in place). Returns None when the output passes on
  // unchanged (no cast: the block's own objects).
  py::object post(py::handle /*module*/, py::handle /*args*/, py::handle /*kwargs*/, const py::object& output) {
    // an earlier pre-hook (FSDP2's, parallelize_module's) raised before this module's: torch still calls
    // this always-called hook, and there is no scope of this call to close
    if (scopes_.empty()) return py::none();
    std::unique_ptr<detail::BoundaryScope> scope = std::move(scopes_.back());
    scopes_.pop_back();
    std::vector<at::Tensor> leaves;
    if (site_.state) collect(output, leaves, 0);
    if (leaves.empty()) {
      {
        py::gil_scoped_release nogil;
        scope->exit();
      }
      return py::none();  // (with the GIL: None's reference count)
    }
    std::vector<at::Tensor> left;
    {
      py::gil_scoped_release nogil;
      left = scope->exit(leaves);
    }
    size_t k = 0;
    py::object out = rebuild(output, left, k, 0);
    TORCH_CHECK(k == left.size(), "dmuon: a hook boundary's output changed while its forward hook ran (fewer "
                "tensors than were found in it); return a fresh tuple, list or dict from forward.");
    return out.is(output) ? py::none() : out;
  }

 private:
  py::object enter(py::handle /*module*/, const py::tuple& args, const py::dict& kwargs) {
    // pushed first: the forward hook (always_call) pops it even when what follows raises
    scopes_.push_back(std::make_unique<detail::BoundaryScope>(site_));
    detail::BoundaryScope& scope = *scopes_.back();
    if (!guard_.is_none()) guard_();  // the root, once per forward: the parameters dmuon hooked are unchanged
    const ssize_t n = static_cast<ssize_t>(args.size());
    ssize_t first = -1;
    for (ssize_t i = 0; i < n && first < 0; ++i)
      if (is_tensor(args[static_cast<size_t>(i)])) first = i;
    py::handle key;
    if (first < 0)
      for (const auto& [k, v] : kwargs)
        if (is_tensor(v)) {
          key = k;
          break;
        }
    // every tensor the block is given, inside sequences and dicts too: one it returns as it is passes through
    std::vector<at::Tensor> given;
    if (site_.state) {
      collect(args, given, 0);
      collect(kwargs, given, 0);
    }
    if (!site_.state || (first < 0 && !key)) {
      {
        py::gil_scoped_release nogil;
        scope.enter();
        for (const at::Tensor& t : given) scope.note_argument(t);
      }
      return py::none();  // (with the GIL: None's reference count)
    }
    const py::object carrier = first >= 0 ? py::object(args[static_cast<size_t>(first)]) : py::object(kwargs[key]);
    at::Tensor entered;
    {
      const at::Tensor input = THPVariable_Unpack(carrier.ptr());
      py::gil_scoped_release nogil;
      entered = scope.enter(input);
    }
    bool changed = false;
    auto pass = [&](py::handle original, const at::Tensor& value) {
      py::object out = passed_on(original, value);
      changed = changed || !out.is(original);
      return out;
    };
    py::tuple new_args(args.size());
    for (ssize_t j = 0; j < n; ++j) {
      const py::handle a = args[static_cast<size_t>(j)];
      new_args[static_cast<size_t>(j)] = j == first ? pass(a, entered)
                                         : j > first && is_tensor(a) ? pass(a, scope.cast_input(THPVariable_Unpack(a.ptr())))
                                                                     : py::reinterpret_borrow<py::object>(a);
    }
    py::dict new_kwargs;
    for (const auto& [k, v] : kwargs)
      new_kwargs[k] = key && k.is(key) ? pass(v, entered)
                      : is_tensor(v)   ? pass(v, scope.cast_input(THPVariable_Unpack(v.ptr())))
                                       : py::reinterpret_borrow<py::object>(v);
    for (const at::Tensor& t : given) scope.note_argument(t);
    if (!changed) return py::none();
    return py::make_tuple(std::move(new_args), std::move(new_kwargs));
  }

  detail::BoundarySite site_;
  py::object guard_;  // None, or (the root) the Python check that no parameter changed dtype or device
  std::vector<std::unique_ptr<detail::BoundaryScope>> scopes_;
};

// Held by each module that holds a parameter whose tensor on this rank is not its whole, current value (a
// placeholder, a slice, a narrowed copy): copying or pickling that module (or a block above it) reaches it.
struct Uncopyable {};

std::string uncopyable() {
  return "a dedicated model (dmuon.dedicate_params), or a module of it holding parameters dmuon trains, cannot be "
         "copied or pickled (copy.deepcopy, torch.save(model)): its parameters live in dmuon's runtime (each Muon matrix whole on its owner rank, 0-element placeholders "
         "elsewhere) and its forward hooks call into it, so a copy would hold neither. Copy the model before "
         "dedicate_params (an EMA copy, say), and save its weights with dmuon.get_model_state_dict(model) (collective: "
         "every rank; full tensors, keyed as in the one-process model).";
}

}  // namespace

void bind_hooks(py::module_& m) {
  py::class_<ForwardHooks>(m, "_ForwardHooks",
                           "The forward pre-hook (`pre`) and forward hook (`post`) of one module of a dedicated model.")
      .def(py::init<const RuntimeHandle&, const std::string&, py::object>(), "runtime"_a, "module"_a, "guard"_a)
      .def("pre", &ForwardHooks::pre)
      .def("post", &ForwardHooks::post)
      // copy.deepcopy(model) and torch.save(model) reach these hooks (the module holds them): say why a
      // dedicated model cannot be copied instead of pickle's "cannot pickle 'dmuon._C._ForwardHooks' object"
      .def("__deepcopy__", [](const ForwardHooks&, py::object) { throw py::type_error(uncopyable()); })
      .def("__reduce_ex__", [](const ForwardHooks&, py::object) { throw py::type_error(uncopyable()); });
  py::class_<Uncopyable>(m, "_Uncopyable",
                         "Held by the modules of a dedicated model whose parameters are not whole and current on "
                         "this rank: copy.deepcopy and pickling of them raise, saying why.")
      .def(py::init<>())
      .def("__deepcopy__", [](const Uncopyable&, py::object) { throw py::type_error(uncopyable()); })
      .def("__reduce_ex__", [](const Uncopyable&, py::object) { throw py::type_error(uncopyable()); });
}

}  // namespace dmuon::python
