// Checkpoints as one safetensors file (see include/dmuon/checkpoint.h).
#include "checkpoint_safetensors.h"

#include <c10/util/Exception.h>

#include <fstream>
#include <stdexcept>
#include <nlohmann/json.hpp>

#include "dmuon/safetensors.h"
#include "env/json_text.h"

namespace dmuon::io {

namespace {

using json = nlohmann::json;
constexpr const char* kFormat = "dmuon-checkpoint-safetensors-v1";
constexpr const char* kSections[] = {"model/", "optim_muon/", "optim_adamw/"};

uint32_t data_crc(const at::Tensor& t) {
  const at::Tensor c = t.detach().cpu().contiguous();
  return checkpoint_crc32c(c.data_ptr(), c.nbytes());
}

json groups_json(const OptimizerStateDict& o) {
  json groups = json::array();
  for (const auto& g : o.param_groups)
    groups.push_back({{"name", g.name}, {"is_muon", g.is_muon}, {"lr", g.lr}, {"momentum", g.momentum},
                      {"weight_decay", g.weight_decay}, {"beta1", g.beta1}, {"beta2", g.beta2}, {"eps", g.eps},
                      {"nesterov", g.nesterov}, {"ns_steps", g.ns_steps}});
  json out = {{"steps_taken", o.steps_taken}, {"param_groups", groups}};
  if (!o.without_state.empty()) out["without_state"] = o.without_state;  // (absent in earlier files: none)
  return out;
}

}  // namespace

void save_checkpoint_safetensors(const std::string& path, const TensorDict& model, const OptimizerStateDict* optim,
                                 const std::map<std::string, std::string>& metadata) {
  SafetensorsDict all;
  json sums = json::object();
  auto add = [&](const std::string& section, const TensorDict& d) {
    for (const auto& [k, v] : d) {
      all[section + k] = v.detach().cpu();
      sums[section + k] = data_crc(v);
    }
  };
  add(kSections[0], model);
  std::map<std::string, std::string> meta{{"format", kFormat}};
  if (optim) {
    add(kSections[1], optim->muon);
    add(kSections[2], optim->adamw);
    meta["optimizer"] = groups_json(*optim).dump();
    sums["optimizer"] = checkpoint_crc32c(meta["optimizer"].data(), meta["optimizer"].size());
  }
  if (!metadata.empty()) {
    meta["user"] = json(metadata).dump();
    sums["user"] = checkpoint_crc32c(meta["user"].data(), meta["user"].size());
  }
  meta["crc32c"] = sums.dump();
  save_safetensors(path, all, meta);
}

namespace {
// The checkpoint's metadata checked (format), and its per-tensor CRC32C table: dmuon always writes
// one, and it covers every tensor; a file without it (another tool's) loads only when allowed.
json checked_sums(const SafetensorsFile& f, const std::string& where, bool allow_unverified) {
  const auto& meta = f.metadata();
  auto fmt = meta.find("format");
  TORCH_CHECK(fmt != meta.end() && fmt->second == kFormat, where, " is a safetensors file but not a dmuon checkpoint: "
              "its metadata has no \"format\": \"", kFormat, "\" (a model's weights? load those with --init-from "
              "or dmuon::load_safetensors).");
  json sums = json::object();
  if (auto s = meta.find("crc32c"); s != meta.end()) {
    try {
      sums = json::parse(s->second);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, where, " is corrupt: its \"crc32c\" metadata is not JSON (", e.what(), ").");
    }
    TORCH_CHECK(sums.is_object(), where, " is corrupt: its \"crc32c\" metadata is not a JSON object.");
    for (const std::string& key : f.keys())
      TORCH_CHECK(sums.contains(key), where, " is damaged: tensor '", key, "' has no entry in its \"crc32c\" "
                  "metadata (dmuon records every tensor it writes), so it cannot be verified.");
    // the metadata dmuon reads (hyperparameters, steps taken, the user's strings) is covered as the tensors are
    // (dmuon before 2026-12-03 recorded none for "user": such a file loads with allow_unverified)
    for (const char* key : {"optimizer", "user"})
      TORCH_CHECK(allow_unverified || !meta.count(key) || sums.contains(key), where, " is damaged: its \"", key,
                  "\" metadata has no entry in its \"crc32c\" metadata (dmuon records one whenever it writes it), so "
                  "it cannot be verified. Resume from another checkpoint, or load it with allow_unverified (dmuon "
                  "train: --allow-unverified-checkpoint) if an earlier dmuon wrote it.");
    for (auto it = sums.begin(); it != sums.end(); ++it) {
      TORCH_CHECK(it.key() == "optimizer" || it.key() == "user" || f.contains(it.key()), where, " is incomplete: its "
                  "\"crc32c\" metadata records tensor '", it.key(), "', which is not in the file (removed after it "
                  "was written?). Resume from another checkpoint.");
      TORCH_CHECK(it->is_number_unsigned() && it->get<uint64_t>() <= 0xffffffffull, where, " is corrupt: its "
                  "\"crc32c\" metadata records ", detail::json_brief(*it), " for '", it.key(), "', which is not a "
                  "CRC32C checksum (an integer below 2^32).");
    }
  } else {
    TORCH_CHECK(allow_unverified, where, " has no \"crc32c\" metadata, which every checkpoint dmuon writes has, so "
                "its tensors cannot be verified. If another tool wrote it on purpose, load it with "
                "allow_unverified (dmuon train: --allow-unverified-checkpoint).");
  }
  return sums;
}
}  // namespace

