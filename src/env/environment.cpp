// The one place dmuon reads environment variables. LibTorch-free (part of dmuon_plan, the lowest
// target) so the planner, the NS kernels and the runtime all read through it.
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <stdexcept>

#include "dmuon/env.h"

namespace dmuon::env {
namespace {
std::string get(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}
std::optional<bool> get_bool(const char* name) {
  const std::string v = get(name);
  if (v.empty()) return std::nullopt;
  return parse_bool(name, v);
}
}  // namespace

bool parse_bool(const std::string& var, const std::string& value) {
  std::string v = value;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  throw std::invalid_argument(var + "='" + value + "' is not a boolean; use 1/0, true/false, on/off or yes/no");
}

std::optional<int64_t> parse_count(const std::string& value, int64_t max) {
  if (value.empty() || value.size() > 18 || value.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  const int64_t v = std::stoll(value);  // (at most 18 digits: no overflow)
  if (v < 1 || v > max) return std::nullopt;
  return v;
}

std::string owner_strategy() { return get("DMUON_OWNER_STRATEGY"); }
std::string owner_cost_model() { return get("DMUON_OWNER_COST_MODEL"); }
std::string ns_profile() { return get("DMUON_NS_PROFILE"); }
std::optional<bool> hsdp_column_balance() { return get_bool("DMUON_HSDP_COLUMN_BALANCE"); }
std::optional<bool> pack_small_params() { return get_bool("DMUON_OWNER_PACK_SMALL_PARAMS"); }
std::string ns_kernel() { return get("DMUON_NS_KERNEL"); }
std::optional<bool> ns_cuda_graphs() { return get_bool("DMUON_NS_CUDA_GRAPHS"); }
std::optional<bool> ns_cpu_fused() { return get_bool("DMUON_NS_CPU_FUSED"); }
std::optional<bool> batched_ns() { return get_bool("DMUON_BATCHED_NS"); }
std::string ns_batch_mb() { return get("DMUON_NS_BATCH_MB"); }
std::string collective_timeout() { return get("DMUON_COLLECTIVE_TIMEOUT"); }
std::string cpu_backend() { return get("DMUON_CPU_BACKEND"); }
std::string process_group_policy() { return get("DMUON_PROCESS_GROUP_POLICY"); }
bool isolated_pg_barrier() { return get_bool("DMUON_ISOLATED_PG_BARRIER").value_or(false); }
bool force_collectives() { return get_bool("DMUON_FORCE_COLLECTIVES").value_or(false); }
bool record_forward_profile() { return get_bool("DMUON_RECORD_FORWARD_PROFILE").value_or(false); }
std::optional<bool> fast_clip() { return get_bool("DMUON_FAST_CLIP"); }
std::string fast_clip_chunk_size() { return get("DMUON_FAST_CLIP_CHUNK_SIZE"); }

}  // namespace dmuon::env
