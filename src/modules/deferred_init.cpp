// Deferred parameters and the sources that materialise them (see deferred_init.h).
#include "dmuon/deferred_init.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <set>
#include <sstream>

#include "dmuon/digest.h"
#include "dmuon/tensor_parallel.h"

namespace dmuon {

TensorRegion TensorRegion::whole(at::IntArrayRef full_shape) {
  TensorRegion r;
  r.full_shape = full_shape.vec();
  r.start.assign(full_shape.size(), 0);
  r.size = full_shape.vec();
  return r;
}

bool TensorRegion::is_whole() const {
  for (size_t d = 0; d < full_shape.size(); ++d)
    if (start[d] != 0 || size[d] != full_shape[d]) return false;
  return true;
}

bool TensorRegion::rows_only() const {
  for (size_t d = 1; d < full_shape.size(); ++d)
    if (start[d] != 0 || size[d] != full_shape[d]) return false;
  return true;
}

int64_t TensorRegion::numel() const {
  int64_t n = 1;
  for (int64_t s : size) n *= s;
  return n;
}

at::Tensor TensorRegion::cut(const at::Tensor& full) const {
  TORCH_CHECK(full.sizes().vec() == full_shape, "TensorRegion::cut: the value has shape ", full.sizes(),
              " but the region is of a tensor of shape ", at::IntArrayRef(full_shape));
  at::Tensor v = full;
  for (size_t d = 0; d < full_shape.size(); ++d)
    if (start[d] != 0 || size[d] != full_shape[d]) v = v.narrow(static_cast<int64_t>(d), start[d], size[d]);
  return v;
}

uint64_t param_seed(uint64_t seed, const std::string& name) {
  // (started from 1469598103934665603, not FNV's offset: kept, so every (seed, name) draws what it always drew)
  const uint64_t h = Fnv1a(1469598103934665603ull).chars(name).value();
  uint64_t z = h ^ (seed + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));  // splitmix64 finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

namespace {
class SeededInit final : public ParamSource {
 public:
  SeededInit(uint64_t seed, InitRule rule) : seed_(seed), rule_(std::move(rule)) {
    TORCH_CHECK(static_cast<bool>(rule_), "dmuon::seeded_init: the rule is empty; pass a function (name, full, gen) "
                "that fills a parameter's initial value.");
  }
  void fill(const std::string& name, const TensorRegion& region, at::Tensor& out) override {
    at::NoGradGuard ng;
    at::Tensor full = at::empty(region.full_shape, at::TensorOptions().dtype(at::kFloat));
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(param_seed(seed_, name));
    rule_(name, full, gen);
    out.copy_(region.cut(full));
  }
  std::string describe() const override { return "seeded initialisation (seed " + std::to_string(seed_) + ")"; }
  uint64_t digest() const override { return Fnv1a().str("seeded_init").u64(seed_).value(); }

 private:
  uint64_t seed_;
  InitRule rule_;
};
}  // namespace

std::shared_ptr<ParamSource> seeded_init(uint64_t seed, InitRule rule) {
  return std::make_shared<SeededInit>(seed, std::move(rule));
}

namespace {
class TensorDictSource final : public ParamSource {
 public:
  TensorDictSource(std::map<std::string, at::Tensor> values, std::string what)
      : values_(std::move(values)), what_(std::move(what)) {}
  void check(const std::vector<std::pair<std::string, std::vector<int64_t>>>& params) override {
    std::map<std::string, detail::AvailableTensor> avail;
    for (const auto& [k, v] : values_) avail[k] = {v.sizes().vec(), v.is_floating_point()};
    detail::check_source(what_, avail, params, /*allow_extra=*/true);
  }
  void fill(const std::string& name, const TensorRegion& region, at::Tensor& out) override {
    auto it = values_.find(name);
    TORCH_CHECK(it != values_.end(), what_, " has no '", name, "'.");
    out.copy_(region.cut(it->second));
  }
  bool fills_cannot_fail() const override { return true; }  // check() saw every name, shape and kind
  std::string describe() const override { return what_; }
  uint64_t digest() const override {
    Fnv1a h;
    for (const auto& [k, v] : values_) {
      h.str(k).i64(v.defined() ? static_cast<int64_t>(v.scalar_type()) : -1);
      if (v.defined())
        for (int64_t d : v.sizes()) h.i64(d);
    }
    return h.value();
  }

