// safetensors.h -- reading and writing the safetensors format (Hugging Face's tensor file, the one
// Python's `safetensors`, `transformers` and `torch` tooling open), with no dependency beyond LibTorch.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {"k": "v", ...}, "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]}, ...}
// padded with spaces to a multiple of 8, then the tensors' bytes (little-endian, row-major), each at
// [b, e) relative to the end of the header, packed with no gaps.
//
//   dmuon::save_safetensors("model.safetensors", dmuon::get_model_state_dict(*model));  // rank 0, atomic
//   dmuon::SafetensorsFile f("model.safetensors");     // parses and checks the header only
//   at::Tensor w = f.load("model.layers.0.mlp.up_proj.weight");   // reads that tensor's bytes
//   at::Tensor rows = f.load_rows("lm_head.weight", 128, 64);      // or rows [128, 192) of it
//
// Reading checks the whole structure before any tensor is handed out: the header's length and JSON,
// every dtype, shape and offset pair (inside the data, the right size for its shape, no overlaps, no
// gaps, nothing after the last tensor). A violation is an error naming the file and the tensor.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dmuon/deferred_init.h"

namespace dmuon {

using SafetensorsDict = std::map<std::string, at::Tensor>;

struct SafetensorsEntry {
  std::string dtype;             // the format's name: F32, BF16, I64, ...
  at::ScalarType scalar_type{};  // LibTorch's
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;   // byte range relative to the start of the data
};

// One safetensors file, open for reading tensors by name (positioned reads: only the bytes of the
// tensors asked for are read, so a rank that keeps a slice never reads the whole file).
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return path_; }
  std::vector<std::string> keys() const;  // sorted
  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  const SafetensorsEntry& entry(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The whole tensor, as a new contiguous CPU tensor.
  at::Tensor load(const std::string& name) const;
  // Rows [first, first + count) along dim 0 (a 0-dim tensor has no rows).
  at::Tensor load_rows(const std::string& name, int64_t first, int64_t count) const;
  SafetensorsDict load_all() const;

 private:
  std::string path_;
  uint64_t data_start_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes every tensor (moved to the CPU, made contiguous) with `metadata` as "__metadata__",
// atomically (a temporary file renamed over `path`). Names must be non-empty and not
// "__metadata__"; dtypes are those the format has (bool, uint8, int8/16/32/64, float16, bfloat16,
// float32, float64).
void save_safetensors(const std::string& path, const SafetensorsDict& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// A model's weights as Hugging Face publishes them: one `*.safetensors` file, or a sharded set
// described by `*.safetensors.index.json` ({"weight_map": {"<name>": "<file>", ...}}; the files are
// relative to the index's directory). Maps every tensor name to the file that holds it.
std::map<std::string, std::string> safetensors_weight_map(const std::string& path);
// Every tensor of such a file or sharded set.
SafetensorsDict load_safetensors(const std::string& path);

// Weights in safetensors files as a ParamSource (deferred_init.h), for owner-local loading: each
// rank reads, by offset, only the tensors it keeps, and of a tensor it keeps a slice of (a
// tensor-parallel slice along dimension 0, a sharded_adamw slice) only those rows.
struct SafetensorsSourceOptions {
  std::string prefix;  // parameter <name> is tensor "<prefix><name>" (e.g. "model/" in a checkpoint)
  // tensors of the file that serve no parameter and are not an error (e.g. rotary inv_freq buffers)
  std::function<bool(const std::string& key)> ignore;
  bool allow_extra = false;  // other tensors in the file are an error unless set
  // key -> CRC32C of the tensor's bytes: each tensor read is verified first (streamed through the
  // checksum in chunks, so a rank that keeps a few rows never holds the whole tensor)
  std::map<std::string, uint32_t> crc32c;
  std::string what;  // names the source in errors (default: the path)
};
// `path`: one `*.safetensors` file or a sharded `*.safetensors.index.json`.
std::shared_ptr<ParamSource> safetensors_source(const std::string& path, SafetensorsSourceOptions options = {});

}  // namespace dmuon