std::shared_ptr<ParamSource> checkpoint_safetensors_model_source(const std::string& path, bool allow_unverified) {
  const std::string where = "checkpoint '" + path + "'";
  const json sums = checked_sums(SafetensorsFile(path), where, allow_unverified);
  SafetensorsSourceOptions o;
  o.prefix = kSections[0];
  o.what = where;
  for (auto it = sums.begin(); it != sums.end(); ++it) {
    if (it.key().rfind(o.prefix, 0) != 0) continue;
    if (!it->is_number_unsigned())
      throw std::invalid_argument(where + " is corrupt: its \"crc32c\" metadata records " + detail::json_brief(*it) + " for '" +
                                  it.key() + "', which is not a checksum.");
    o.crc32c[it.key()] = it->get<uint32_t>();
  }
  return safetensors_source(path, o);
}

Checkpoint load_checkpoint_safetensors(const std::string& path, bool include_model, bool allow_unverified) {
  const SafetensorsFile f(path);
  const auto& meta = f.metadata();
  const std::string where = "load_checkpoint: '" + path + "'";
  const json sums = checked_sums(f, where, allow_unverified);
  auto verify = [&](const std::string& key, const void* data, size_t n) {
    if (!sums.contains(key)) return;
    const uint32_t got = checkpoint_crc32c(data, n);
    TORCH_CHECK(sums[key].is_number_unsigned() && sums[key].get<uint32_t>() == got, where, " is corrupt; the damage "
                "is in '", key, "' (stored checksum ", detail::json_brief(sums[key]), ", read ", got, "). The file was damaged "
                "after it was written: resume from another checkpoint.");
  };
  Checkpoint ck;
  OptimizerStateDict o;
  TensorDict* out[] = {&ck.model, &o.muon, &o.adamw};
  for (const std::string& key : f.keys()) {
    size_t s = 0;
    while (s < 3 && key.rfind(kSections[s], 0) != 0) ++s;
    TORCH_CHECK(s < 3, where, ": tensor '", key, "' is in no section (keys start with model/, optim_muon/ or "
                "optim_adamw/).");
    if (s == 0 && !include_model) continue;
    at::Tensor t = f.load(key);
    verify(key, t.data_ptr(), t.nbytes());
    (*out[s])[key.substr(std::string(kSections[s]).size())] = t;
  }
  if (auto user = meta.find("user"); user != meta.end()) {
    verify("user", user->second.data(), user->second.size());
    try {
      const json u = json::parse(user->second);
      TORCH_CHECK(u.is_object(), where, ": its \"user\" metadata is not a JSON object.");
      for (auto it = u.begin(); it != u.end(); ++it) ck.metadata[it.key()] = it.value().get<std::string>();
    } catch (const json::exception& e) {
      TORCH_CHECK(false, where, ": its \"user\" metadata is not a JSON object of strings (", e.what(), ").");
    }
  }
  auto opt = meta.find("optimizer");
  if (opt == meta.end()) {
    TORCH_CHECK(o.muon.empty() && o.adamw.empty(), where, " holds optimizer tensors but no \"optimizer\" metadata "
                "(param_groups, steps_taken).");
    return ck;
  }
  verify("optimizer", opt->second.data(), opt->second.size());
  try {
    const json j = json::parse(opt->second);
    auto count = [&](const json& v) {  // (get<int64_t> casts a float: 1e300 would be undefined behaviour)
      if (!v.is_number_integer()) throw std::invalid_argument("a count is " + detail::json_brief(v) + ", not an integer");
      return v.get<int64_t>();
    };
    o.steps_taken = count(j.at("steps_taken"));
    for (const json& g : j.at("param_groups"))
      o.param_groups.push_back({g.at("name").get<std::string>(), g.at("is_muon").get<bool>(), g.at("lr").get<double>(),
                                g.at("momentum").get<double>(), g.at("weight_decay").get<double>(),
                                g.at("beta1").get<double>(), g.at("beta2").get<double>(), g.at("eps").get<double>(),
                                g.at("nesterov").get<bool>(), count(g.at("ns_steps"))});
    if (j.contains("without_state")) {
      if (!j.at("without_state").is_array()) throw std::invalid_argument("without_state is not a list of names");
      for (const json& n : j.at("without_state")) o.without_state.push_back(n.get<std::string>());
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, where, ": its \"optimizer\" metadata is not the layout dmuon writes (", e.what(), "); it "
                "needs {\"steps_taken\": N, \"param_groups\": [{\"name\", \"is_muon\", \"lr\", \"momentum\", "
                "\"weight_decay\", \"beta1\", \"beta2\", \"eps\", \"nesterov\", \"ns_steps\"}, ...], optionally "
                "\"without_state\": [names]}.");
  }
  check_optimizer_state_dict(o, where);
  ck.optim = std::move(o);
  return ck;
}

}  // namespace dmuon::io
