// The safetensors format (see include/dmuon/safetensors.h).
#include "dmuon/safetensors.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "file_io.h"
#include "env/json_text.h"

namespace dmuon {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; this reader copies bytes as they are");

namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeader = io::kMaxSafetensorsHeader;

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"BOOL", at::kBool}, {"U8", at::kByte},      {"I8", at::kChar},      {"I16", at::kShort},  {"I32", at::kInt},
    {"I64", at::kLong},  {"F16", at::kHalf},     {"BF16", at::kBFloat16}, {"F32", at::kFloat}, {"F64", at::kDouble},
};

const char* dtype_name(at::ScalarType t, const std::string& tensor) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  TORCH_CHECK(false, "save_safetensors: tensor '", tensor, "' has dtype ", t, ", which safetensors files written "
              "by dmuon do not hold (bool, uint8, int8/16/32/64, float16, bfloat16, float32, float64). Convert it "
              "first, e.g. t.to(at::kFloat).");
}

uint64_t get_u64(const unsigned char* p) { return io::load_le(p, 8); }

}  // namespace

namespace io {
bool looks_like_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  unsigned char b[9] = {};
  if (!in.read(reinterpret_cast<char*>(b), 9)) return false;
  const uint64_t n = load_le(b, 8);
  return n >= 2 && n <= kMaxSafetensorsHeader && b[8] == '{';
}
}  // namespace io

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const std::string where = "safetensors file '" + path + "'";
  TORCH_CHECK(std::filesystem::is_regular_file(path), where, " does not exist or is not a file.");
  io::Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(f.fd >= 0, "cannot open ", where, ": ", std::strerror(errno));
  struct stat sb {};
  TORCH_CHECK(::fstat(f.fd, &sb) == 0, "cannot stat ", where, ": ", std::strerror(errno));
  const auto size = static_cast<uint64_t>(sb.st_size);
  unsigned char lenb[8] = {};
  TORCH_CHECK(size >= 8 && io::read_at(f.fd, lenb, 8, 0) == 8, where, " is truncated: ", size,
              " bytes, shorter than the 8-byte header length (an interrupted copy, or not a safetensors file).");
  const uint64_t n = get_u64(lenb);
  TORCH_CHECK(n <= kMaxHeader, where, " is not a safetensors file: its first 8 bytes announce a ", n,
              "-byte header (at most ", kMaxHeader, "; a different format, or damaged?).");
  TORCH_CHECK(8 + n <= size, where, " is truncated: its header is ", n, " bytes but the file holds ", size - 8,
              " after the length (an interrupted copy or a full disk?).");
  std::string text(static_cast<size_t>(n), '\0');
  TORCH_CHECK(io::read_at(f.fd, text.data(), text.size(), 8) == text.size(), "reading the header of ", where,
              " failed: ", std::strerror(errno));
  json h;
  try {
    h = json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, where, " is not a safetensors file: its header is not JSON (", e.what(), ").");
  }
  TORCH_CHECK(h.is_object(), where, " is not a safetensors file: its header is JSON but not an object.");
  data_start_ = 8 + n;
  const uint64_t data_size = size - data_start_;
  std::vector<std::pair<uint64_t, std::string>> order;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      TORCH_CHECK(it->is_object(), where, ": \"__metadata__\" must be an object of strings, got ", detail::json_brief(*it));
      for (auto m = it->begin(); m != it->end(); ++m) {
        TORCH_CHECK(m->is_string(), where, ": metadata value '", m.key(), "' is not a string (", detail::json_brief(*m),
                    "); safetensors metadata maps strings to strings.");
        metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const std::string bad = where + ": tensor '" + name + "' ";
    const json& e = *it;
    TORCH_CHECK(e.is_object() && e.contains("dtype") && e.contains("shape") && e.contains("data_offsets"), bad,
                "needs \"dtype\", \"shape\" and \"data_offsets\", got ", detail::json_brief(e));
    SafetensorsEntry en;
    TORCH_CHECK(e["dtype"].is_string(), bad, "has a dtype that is not a string: ", detail::json_brief(e["dtype"]));
    en.dtype = e["dtype"].get<std::string>();
    bool known = false;
    for (const auto& d : kDtypes)
      if (en.dtype == d.name) en.scalar_type = d.type, known = true;
    TORCH_CHECK(known, bad, "has dtype ", en.dtype, ", which dmuon does not read (it reads BOOL, U8, I8, I16, I32, "
                "I64, F16, BF16, F32, F64). Convert the file's tensor in Python first.");
    TORCH_CHECK(e["shape"].is_array(), bad, "has a shape that is not a list: ", detail::json_brief(e["shape"]));
    // the byte count in 64 bits without wrapping: a shape whose product overflows is a damaged header, not a
    // tensor whose "size" wrapped to the bytes given
    uint64_t bytes = c10::elementSize(en.scalar_type);
    bool overflow = false;
    for (const json& s : e["shape"]) {
      TORCH_CHECK(s.is_number_integer() && s.get<int64_t>() >= 0, bad, "has a bad shape ", detail::json_brief(e["shape"]));
      en.shape.push_back(s.get<int64_t>());
      overflow = __builtin_mul_overflow(bytes, static_cast<uint64_t>(s.get<int64_t>()), &bytes) || overflow;
    }
    TORCH_CHECK(!overflow && bytes <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), bad, "has shape ",
                detail::json_brief(e["shape"]), ", whose ", en.dtype, " size overflows 64 bits (the header is damaged).");
    const json& o = e["data_offsets"];
    TORCH_CHECK(o.is_array() && o.size() == 2 && o[0].is_number_unsigned() && o[1].is_number_unsigned(), bad,
                "has data_offsets that are not two byte offsets: ", detail::json_brief(o));
    en.begin = o[0].get<uint64_t>();
    en.end = o[1].get<uint64_t>();
    TORCH_CHECK(en.begin <= en.end && en.end <= data_size, bad, "lies at bytes [", en.begin, ", ", en.end,
                ") but the data section has ", data_size, " bytes (the file is truncated or its header damaged).");
    const uint64_t want = bytes;
    TORCH_CHECK(en.end - en.begin == want, bad, "has ", en.end - en.begin, " bytes, but ", en.dtype, " of shape ",
                detail::json_brief(e["shape"]), " needs ", want, " (the header is damaged).");
    order.emplace_back(en.begin, name);
    entries_.emplace(name, std::move(en));
  }
  // the data must be exactly the tensors, packed: no overlaps, holes or trailing bytes
  std::sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : entries_.at(a.second).end < entries_.at(b.second).end;
  });
  uint64_t pos = 0;
  for (const auto& [begin, name] : order) {
    const SafetensorsEntry& en = entries_.at(name);
    TORCH_CHECK(begin == pos, where, ": tensor '", name, "' starts at byte ", begin, " of the data, but the tensors "
                "before it end at ", pos, " (", begin < pos ? "overlapping tensors" : "a gap", "; the header is "
                "damaged).");
    pos = en.end;
  }
  TORCH_CHECK(pos == data_size, where, " has ", data_size - pos, " bytes after its last tensor (a damaged header, "
              "or bytes appended to the file).");
}

