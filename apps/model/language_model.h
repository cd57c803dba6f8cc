// language_model.h -- what `dmuon train` needs of a model: tokens in, next-token logits out, and
// which of its parameters are Muon matrices. The home-made GPT (gpt.h) and the Hugging Face decoder
// families (hf_decoder.h) implement it.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>

#include "dmuon/deferred_init.h"
#include "dmuon/mesh.h"

namespace dmuon::models {

// Deferred construction (deferred_init.h): each block is built and its parameters released at
// once, in `dtype` on `device`, so building holds at most one block; dedicate_params then
// materialises what each rank keeps from a ParamSource (init_source, or a weights file).
struct DeferredInit {
  bool enabled = false;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  void apply(torch::nn::Module& m) const {
    if (enabled) defer_parameters(m, dtype, device);
  }
};

class LanguageModel : public torch::nn::Module {
 public:
  // tokens [B, T] (int64) -> logits [B, T, vocab]
  virtual at::Tensor forward(const at::Tensor& tokens) = 0;
  // Mean cross-entropy of next-token prediction: logits of tokens[:, :-1] against tokens[:, 1:]
  // (computed in float32 when the logits are 16-bit).
  at::Tensor loss(const at::Tensor& tokens);
  // The Muon matrices: the 2-D weights inside the hook-boundary blocks.
  virtual bool is_muon_matrix(const std::string& name, const at::Tensor& p) const = 0;
  // Whether two parameter names share one tensor (tied input and output embeddings).
  virtual bool ties_embeddings() const { return false; }
  // One line for the run's banner, e.g. "GPT d=128 layers=4 heads=4".
  virtual std::string describe() const = 0;
  // The standard deviation of the normal initialisation of the weights.
  virtual double init_std() const = 0;
};

// The layout-independent initialisation (the default of `dmuon train`): norms are ones, biases
// zeros, every other parameter N(0, std^2) drawn from a generator seeded by (seed, name)
// (seeded_init), the same on any mesh, dtype and device.
std::shared_ptr<ParamSource> init_source(const LanguageModel& model, uint64_t seed);
// A weights file (one safetensors file or a sharded index.json) as a source: see load_weights for
// what it must hold; each rank reads only the tensors and rows it keeps.
std::shared_ptr<ParamSource> weights_source(const std::string& path);

// The initialisation both model families use, the same on any mesh: norms keep their ones, biases
// become zeros, every other parameter is drawn from N(0, std^2) from the global generator in
// registration order; a tensor-parallel slice is the slice of the full draw (tp_mesh non-null).
void init_weights_like_single_process(torch::nn::Module& model, double std, const std::shared_ptr<Mesh>& tp_mesh);

// Copies weights from a safetensors file (or a sharded *.safetensors.index.json, as Hugging Face
// publishes them) into `model`'s parameters; call it before dedicating the model. The file must hold
// exactly the model's parameters by name (rotary inv_freq buffers of old exports are ignored), each
// of its single-process shape, in any floating dtype (converted); a tensor-parallel parameter takes
// its slice. A missing, extra or misshapen tensor is an error naming it.
void load_weights(const std::string& path, torch::nn::Module& model, const std::shared_ptr<Mesh>& tp_mesh);

}  // namespace dmuon::models
