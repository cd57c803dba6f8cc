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

std::shared_ptr<ParamSource> init_source(const LanguageModel& model, uint64_t seed) {
  const double std = model.init_std();
  return seeded_init(seed, [std](const std::string& name, at::Tensor& full, at::Generator& gen) {
    if (name.find("norm") != std::string::npos)
      full.fill_(1.0);
    else if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0)
      full.zero_();
    else
      full.normal_(0.0, std, gen);
  });
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

std::shared_ptr<ParamSource> weights_source(const std::string& path) {
  SafetensorsSourceOptions o;
  o.ignore = [](const std::string& key) {  // recomputed from rope_theta
    return key.find("rotary_emb.inv_freq") != std::string::npos;
  };
  o.what = "--init-from " + path;
  return safetensors_source(path, o);
}

void load_weights(const std::string& path, torch::nn::Module& model, const std::shared_ptr<Mesh>& tp_mesh) {
  initialize_parameters(model, *weights_source(path), tp_mesh);
}

}  // namespace dmuon::models