std::vector<std::string> SafetensorsFile::keys() const {
  std::vector<std::string> k;
  for (const auto& [name, e] : entries_) k.push_back(name);
  return k;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  TORCH_CHECK(it != entries_.end(), "safetensors file '", path_, "' has no tensor '", name, "' (it holds ",
              entries_.size(), " tensors", entries_.empty() ? std::string() : ", e.g. '" + entries_.begin()->first + "'",
              ").");
  return it->second;
}

namespace {
// `n` bytes at `offset` of `path` into a new tensor of `shape` and `type`.
at::Tensor read_tensor(const std::string& path, const std::string& name, at::ScalarType type,
                       const std::vector<int64_t>& shape, uint64_t offset, size_t n) {
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type));
  io::Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(f.fd >= 0, "cannot open safetensors file '", path, "': ", std::strerror(errno));
  TORCH_CHECK(io::read_at(f.fd, t.data_ptr(), n, offset) == n, "reading tensor '", name, "' from safetensors file '",
              path, "' failed (the file shrank since it was opened?): ", std::strerror(errno));
  return t;
}
}  // namespace

at::Tensor SafetensorsFile::load_rows(const std::string& name, int64_t first, int64_t count) const {
  const SafetensorsEntry& e = entry(name);
  TORCH_CHECK(!e.shape.empty(), "safetensors file '", path_, "': tensor '", name, "' is 0-dimensional and has no rows; "
              "use load().");
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= e.shape[0], "safetensors file '", path_, "': rows [",
              first, ", ", first + count, ") of tensor '", name, "' are outside its ", e.shape[0], " rows.");
  std::vector<int64_t> shape = e.shape;
  shape[0] = count;
  const uint64_t row_bytes = e.shape[0] == 0 ? 0 : (e.end - e.begin) / static_cast<uint64_t>(e.shape[0]);
  return read_tensor(path_, name, e.scalar_type, shape, data_start_ + e.begin + static_cast<uint64_t>(first) * row_bytes,
                     static_cast<size_t>(row_bytes * static_cast<uint64_t>(count)));
}

