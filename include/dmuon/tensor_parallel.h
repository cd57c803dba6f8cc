// tensor_parallel.h -- Megatron-style tensor-parallel modules over a Mesh's TP axis.
//
// LibTorch has no DTensor or parallelize_module, so dmuon provides the TP side itself:
//   * ColumnParallelLinear: y_t = x W_t^T + b_t with W split along dim 0 (output features): every TP
//     rank computes its slice of the output from the full input; the input's gradient is summed over
//     the TP group in backward.
//   * RowParallelLinear: y = sum_t x_t W_t^T + b with W split along dim 1 (input features): the input
//     is this rank's slice (e.g. a column-parallel output), the partial products are all-reduced over
//     the TP group in forward; the bias is whole and identical on every TP rank.
// A column-parallel layer followed by a row-parallel one (q/k/v by heads then o; gate/up then down)
// needs one all-reduce per pair in forward and one in backward.
//
// Initialisation equals slicing the single-process initialisation: each module builds the full
// torch::nn::Linear (drawing from the RNG exactly as a single-process model would) and keeps its
// slice, so a TP run built with the same seed starts where the single-process run starts.
//
// Each module reports which dimension of which parameter is split (TensorParallel::tp_split), so
// dedicate_params knows which Muon matrices are TP-sharded: their DP owner holds this rank's slice,
// and the optimizer orthogonalises the full matrix (see muon.h, tp_distributed_gram).
//
// collective: forward and backward of these modules issue all-reduces over mesh->tp(); every rank
// of a TP group must run the same modules in the same order.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dmuon/mesh.h"

namespace dmuon {

// Implemented by every module whose parameters are split over a mesh's TP axis.
class TensorParallel {
 public:
  virtual ~TensorParallel() = default;
  virtual const std::shared_ptr<Mesh>& tp_mesh() const = 0;
  // (name in the module's own named_parameters(), split dimension) of each split parameter
  virtual std::vector<std::pair<std::string, int>> tp_split() const = 0;
};

// Every split parameter of `model` (full names as in named_parameters()) and its split dimension.
std::map<std::string, int> tp_split_dims(const torch::nn::Module& model);
// This TP rank's slice of `full` along `dim` (a contiguous copy). Throws when the dimension is not
// divisible by tp_size.
at::Tensor tp_slice(const at::Tensor& full, int dim, int tp_rank, int tp_size);
// collective (mesh.tp()): the full tensor from every TP rank's slice along `dim`.
at::Tensor tp_gather(const at::Tensor& local, int dim, Mesh& mesh);

// Autograd operators (Megatron's f and g). collective over mesh->tp() in backward / forward.
at::Tensor tp_copy_to_parallel(const at::Tensor& x, const std::shared_ptr<Mesh>& mesh);      // identity; grad summed
at::Tensor tp_reduce_from_parallel(const at::Tensor& x, const std::shared_ptr<Mesh>& mesh);  // sum; grad identity

struct ParallelLinearOptions {
  ParallelLinearOptions(int64_t in_features, int64_t out_features) : in(in_features), out(out_features) {}
  int64_t in, out;
  bool bias = false;
  ParallelLinearOptions& with_bias(bool b) {
    bias = b;
    return *this;
  }
};

// What the two parallel linears share: the full torch::nn::Linear built and sliced along
// `split_dim` of the weight (the bias sliced too when `split_bias`, else kept whole).
class ParallelLinearBase : public torch::nn::Module, public TensorParallel {
 public:
  const std::shared_ptr<Mesh>& tp_mesh() const override { return mesh_; }
  std::vector<std::pair<std::string, int>> tp_split() const override;
  at::Tensor weight, bias;

 protected:
  ParallelLinearBase(const ParallelLinearOptions& opts, std::shared_ptr<Mesh> mesh, int split_dim, bool split_bias,
                     const char* kind);
  void check_not_placeholder() const;  // a dedicated weight outside its boundary is a clear error
  ParallelLinearOptions opts_;
  std::shared_ptr<Mesh> mesh_;
  int split_dim_;
  bool split_bias_;
  const char* kind_;
};

// weight [out / T, in], bias [out / T]; forward: x [..., in] -> [..., out / T].
class ColumnParallelLinearImpl : public ParallelLinearBase {
 public:
  ColumnParallelLinearImpl(const ParallelLinearOptions& opts, std::shared_ptr<Mesh> mesh);
  at::Tensor forward(const at::Tensor& x);
};
TORCH_MODULE(ColumnParallelLinear);

// weight [out, in / T], bias [out] (whole); forward: x [..., in / T] -> [..., out] (all-reduced).
class RowParallelLinearImpl : public ParallelLinearBase {
 public:
  RowParallelLinearImpl(const ParallelLinearOptions& opts, std::shared_ptr<Mesh> mesh);
  at::Tensor forward(const at::Tensor& x);
};
TORCH_MODULE(RowParallelLinear);

}  // namespace dmuon
