// ModelView: its checks and the LibTorch adapter (see include/dmuon/model_view.h).
#include "dmuon/model_view.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/parameterdict.h>
#include <torch/nn/modules/container/parameterlist.h>

#include <map>
#include <set>

#include "dmuon/tensor_parallel.h"

namespace dmuon {

void ModelView::check(int rank) const {
  if (precheck) precheck();
  std::set<std::string> names;
  std::set<const c10::TensorImpl*> impls;
  for (const auto* list : {&params, &buffers})
    for (const Tensor& t : *list) {
      TORCH_CHECK_VALUE(!t.name.empty() && t.tensor.defined(), "rank ", rank, ": dedicate_params: the model view has a ",
                  list == &params ? "parameter" : "buffer", " with an empty name or no tensor ('", t.name, "').");
      TORCH_CHECK_VALUE(names.insert(t.name).second, "rank ", rank, ": dedicate_params: the model view names '", t.name,
                  "' twice. Parameter and buffer names must be unique (as named_parameters() gives them).");
    }
  for (const Tensor& t : params)
    TORCH_CHECK_VALUE(impls.insert(t.tensor.unsafeGetTensorImpl()).second, "rank ", rank, ": dedicate_params: parameter '",
                t.name, "' is the same tensor as an earlier parameter of the model view. List a tied parameter once, "
                "under its first name.");
  TORCH_CHECK_VALUE(!modules.empty() && modules.front().name.empty() && modules.front().parent < 0, "rank ", rank,
              ": dedicate_params: the model view's first module must be the root (name \"\", no parent).");
  for (size_t i = 1; i < modules.size(); ++i) {
    const Module& m = modules[i];
    TORCH_CHECK_VALUE(m.parent >= 0 && static_cast<size_t>(m.parent) < i, "rank ", rank, ": dedicate_params: module '",
                m.name, "' of the model view has parent ", m.parent, "; a parent comes before its children.");
    const std::string& p = modules[static_cast<size_t>(m.parent)].name;
    TORCH_CHECK_VALUE(p.empty() ? m.name.find('.') == std::string::npos
                          : m.name.size() > p.size() + 1 && m.name.compare(0, p.size() + 1, p + ".") == 0 &&
                                m.name.find('.', p.size() + 1) == std::string::npos,
                "rank ", rank, ": dedicate_params: module '", m.name, "' of the model view is not a child of its "
                "parent '", p, "' (a child's name is its parent's name, a dot, and one more component).");
  }
}

const ModelView::Module* ModelView::module(const std::string& name) const {
  for (const Module& m : modules)
    if (m.name == name) return &m;
  return nullptr;
}

ModelView model_view(const torch::nn::Module& model) {
  ModelView v;
  std::map<const c10::TensorImpl*, size_t> seen;  // tied parameters once, their other names as aliases
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto [it, first] = seen.emplace(item.value().unsafeGetTensorImpl(), v.params.size());
    if (first)
      v.params.push_back({item.key(), item.value()});
    else
      v.params[it->second].aliases.push_back(item.key());
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) v.buffers.push_back({item.key(), item.value()});
  std::map<std::string, int> index;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const std::string& name = item.key();
    ModelView::Module m;
    m.name = name;
    if (!name.empty()) {
      const size_t dot = name.rfind('.');
      m.parent = index.at(dot == std::string::npos ? std::string() : name.substr(0, dot));
    }
    m.libtorch = item.value();
    const torch::nn::Module* raw = item.value().get();
    // (MultiheadAttention reads its out_proj's weight without calling out_proj: that forward never runs either)
    const auto parent = m.parent >= 0 ? v.modules[static_cast<size_t>(m.parent)].libtorch.lock() : nullptr;
    m.container = dynamic_cast<const torch::nn::ModuleListImpl*>(raw) || dynamic_cast<const torch::nn::ModuleDictImpl*>(raw) ||
                  dynamic_cast<const torch::nn::ParameterListImpl*>(raw) ||
                  dynamic_cast<const torch::nn::ParameterDictImpl*>(raw) ||
                  dynamic_cast<const torch::nn::MultiheadAttentionImpl*>(parent.get());
    index[name] = static_cast<int>(v.modules.size());
    v.modules.push_back(std::move(m));
    if (const auto* tp = dynamic_cast<const TensorParallel*>(item.value().get()))
      v.tp_modules.emplace_back(name, tp->tp_mesh().get());
  }
  v.tp_split = tp_split_dims(model);
  return v;
}

}  // namespace dmuon
