// model_builders.h -- internal: the model builders of model_specs.cpp that the presets use.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "dmuon/tools/model_specs.h"

namespace dmuon::detail {

ModelSpec preset_vit(const std::string& name, int64_t eb, int64_t L, int64_t d, int64_t mlp, int64_t patch,
                     int64_t image, int64_t classes);
// a Hugging Face style config (model_type, hidden_size, ...) as a parameter list
ModelSpec preset_from_config(const nlohmann::json& cfg, const std::string& src, const std::string& name,
                             const std::string& dtype);
std::string join_names(const std::vector<std::string>& v);
std::string lower_name(std::string s);

}  // namespace dmuon::detail