at::Tensor SafetensorsFile::load(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  return read_tensor(path_, name, e.scalar_type, e.shape, data_start_ + e.begin, static_cast<size_t>(e.end - e.begin));
}

SafetensorsDict SafetensorsFile::load_all() const {
  SafetensorsDict d;
  for (const auto& [name, e] : entries_) d.emplace(name, load(name));
  return d;
}

void save_safetensors(const std::string& path, const SafetensorsDict& tensors,
                      const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) {
    json m = json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = m;
  }
  std::vector<at::Tensor> data;
  uint64_t pos = 0;
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(!name.empty() && name != "__metadata__", "save_safetensors: '", path, "': the tensor name '", name,
                "' is not allowed (empty, or the format's reserved \"__metadata__\").");
    TORCH_CHECK(t.defined(), "save_safetensors: '", path, "': tensor '", name, "' is undefined.");
    at::Tensor c = t.detach().cpu().contiguous();
    json shape = json::array();
    for (int64_t s : c.sizes()) shape.push_back(s);
    const uint64_t n = c.nbytes();
    h[name] = {{"dtype", dtype_name(c.scalar_type(), name)}, {"shape", shape}, {"data_offsets", {pos, pos + n}}};
    pos += n;
    data.push_back(std::move(c));
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // the data starts 8-byte aligned, as the Python library writes
  io::write_atomically(path, "save_safetensors", [&](int fd) {
    unsigned char lenb[8];
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i, n >>= 8) lenb[i] = static_cast<unsigned char>(n & 0xFF);
    int err = io::write_all(fd, lenb, 8, 0);
    if (err == 0) err = io::write_all(fd, header.data(), header.size(), 8);
    uint64_t off = 8 + header.size();
    for (const at::Tensor& c : data) {
      if (err != 0) break;
      err = io::write_all(fd, c.data_ptr(), c.nbytes(), off);
      off += c.nbytes();
    }
    if (err != 0) throw std::runtime_error(std::strerror(err));
  });
}

std::map<std::string, std::string> safetensors_weight_map(const std::string& path) {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> map;
  const std::string suffix = ".index.json";
  if (path.size() < suffix.size() || path.compare(path.size() - suffix.size(), suffix.size(), suffix) != 0) {
    for (const std::string& k : SafetensorsFile(path).keys()) map[k] = path;
    return map;
  }
  std::ifstream in(path);
  TORCH_CHECK(in, "safetensors index '", path, "' cannot be read: ", std::strerror(errno));
  json idx;
  try {
    idx = json::parse(in);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "safetensors index '", path, "' is not JSON: ", e.what());
  }
  TORCH_CHECK(idx.is_object() && idx.contains("weight_map") && idx["weight_map"].is_object(), "safetensors index '",
              path, "' has no \"weight_map\" object (the layout of transformers' model.safetensors.index.json).");
  const fs::path dir = fs::path(path).parent_path();
  for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
    TORCH_CHECK(it->is_string(), "safetensors index '", path, "': weight_map entry '", it.key(),
                "' is not a file name: ", detail::json_brief(*it));
    // a shard beside the index, as transformers writes them: an absolute path or one climbing out ("..") would
    // read a file the index's directory does not hold
    const fs::path shard(it->get<std::string>());
    bool climbs = false;
    for (const auto& part : shard) climbs = climbs || part == "..";
    TORCH_CHECK(!shard.empty() && shard.is_relative() && !climbs, "safetensors index '", path, "': weight_map entry '",
                it.key(), "' names '", shard.string(), "', not a shard file beside the index (transformers writes "
                "bare file names such as model-00001-of-00002.safetensors).");
    map[it.key()] = (dir / shard).string();
  }
  // every shard must hold what the index says it holds
  std::map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : map) by_file[file].push_back(name);
  for (const auto& [file, names] : by_file) {
    const SafetensorsFile f(file);
    for (const auto& n : names)
      TORCH_CHECK(f.contains(n), "safetensors index '", path, "' places tensor '", n, "' in '", file,
                  "', which does not hold it (a shard from another export?).");
  }
  return map;
}

SafetensorsDict load_safetensors(const std::string& path) {
  std::map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : safetensors_weight_map(path)) by_file[file].push_back(name);
  SafetensorsDict d;
  for (const auto& [file, names] : by_file) {
    const SafetensorsFile f(file);
    for (const auto& n : names) d.emplace(n, f.load(n));
  }
  return d;
}

}  // namespace dmuon
