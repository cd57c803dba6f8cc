// deferred_init.h -- building a model larger than one rank: parameters without storage until
// dedicate_params gives each rank what it keeps.
//
// LibTorch initialises eagerly, and a parameter cannot move to the meta device and back in C++
// (set_data refuses a tensor of another backend). dmuon's deferred parameter is instead a parameter
// of its final dtype and device whose storage is released: name, shape, dtype, device and
// requires_grad stay, no bytes are held. Construct the model block by block and defer each block
// as soon as it exists, so construction never holds more than one block:
//
//   for (int i = 0; i < n_layers; ++i) {
//     auto block = layers->push_back(Block(cfg));  // LibTorch initialises it...
//     dmuon::defer_parameters(*block);             // ...and it gives its memory back at once
//   }
//   dmuon::DedicateOptions opts;
//   opts.param_source = dmuon::seeded_init(seed, rule);  // or dmuon::safetensors_source(path)
//   dmuon::dedicate_params(model, mesh, predicate, opts);  // materialises only what this rank keeps
//
// dedicate_params fills, from the source, only what the rank keeps between steps: its own matrices
// (holders: the owner, each replicate group's holder on HSDP, every rank on the DDP path), its
// sharded_adamw slices, and the replicated and frozen parameters; a tensor-parallel parameter gets
// its slice. Everything else stays without storage. A ParamSource serves any box of a parameter's
// full (single-process) value, so the values do not depend on the layout: seeded_init draws every
// parameter from a generator seeded by (seed, name), the same on 1 rank or 64.
// initialize_parameters does the same for an undedicated model (a single-process reference).
// Reading a deferred parameter's data before that is undefined (it has no bytes): do not call
// Module::to with another dtype or device on it (build it in its final dtype and device instead),
// print it or compute with it; replicate() without a param_source refuses a deferred model.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dmuon/mesh.h"

namespace dmuon {

// A box of a parameter's full (single-process) value: dimension d covers [start[d], start[d] + size[d]).
struct TensorRegion {
  std::vector<int64_t> full_shape;
  std::vector<int64_t> start;
  std::vector<int64_t> size;
  static TensorRegion whole(at::IntArrayRef full_shape);
  bool is_whole() const;
  bool rows_only() const;  // only dimension 0 is restricted (a contiguous byte range of the full value)
  int64_t numel() const;
  at::Tensor cut(const at::Tensor& full) const;  // the box, as a view of the full value
};

// Where deferred parameters (and owner-local loads) take their values from.
class ParamSource {
 public:
  virtual ~ParamSource() = default;
  // Called once before any fill with every parameter that will be asked for and its full shape.
  // Throws, naming the parameter, when the source cannot serve one (missing, misshapen, extra).
  virtual void check(const std::vector<std::pair<std::string, std::vector<int64_t>>>& params) { (void)params; }
  // Writes the box `region` of parameter `name`'s full value into `out` (shape region.size, in the
  // dtype and device the rank keeps: the master copy's where mixed precision keeps one). A load into a
  // model that has values (set_model_state_dict) calls it twice per box: first into a CPU scratch tensor
  // (a dry run: every rank reads, and so verifies, all it needs before any rank writes), then into `out`;
  // the same box must give the same values both times.
  virtual void fill(const std::string& name, const TensorRegion& region, at::Tensor& out) = 0;
  // true when fill cannot fail once check() passed (values already in memory): no dry run is needed.
  virtual bool fills_cannot_fail() const { return false; }
  virtual std::string describe() const = 0;  // for error messages ("seeded init (seed 0)", a file path)
  // What identifies the values served, known without reading them: the ranks compare it before they fill from
  // the source (dedicate_params with a param_source, set_model_state_dict), so ranks given different sources
  // (another seed, a stale copy of a file) fail instead of drifting apart. seeded_init: its seed; a dict: its
  // names, dtypes and shapes; safetensors: its tensors' names, dtypes, shapes and recorded checksums. 0: the
  // source cannot tell (nothing is compared).
  virtual uint64_t digest() const { return 0; }
};

// Fills `full` (a float32 CPU tensor of the parameter's full shape) with its initial value, drawing
// from `gen` (seeded from the seed and the name).
using InitRule = std::function<void(const std::string& name, at::Tensor& full, at::Generator& gen)>;
// A source that computes each parameter from (seed, name): independent of the layout, the dtype
// (drawn in float32, then converted) and the device (drawn on the CPU, then copied).
std::shared_ptr<ParamSource> seeded_init(uint64_t seed, InitRule rule);
// A source over full values held in memory (a state dict: name -> the single-process tensor).
// `what` names it in errors.
std::shared_ptr<ParamSource> tensor_dict_source(std::map<std::string, at::Tensor> values,
                                                std::string what = "the state dict");
// The generator seed of parameter `name` under `seed` (FNV-1a of the name, mixed with the seed).
uint64_t param_seed(uint64_t seed, const std::string& name);

// Releases the storage of every parameter of `module` (recursively), giving it `dtype` / `device`
// when set (floating parameters only take the dtype). Parameters already deferred are left alone.
void defer_parameters(torch::nn::Module& module, std::optional<at::ScalarType> dtype = std::nullopt,
                      std::optional<at::Device> device = std::nullopt);
// Whether `t` has a shape but no storage behind it (a deferred parameter).
bool is_deferred(const at::Tensor& t);
// The names of `model`'s deferred parameters, in model order.
std::vector<std::string> deferred_parameters(const torch::nn::Module& model);

// Fills every parameter of an undedicated `model` from `source` (deferred ones are materialised;
// tensor-parallel parameters take their slice over tp_mesh's TP axis). The single-process
// reference of a deferred run, and eager loading. local: no collective.
void initialize_parameters(torch::nn::Module& model, ParamSource& source, const std::shared_ptr<Mesh>& tp_mesh = nullptr);

namespace detail {
// A tensor of `shape` and `options` with no storage bytes (what a deferred parameter holds).
at::Tensor unallocated(at::IntArrayRef shape, const at::TensorOptions& options);
// The box of a tensor-parallel slice: dimension `dim` (-1: whole) split in `tp` equal parts, part `tp_rank`.
TensorRegion tp_region(at::IntArrayRef local_shape, int dim, int tp_rank, int tp);
// Rows of `local` (a box of the full value) covering the flat element range [begin, begin + len)
// of its row-major flattening, and the offset of `begin` inside those rows.
std::pair<TensorRegion, int64_t> rows_covering(const TensorRegion& local, int64_t begin, int64_t len);
// The checks of ParamSource::check for a source that holds `available` (name -> full shape, and
// whether floating): every wanted parameter present with its shape and floating; with
// allow_extra=false, nothing else. Errors start with `what` and name the tensor.
struct AvailableTensor {
  std::vector<int64_t> shape;
  bool floating = true;
};
void check_source(const std::string& what, const std::map<std::string, AvailableTensor>& available,
                  const std::vector<std::pair<std::string, std::vector<int64_t>>>& wanted, bool allow_extra);
}  // namespace detail

}  // namespace dmuon
