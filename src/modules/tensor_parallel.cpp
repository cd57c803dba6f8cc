// Tensor-parallel modules and their autograd operators (see include/dmuon/tensor_parallel.h).
#include "dmuon/tensor_parallel.h"

#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/linear.h>

namespace dmuon {

namespace {

// The mesh, carried through an autograd context (saved_data holds IValues).
struct MeshCapsule : torch::CustomClassHolder {
  explicit MeshCapsule(std::shared_ptr<Mesh> m) : mesh(std::move(m)) {}
  std::shared_ptr<Mesh> mesh;
};
c10::IValue capsule(const std::shared_ptr<Mesh>& mesh) {
  return c10::IValue::make_capsule(c10::make_intrusive<MeshCapsule>(mesh));
}
Mesh& mesh_of(const torch::autograd::AutogradContext* ctx) {
  auto holder = ctx->saved_data.at("mesh").toCapsule();
  return *static_cast<MeshCapsule*>(holder.get())->mesh;
}

at::Tensor all_reduce_tp(const at::Tensor& x, Mesh& mesh, const char* what) {
  Communicator* tp = mesh.tp();
  at::Tensor out = x.contiguous().clone();
  if (tp) tp->allreduce(out, Reduction::Sum, what).wait();
  return out;
}

struct CopyToParallel : torch::autograd::Function<CopyToParallel> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, c10::IValue mesh) {
    ctx->saved_data["mesh"] = std::move(mesh);
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {all_reduce_tp(grads[0], mesh_of(ctx), "tensor-parallel input gradient (column-parallel backward)"),
            at::Tensor()};
  }
};

struct ReduceFromParallel : torch::autograd::Function<ReduceFromParallel> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x, c10::IValue mesh) {
    auto holder = mesh.toCapsule();
    return all_reduce_tp(x, *static_cast<MeshCapsule*>(holder.get())->mesh,
                         "tensor-parallel partial sums (row-parallel forward)");
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// The full torch::nn::Linear a single-process model would build (same RNG draws).
torch::nn::Linear full_linear(const ParallelLinearOptions& o) {
  return torch::nn::Linear(torch::nn::LinearOptions(o.in, o.out).bias(o.bias));
}

}  // namespace

std::map<std::string, int> tp_split_dims(const torch::nn::Module& model) {
  std::map<std::string, int> out;
  auto add = [&](const std::string& prefix, const torch::nn::Module& m) {
    if (const auto* tp = dynamic_cast<const TensorParallel*>(&m))
      for (const auto& [name, dim] : tp->tp_split()) out[prefix.empty() ? name : prefix + "." + name] = dim;
  };
  add("", model);  // (include_self would need the model in a shared_ptr: not so inside a constructor)
  for (const auto& item : model.named_modules("", /*include_self=*/false)) add(item.key(), *item.value());
  return out;
}

at::Tensor tp_slice(const at::Tensor& full, int dim, int tp_rank, int tp_size) {
  TORCH_CHECK(dim >= 0 && dim < full.dim(), "tp_slice: dimension ", dim, " out of range for shape ", full.sizes());
  TORCH_CHECK(full.size(dim) % tp_size == 0, "tp_slice: dimension ", dim, " of shape ", full.sizes(),
              " is not divisible by tp_size ", tp_size, ".");
  const int64_t len = full.size(dim) / tp_size;
  return full.narrow(dim, tp_rank * len, len).contiguous().clone();
}

at::Tensor tp_gather(const at::Tensor& local, int dim, Mesh& mesh) {
  const int T = mesh.tp_size();
  if (T == 1) return local.clone();
  at::Tensor flat = at::empty({local.numel() * T}, local.options());
  mesh.tp()->allgather_flat(flat, local.contiguous().reshape(-1), "tp_gather").wait();
  std::vector<at::Tensor> parts;
  for (int t = 0; t < T; ++t) parts.push_back(flat.narrow(0, t * local.numel(), local.numel()).view(local.sizes()));
  return at::cat(parts, dim);
}

at::Tensor tp_copy_to_parallel(const at::Tensor& x, const std::shared_ptr<Mesh>& mesh) {
  if (!mesh->has_tp()) return x;
  return CopyToParallel::apply(x, capsule(mesh));
}

at::Tensor tp_reduce_from_parallel(const at::Tensor& x, const std::shared_ptr<Mesh>& mesh) {
  if (!mesh->has_tp()) return x;
  return ReduceFromParallel::apply(x, capsule(mesh));
}

ParallelLinearBase::ParallelLinearBase(const ParallelLinearOptions& opts, std::shared_ptr<Mesh> mesh, int split_dim,
                                       bool split_bias, const char* kind)
    : opts_(opts), mesh_(std::move(mesh)), split_dim_(split_dim), split_bias_(split_bias), kind_(kind) {
  TORCH_CHECK(mesh_, kind, ": the mesh is null; create one with dmuon::Mesh::create (MeshOptions::tp_size).");
  const int T = mesh_->tp_size(), t = mesh_->tp_rank();
  const int64_t size = split_dim == 0 ? opts.out : opts.in;
  TORCH_CHECK(size % T == 0, "rank ", mesh_->global_rank(), ": ", kind, ": ", split_dim == 0 ? "out" : "in",
              "_features (", size, ") is not divisible by the mesh's tp_size ", T, ", so the TP ranks cannot hold "
              "equal slices. Pick a tp_size that divides ", size, " (for attention, one that divides the number of "
              "heads).");
  at::NoGradGuard ng;
  auto full = full_linear(opts);
  weight = register_parameter("weight", tp_slice(full->weight.detach(), split_dim, t, T));
  if (opts.bias)
    bias = register_parameter("bias", split_bias ? tp_slice(full->bias.detach(), 0, t, T) : full->bias.detach().clone());
}

std::vector<std::pair<std::string, int>> ParallelLinearBase::tp_split() const {
  if (!mesh_->has_tp()) return {};
  std::vector<std::pair<std::string, int>> out{{"weight", split_dim_}};
  if (opts_.bias && split_bias_) out.emplace_back("bias", 0);
  return out;
}

void ParallelLinearBase::check_not_placeholder() const {
  TORCH_CHECK(weight.numel() > 0, "rank ", mesh_->global_rank(), ": ", kind_, ": its weight is a 0-element "
              "placeholder (dmuon dedicated it, and this rank is not its owner), so the module ran outside its hook "
              "boundary. Run the block that contains it through `x = dmuon::forward(block, x)`, which unshards the "
              "weight.");
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const ParallelLinearOptions& opts, std::shared_ptr<Mesh> mesh)
    : ParallelLinearBase(opts, std::move(mesh), 0, /*split_bias=*/true, "ColumnParallelLinear") {}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  check_not_placeholder();
  return at::linear(tp_copy_to_parallel(x, mesh_), weight, bias);
}

RowParallelLinearImpl::RowParallelLinearImpl(const ParallelLinearOptions& opts, std::shared_ptr<Mesh> mesh)
    : ParallelLinearBase(opts, std::move(mesh), 1, /*split_bias=*/false, "RowParallelLinear") {}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  check_not_placeholder();
  at::Tensor y = tp_reduce_from_parallel(at::linear(x, weight), mesh_);
  return bias.defined() ? y + bias : y;
}

}  // namespace dmuon
