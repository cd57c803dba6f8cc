// Safetensors files as a ParamSource: owner-local, verified reads (see safetensors.h).
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <memory>

#include "dmuon/checkpoint.h"
#include "dmuon/digest.h"
#include "dmuon/safetensors.h"

namespace dmuon {

namespace {

constexpr int64_t kVerifyChunkBytes = int64_t{8} << 20;  // rows streamed through the CRC at a time

class SafetensorsSource final : public ParamSource {
 public:
  SafetensorsSource(const std::string& path, SafetensorsSourceOptions o) : o_(std::move(o)) {
    if (o_.what.empty()) o_.what = path;
    for (const auto& [key, file] : safetensors_weight_map(path)) {
      if (key.rfind(o_.prefix, 0) != 0) continue;
      if (o_.ignore && o_.ignore(key)) continue;
      auto& f = files_[file];
      if (!f) f = std::make_shared<SafetensorsFile>(file);
      by_key_[key] = f;
    }
  }

  void check(const std::vector<std::pair<std::string, std::vector<int64_t>>>& params) override {
    std::map<std::string, detail::AvailableTensor> avail;
    for (const auto& [key, f] : by_key_) {
      const SafetensorsEntry& e = f->entry(key);
      avail[key.substr(o_.prefix.size())] = {e.shape, at::isFloatingType(e.scalar_type)};
    }
    detail::check_source(o_.what, avail, params, o_.allow_extra);
  }

  void fill(const std::string& name, const TensorRegion& region, at::Tensor& out) override {
    at::NoGradGuard ng;
    const std::string key = o_.prefix + name;
    auto it = by_key_.find(key);
    TORCH_CHECK(it != by_key_.end(), o_.what, ": the model's parameter '", name, "' is not in the file.");
    const SafetensorsFile& f = *it->second;
    const SafetensorsEntry& e = f.entry(key);
    TORCH_CHECK(e.shape == region.full_shape, o_.what, ": tensor '", key, "' has shape ", at::IntArrayRef(e.shape),
                " but the model has ", at::IntArrayRef(region.full_shape), ".");
    if (!e.shape.empty() && region.rows_only() && !region.is_whole()) {
      verify_streaming(f, key, e);
      out.copy_(f.load_rows(key, region.start[0], region.size[0]));
      return;
    }
    const at::Tensor whole = f.load(key);
    verify(key, whole);
    out.copy_(region.cut(whole));
  }

  std::string describe() const override { return o_.what; }
  uint64_t digest() const override {  // (the header and the recorded checksums: no tensor is read)
    Fnv1a h;
    h.str(o_.prefix);
    for (const auto& [key, f] : by_key_) {
      const SafetensorsEntry& e = f->entry(key);
      h.str(key).str(e.dtype).i64(static_cast<int64_t>(e.shape.size()));
      for (int64_t d : e.shape) h.i64(d);
      const auto crc = o_.crc32c.find(key);
      h.u64(crc == o_.crc32c.end() ? uint64_t{1} << 32 : crc->second);
    }
    return h.value();
  }

 private:
  void check_crc(const std::string& key, uint32_t got) const {
    const uint32_t want = o_.crc32c.at(key);
    TORCH_CHECK(want == got, o_.what, " is corrupt; the damage is in '", key, "' (stored checksum ", want, ", read ",
                got, "). The file was damaged after it was written: use another copy or checkpoint.");
  }
  void verify(const std::string& key, const at::Tensor& whole) const {
    if (!o_.crc32c.count(key)) return;
    const at::Tensor c = whole.contiguous();
    check_crc(key, checkpoint_crc32c(c.data_ptr(), c.nbytes()));
  }
  // the whole tensor's checksum, computed a chunk of rows at a time
  void verify_streaming(const SafetensorsFile& f, const std::string& key, const SafetensorsEntry& e) const {
    if (!o_.crc32c.count(key)) return;
    const int64_t rows = e.shape[0];
    const int64_t row_bytes = rows == 0 ? 0 : static_cast<int64_t>(e.end - e.begin) / rows;
    const int64_t step = std::max<int64_t>(1, row_bytes == 0 ? rows : kVerifyChunkBytes / std::max<int64_t>(1, row_bytes));
    uint32_t crc = 0;
    for (int64_t r = 0; r < rows; r += step) {
      const at::Tensor part = f.load_rows(key, r, std::min(step, rows - r));
      crc = checkpoint_crc32c(part.data_ptr(), part.nbytes(), crc);
    }
    check_crc(key, crc);
  }

  SafetensorsSourceOptions o_;
  std::map<std::string, std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::shared_ptr<SafetensorsFile>> by_key_;
};

}  // namespace

std::shared_ptr<ParamSource> safetensors_source(const std::string& path, SafetensorsSourceOptions options) {
  return std::make_shared<SafetensorsSource>(path, std::move(options));
}

}  // namespace dmuon
