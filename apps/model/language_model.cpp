// What the model families share (see language_model.h).
#include "model/language_model.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <map>
#include <vector>

#include "dmuon/safetensors.h"
#include "dmuon/tensor_parallel.h"

namespace dmuon::models {

at::Tensor LanguageModel::loss(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) >= 2, "loss: expected tokens [batch, seq >= 2], got shape ",
              tokens.sizes());
  const int64_t T = tokens.size(1);
  at::Tensor input = tokens.narrow(1, 0, T - 1), target = tokens.narrow(1, 1, T - 1);
  at::Tensor logits = forward(input);
  if (logits.element_size() < 4) logits = logits.to(at::kFloat);  // mixed precision: the loss in fp32
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
}

void init_weights_like_single_process(torch::nn::Module& model, double std, const std::shared_ptr<Mesh>& tp_mesh) {
  at::NoGradGuard ng;
  const std::map<std::string, int> split = tp_split_dims(model);
  const int tp = tp_mesh ? tp_mesh->tp_size() : 1;
  for (auto& p : model.named_parameters(true)) {
    const std::string& name = p.key();
    if (name.find("norm") != std::string::npos) continue;
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) {
      p.value().zero_();
      continue;
    }
    auto it = split.find(name);
    if (it == split.end()) {
      p.value().normal_(0.0, std);
      continue;
    }
    std::vector<int64_t> full = p.value().sizes().vec();
    full[static_cast<size_t>(it->second)] *= tp;
    p.value().copy_(tp_slice(at::empty(full, p.value().options()).normal_(0.0, std), it->second, tp_mesh->tp_rank(), tp));
  }
}

void load_weights(const std::string& path, torch::nn::Module& model, const std::shared_ptr<Mesh>& tp_mesh) {
  const std::map<std::string, int> split = tp_split_dims(model);
  const int tp = tp_mesh ? tp_mesh->tp_size() : 1;
  std::map<std::string, std::vector<int64_t>> want;
  for (const auto& p : model.named_parameters(true)) {
    std::vector<int64_t> full = p.value().sizes().vec();
    if (auto it = split.find(p.key()); it != split.end()) full[static_cast<size_t>(it->second)] *= tp;
    want[p.key()] = full;
  }
  std::map<std::string, at::Tensor> out;
  SafetensorsDict file = load_safetensors(path);
  std::vector<std::string> extra;
  for (const auto& [name, t] : file) {
    if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;  // recomputed from rope_theta
    auto it = want.find(name);
    if (it == want.end()) {
      extra.push_back(name);
      continue;
    }
    TORCH_CHECK(t.sizes().vec() == it->second, "--init-from ", path, ": tensor '", name, "' has shape ", t.sizes(),
                " but the model built from the config has ", at::IntArrayRef(it->second),
                " (weights of another model size, or the wrong config.json?).");
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), "--init-from ", path, ": tensor '", name, "' has dtype ",
                t.scalar_type(), "; weights must be floating point (quantized exports are not read).");
    out[name] = t;
  }
  TORCH_CHECK(extra.empty(), "--init-from ", path, ": ", extra.size(), " tensor(s) the model does not have, e.g. '",
              extra.empty() ? std::string() : extra.front(), "' (weights of another family, or a config with ",
              "tie_word_embeddings set differently?).");
  for (const auto& [name, shape] : want)
    TORCH_CHECK(out.count(name), "--init-from ", path, ": the model's parameter '", name,
                "' is not in the file (an incomplete shard set, or weights of another family?).");
  at::NoGradGuard ng;
  for (auto& p : model.named_parameters(true)) {
    at::Tensor full = out.at(p.key());
    if (auto it = split.find(p.key()); it != split.end()) full = tp_slice(full, it->second, tp_mesh->tp_rank(), tp);
    p.value().copy_(full);
  }
}

}  // namespace dmuon::models
