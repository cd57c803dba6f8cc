// The shared setup of a dedicated GPT run (see dedicated_gpt.h).
#include "model/dedicated_gpt.h"

#include "dmuon/bootstrap.h"

namespace dmuon::models {

std::shared_ptr<Mesh> make_training_mesh(const CommPtr& world, const MeshSetup& s) {
  MeshOptions mo;
  mo.store = s.store;
  mo.factory = process_group_factory(s.device);
  // the replicate axis (HSDP publishes, stage-2 reduces) runs at normal priority, below the shard
  // axis that forward waits on
  mo.replicate_factory = process_group_factory(s.device, "127.0.0.1", StreamPriority::Normal);
  mo.timeout = s.timeout;
  mo.replicate_size = s.replicate;
  mo.tp_size = s.tp;
  mo.tag = s.tag;
  return Mesh::create(world, mo);
}

void dedicate_model(LanguageModel& model, const std::shared_ptr<Mesh>& mesh, const DedicatedModelSetup& s,
                    bool tensor_parallel) {
  const at::ScalarType dtype = s.param_dtype == "fp64" ? at::kDouble : at::kFloat;  // fp64: verification runs
  if (deferred_parameters(model).empty()) {
    model.to(s.device);
    if (dtype == at::kDouble) model.to(at::kDouble);
  } else {  // a deferred model has no values to convert: it must have been built in its dtype on its device
    for (const auto& p : model.named_parameters(true))
      TORCH_CHECK(!p.value().is_floating_point() || (p.value().scalar_type() == dtype && p.value().device() == s.device),
                  "dedicate_model: deferred parameter '", p.key(), "' is ", p.value().scalar_type(), " on ",
                  p.value().device(), " but the run trains in ", dtype, " on ", s.device, "; build the model with "
                  "DeferredInit{true, dtype, device} of the run (a deferred parameter has no values to convert).");
    for (auto& b : model.buffers(true)) b.set_data(b.to(s.device));
  }
  DedicateOptions d;
  d.reshard_after_forward = s.z3;
  d.param_source = s.param_source;
  if (s.pack_small_params) d.plan.pack_small_params = *s.pack_small_params;
  const LanguageModel* m = &model;
  if (s.shard_base) {
    TORCH_CHECK(!model.ties_embeddings(), "--shard-base: this model ties its input and output embeddings (one tensor "
                "used by the embedding and the head), which sharded_adamw cannot split between two hook boundaries; "
                "drop --shard-base or use a config with tie_word_embeddings false.");
    d.route_hint_fn = [m](const std::string& n, const at::Tensor& p) -> std::string {
      return m->is_muon_matrix(n, p) ? "" : "sharded_adamw";
    };
  }
  if (s.param_dtype == "bf16" || s.param_dtype == "fp16") {  // every parameter, fp32 masters and optimizer state
    ParamPolicy mp;
    mp.param_dtype = s.param_dtype == "bf16" ? at::kBFloat16 : at::kHalf;
    mp.master_dtype = at::kFloat;
    mp.optim_dtype = at::kFloat;
    d.param_policy.push_back({"", mp});
  }
  std::shared_ptr<torch::nn::Module> ptr = model.shared_from_this();
  dedicate_params(ptr, mesh,
                  s.muon ? ParamPredicate([m](const std::string& n, const at::Tensor& p) { return m->is_muon_matrix(n, p); })
                         : ParamPredicate([](const std::string&, const at::Tensor&) { return false; }),
                  d);
  if (tensor_parallel)
    replicate_tp(ptr, mesh);
  else
    replicate(ptr, mesh);
}

GPT make_dedicated_gpt(const std::shared_ptr<Mesh>& mesh, const DedicatedGptSetup& s) {
  at::manual_seed(s.seed);
  GPT model(s.config);
  dedicate_model(*model, mesh, s, s.config.tp_mesh != nullptr);
  return model;
}

}  // namespace dmuon::models
