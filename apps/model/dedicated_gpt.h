// The one setup of a dedicated GPT run shared by `dmuon train`, `dmuon bench step` and the byte
// benchmark: the mesh (with the trainer's group policy), the model, its routes and precision.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "dmuon/dedicate.h"
#include "dmuon/mesh.h"
#include "model/gpt.h"

namespace dmuon::models {

struct MeshSetup {
  StorePtr store;
  c10::DeviceType device = c10::DeviceType::CPU;
  int replicate = 1;                                   // HSDP replicate groups (1: a 1-D mesh)
  int tp = 1;                                          // tensor-parallel ranks per group
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
  std::string tag = "dmuon";                           // several meshes over one store need distinct tags
};
// collective: every rank of `world`.
std::shared_ptr<Mesh> make_training_mesh(const CommPtr& world, const MeshSetup& setup);

struct DedicatedModelSetup {
  at::Device device = at::kCPU;
  std::string param_dtype = "fp32";    // fp32 | bf16 | fp16 (fp32 masters and optimizer state) | fp64
  bool muon = true;                    // false: every parameter on AdamW (the baseline)
  bool z3 = true;                      // reshard_after_forward
  bool shard_base = false;             // non-matrix parameters on sharded_adamw
  std::optional<bool> pack_small_params;
  // deferred models (DeferredInit): where each rank's kept parameters take their values from
  std::shared_ptr<ParamSource> param_source;
};
// Moves `model` to the setup's device and dtype, dedicates it on `mesh` (its is_muon_matrix
// parameters on Muon) and replicates the rest (replicate_tp when `tensor_parallel`).
// collective: every rank of the mesh.
void dedicate_model(LanguageModel& model, const std::shared_ptr<Mesh>& mesh, const DedicatedModelSetup& setup,
                    bool tensor_parallel);

struct DedicatedGptSetup : DedicatedModelSetup {
  GPTConfig config;
  uint64_t seed = 0;  // the model's initialisation
};
// A GPT built from `setup` (seeded) and dedicated (dedicate_model).
// collective: every rank of the mesh.
GPT make_dedicated_gpt(const std::shared_ptr<Mesh>& mesh, const DedicatedGptSetup& setup);

}  // namespace dmuon::models
