// Which model and which boundary module belong to which Runtime; autograd hook helpers.
#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <map>
#include <mutex>
#include <vector>

#include "runtime/runtime.h"

#if DMUON_WITH_CUDA
#include <ATen/native/cuda/Resize.h>
#endif

namespace dmuon::detail {

namespace {
struct ModelEntry {
  std::weak_ptr<torch::nn::Module> model;
  std::shared_ptr<Runtime> state;  // the registry keeps the Runtime alive while its model lives
};
struct BoundaryEntry {
  std::weak_ptr<torch::nn::Module> module;
  std::weak_ptr<Runtime> state;
  int boundary = 0;
};
std::mutex g_registry_mu;
std::map<const torch::nn::Module*, ModelEntry>& models() {
  static std::map<const torch::nn::Module*, ModelEntry> m;
  return m;
}
std::map<const torch::nn::Module*, BoundaryEntry>& boundary_map() {
  static std::map<const torch::nn::Module*, BoundaryEntry> m;
  return m;
}
std::map<uint64_t, std::weak_ptr<Runtime>>& by_id() {
  static std::map<uint64_t, std::weak_ptr<Runtime>> m;
  return m;
}
// Drops the entries of destroyed models; their runtimes move to `dead`, to be released after the
// lock (a Runtime holds tensors). A runtime with a collective still in flight (the last step's async
// publish...) stays until it finished: destroying its groups under it would leave the peers' side
// waiting out the timeout -- and with ranks as threads of one process, the lookup that releases it may
// be the very peer thread that has yet to issue its side.
void drop_dead_models_locked(std::vector<std::shared_ptr<Runtime>>& dead) {
  for (auto it = models().begin(); it != models().end();) {
    if (!it->second.model.expired() || it->second.state->in_flight()) {
      ++it;
      continue;
    }
    dead.push_back(std::move(it->second.state));
    it = models().erase(it);
  }
}
void prune_locked(std::vector<std::shared_ptr<Runtime>>& dead) {
  drop_dead_models_locked(dead);
  for (auto it = boundary_map().begin(); it != boundary_map().end();)
    it = (it->second.module.expired() || it->second.state.expired()) ? boundary_map().erase(it) : ++it;
  for (auto it = by_id().begin(); it != by_id().end();) it = it->second.expired() ? by_id().erase(it) : ++it;
}
}  // namespace

uint64_t next_runtime_id() {
  static std::atomic<uint64_t> next{1};
  return next++;
}

std::shared_ptr<Runtime> state_of_model(const torch::nn::Module* model) {
  std::vector<std::shared_ptr<Runtime>> dead;  // released after the lock
  std::lock_guard<std::mutex> g(g_registry_mu);
  // A destroyed model's runtime -- and every tensor it holds -- goes at the next lookup (every
  // forward and step looks up), not only at the next registration.
  drop_dead_models_locked(dead);
  auto it = models().find(model);
  if (it == models().end()) return nullptr;
  auto live = it->second.model.lock();
  if (!live || live.get() != model) return nullptr;
  return it->second.state;
}

std::pair<std::shared_ptr<Runtime>, int> boundary_of_module(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  auto it = boundary_map().find(module);
  if (it == boundary_map().end()) return {nullptr, -1};
  auto live = it->second.module.lock();
  auto st = it->second.state.lock();
  if (!live || !st || live.get() != module) return {nullptr, -1};
  return {st, it->second.boundary};
}

std::shared_ptr<Runtime> runtime_by_id(uint64_t id) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  auto it = by_id().find(id);
  return it == by_id().end() ? nullptr : it->second.lock();
}

void register_state(const std::shared_ptr<torch::nn::Module>& model, const std::shared_ptr<Runtime>& state) {
  std::vector<std::shared_ptr<Runtime>> dead;  // released after the lock
  std::lock_guard<std::mutex> g(g_registry_mu);
  prune_locked(dead);
  models()[model.get()] = ModelEntry{model, state};
  by_id()[state->id()] = state;
}

void register_runtime(const std::shared_ptr<Runtime>& state) {
  std::vector<std::shared_ptr<Runtime>> dead;  // released after the lock
  std::lock_guard<std::mutex> g(g_registry_mu);
  prune_locked(dead);
  by_id()[state->id()] = state;
}

void register_boundary(const std::shared_ptr<torch::nn::Module>& module, const std::shared_ptr<Runtime>& s, int b) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  boundary_map()[module.get()] = BoundaryEntry{module, s, b};
}

std::shared_ptr<Runtime> require_state(const torch::nn::Module& model, const char* fn) {
  auto s = state_of_model(&model);
  TORCH_CHECK(s, fn, ": this model was not dedicated; call dmuon::dedicate_params (or dedicate_params_ddp) "
              "first.");
  return s;
}

std::shared_ptr<RuntimeFace> face_of(const torch::nn::Module& model) { return state_of_model(&model); }

std::shared_ptr<RuntimeFace> require_face(const torch::nn::Module& model, const char* fn) {
  return require_state(model, fn);
}

namespace {
// runs `fn` before the accumulator node adds the incoming gradient to param.grad(); false: an undefined
// gradient instead, which the accumulator skips
struct LambdaPreHook : torch::autograd::FunctionPreHook {
  explicit LambdaPreHook(std::function<bool()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (fn_()) return grads;
    return torch::autograd::variable_list(grads.size());
  }
  std::function<bool()> fn_;
};
}  // namespace

std::shared_ptr<torch::autograd::Node> on_grad_accumulated(const at::Tensor& param, const std::string& name, int rank,
                                                           std::function<void()> fn, std::function<bool()> before) {
  auto acc = torch::autograd::impl::grad_accumulator(param);
  TORCH_CHECK(acc, "rank ", rank, ": could not get the gradient accumulator of '", name,
              "' (is it a leaf that requires grad?).");
  if (before) acc->add_pre_hook(std::make_unique<LambdaPreHook>(std::move(before)));
  acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [fn = std::move(fn)](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
        fn();
        return outputs;
      }));
  return acc;
}

void resize_storage_bytes(const at::Tensor& t, size_t bytes) {
  c10::StorageImpl* si = t.storage().unsafeGetStorageImpl();
  if (si->nbytes() == bytes) return;
#if DMUON_WITH_CUDA
  if (t.is_cuda()) {
    at::native::resize_bytes_cuda(si, bytes);
    return;
  }
#endif
  at::native::resize_bytes_cpu(si, bytes);
}

void restore_storage(const at::Tensor& t) {
  resize_storage_bytes(t, static_cast<size_t>(t.numel() * t.element_size()));
}

}  // namespace dmuon::detail
