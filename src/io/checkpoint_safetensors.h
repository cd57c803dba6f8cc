// checkpoint_safetensors.h -- the checkpoint layout for other tools: one safetensors file (see
// include/dmuon/checkpoint.h for the layout). Internal to the io layer: save_checkpoint and
// load_checkpoint dispatch here.
#pragma once

#include <string>

#include "dmuon/checkpoint.h"

namespace dmuon::io {

void save_checkpoint_safetensors(const std::string& path, const TensorDict& model, const OptimizerStateDict* optim,
                                 const std::map<std::string, std::string>& metadata);
Checkpoint load_checkpoint_safetensors(const std::string& path, bool include_model, bool allow_unverified);
// Its "model/" section, read by offset and verified per tensor.
std::shared_ptr<ParamSource> checkpoint_safetensors_model_source(const std::string& path, bool allow_unverified);

}  // namespace dmuon::io