 private:
  std::map<std::string, at::Tensor> values_;
  std::string what_;
};
}  // namespace

std::shared_ptr<ParamSource> tensor_dict_source(std::map<std::string, at::Tensor> values, std::string what) {
  return std::make_shared<TensorDictSource>(std::move(values), std::move(what));
}

namespace detail {

at::Tensor unallocated(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options.requires_grad(false));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

TensorRegion tp_region(at::IntArrayRef local_shape, int dim, int tp_rank, int tp) {
  TensorRegion r = TensorRegion::whole(local_shape);
  if (dim < 0 || tp <= 1) return r;
  const auto d = static_cast<size_t>(dim);
  r.full_shape[d] = local_shape[d] * tp;
  r.start[d] = local_shape[d] * tp_rank;
  return r;
}

std::pair<TensorRegion, int64_t> rows_covering(const TensorRegion& local, int64_t begin, int64_t len) {
  if (local.size.empty()) return {local, begin};  // a 0-dim tensor: one element
  int64_t row = 1;
  for (size_t d = 1; d < local.size.size(); ++d) row *= local.size[d];
  TensorRegion r = local;
  if (row == 0 || len <= 0) return {r, 0};
  const int64_t r0 = begin / row, r1 = (begin + len + row - 1) / row;
  r.start[0] = local.start[0] + r0;
  r.size[0] = r1 - r0;
  return {r, begin - r0 * row};
}

void check_source(const std::string& what, const std::map<std::string, AvailableTensor>& available,
                  const std::vector<std::pair<std::string, std::vector<int64_t>>>& wanted, bool allow_extra) {
  std::map<std::string, const std::vector<int64_t>*> want;
  for (const auto& [name, shape] : wanted) {
    want[name] = &shape;
    auto it = available.find(name);
    TORCH_CHECK(it != available.end(), what, ": the model's parameter '", name, "' is not in the file (an incomplete "
                "shard set, or weights of another family / model?).");
    TORCH_CHECK(it->second.shape == shape, what, ": tensor '", name, "' has shape ", at::IntArrayRef(it->second.shape),
                " but the model has ", at::IntArrayRef(shape), " (weights of another model size, or the wrong config?).");
    TORCH_CHECK(it->second.floating, what, ": tensor '", name, "' is not floating point; weights must be floating "
                "point (quantized exports are not read).");
  }
  if (allow_extra) return;
  std::vector<std::string> extra;
  for (const auto& [name, t] : available)
    if (!want.count(name)) extra.push_back(name);
  TORCH_CHECK(extra.empty(), what, ": ", extra.size(), " tensor(s) the model does not have, e.g. '",
              extra.empty() ? std::string() : extra.front(), "' (weights of another family, or a config with "
              "tie_word_embeddings set differently?).");
}

}  // namespace detail

bool is_deferred(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0 || !t.has_storage()) return false;
  const auto need = static_cast<size_t>((t.storage_offset() + t.numel()) * static_cast<int64_t>(t.element_size()));
  return t.storage().nbytes() < need;
}

void defer_parameters(torch::nn::Module& module, std::optional<at::ScalarType> dtype, std::optional<at::Device> device) {
  at::NoGradGuard ng;
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    at::Tensor p = item.value();
    if (is_deferred(p) || p.numel() == 0) continue;
    at::TensorOptions o = p.options();
    if (dtype && p.is_floating_point()) o = o.dtype(*dtype);
    if (device) o = o.device(*device);
    p.set_data(detail::unallocated(p.sizes(), o));
  }
}

std::vector<std::string> deferred_parameters(const torch::nn::Module& model) {
  std::vector<std::string> out;
  for (const auto& item : model.named_parameters(/*recurse=*/true))
    if (is_deferred(item.value())) out.push_back(item.key());
  return out;
}

void initialize_parameters(torch::nn::Module& model, ParamSource& source, const std::shared_ptr<Mesh>& tp_mesh) {
  const std::map<std::string, int> split = tp_split_dims(model);
  const int tp = tp_mesh ? tp_mesh->tp_size() : 1;
  const int tp_rank = tp_mesh ? tp_mesh->tp_rank() : 0;
  TORCH_CHECK(split.empty() || tp_mesh, "initialize_parameters: the model has tensor-parallel parameters (e.g. '",
              split.empty() ? std::string() : split.begin()->first, "'); pass the mesh they were built on.");
  // a tied parameter (one tensor under several names) once, under its first name, as dedicate_params asks
  // the source for it: the same value on both
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true))
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) params.emplace_back(item.key(), item.value());
  std::vector<TensorRegion> regions;
  std::vector<std::pair<std::string, std::vector<int64_t>>> wanted;
  for (const auto& [name, p] : params) {
    auto it = split.find(name);
    regions.push_back(detail::tp_region(p.sizes(), it == split.end() ? -1 : it->second, tp_rank, tp));
    wanted.emplace_back(name, regions.back().full_shape);
  }
  source.check(wanted);
  at::NoGradGuard ng;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor p = params[i].second;
    if (is_deferred(p)) p.set_data(at::empty(p.sizes(), p.options().requires_grad(false)));
    at::Tensor out = p.detach();
    source.fill(params[i].first, regions[i], out);
  }
}

}  // namespace dmuon
