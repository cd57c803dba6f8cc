// Internal: a read-only view of a dedicated model's runtime for white-box tests and benchmarks
// (storage released, dtypes of masters and shards). Tests use this instead of the runtime's layout.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "runtime/dedicated_route.h"
#include "runtime/runtime.h"
#include "runtime/sharded_route.h"

namespace dmuon::inspect {

// One packed (boundary, owner) unit of dedicated matrices as this rank sees it.
struct PackedUnit {
  std::string boundary;
  int boundary_index = 0;
  at::Tensor flat;                   // the packed parameter data (0 bytes while released)
  at::Tensor master;                 // the global owner's master copy (mixed precision), else undefined
  at::Tensor shard;                  // all_gather unshard: this rank's shard
  int64_t numel = 0;
  int64_t shard_len = 0;
  bool holder = false;               // this rank holds the unit between steps
  std::vector<std::string> params;   // the matrices packed in it
};

struct ShardedParam {
  std::string name;
  at::Tensor param, shard, full;
  int64_t numel = 0;
  int64_t shard_len = 0;
};

inline std::shared_ptr<Runtime> runtime_of(const torch::nn::Module& model) {
  auto rt = detail::state_of_model(&model);
  TORCH_CHECK(rt, "inspect: the model was not dedicated");
  return rt;
}

inline PackedUnit to_unit(const Runtime& rt, int b, const PackedBuffer& buf) {
  PackedUnit u;
  u.boundary = rt.boundaries()[static_cast<size_t>(b)].name;
  u.boundary_index = b;
  u.flat = buf.flat;
  u.master = buf.master;
  u.shard = buf.shard;
  u.numel = buf.numel;
  u.shard_len = buf.shard_len;
  u.holder = buf.holder;
  for (int p : buf.params) u.params.push_back(rt.dedicated().entries()[static_cast<size_t>(p)].name);
  return u;
}

// boundary b's units, or every boundary's (b < 0), in boundary order
inline std::vector<PackedUnit> packed_units(const torch::nn::Module& model, int b = -1) {
  auto rt = runtime_of(model);
  std::vector<PackedUnit> out;
  for (const auto& B : rt->boundaries())
    if (b < 0 || B.index == b)
      for (const auto& buf : rt->dedicated().buffers(B.index)) out.push_back(to_unit(*rt, B.index, buf));
  return out;
}

// the unit that holds dedicated parameter `name`
inline PackedUnit unit_of(const torch::nn::Module& model, const std::string& name) {
  auto rt = runtime_of(model);
  const DedicatedEntry* e = rt->dedicated().find(name);
  TORCH_CHECK(e, "inspect: '", name, "' is not dedicated");
  return to_unit(*rt, e->boundary, rt->dedicated().buffers(e->boundary)[static_cast<size_t>(e->buffer)]);
}

// the sharded_adamw route (null when no parameter is on it)
inline const ShardedRoute* sharded_route(const torch::nn::Module& model) {
  return dynamic_cast<const ShardedRoute*>(runtime_of(model)->route(RouteKind::Sharded));
}

inline std::vector<ShardedParam> sharded_params(const torch::nn::Module& model) {
  std::vector<ShardedParam> out;
  if (const ShardedRoute* r = sharded_route(model))
    for (const auto& e : r->entries()) out.push_back(ShardedParam{e.name, e.param, e.shard, e.full, e.numel, e.shard_len});
  return out;
}

inline bool is_sharded(const torch::nn::Module& model, const std::string& name) {
  const ShardedRoute* r = sharded_route(model);
  return r != nullptr && r->find(name) != nullptr;
}
inline size_t num_dedicated(const torch::nn::Module& model) { return runtime_of(model)->dedicated().entries().size(); }
inline bool has_masters(const torch::nn::Module& model) { return runtime_of(model)->has_masters(); }
inline at::Tensor master_of(const torch::nn::Module& model, const at::Tensor& p) { return runtime_of(model)->master_of(p); }

}  // namespace dmuon::inspect
