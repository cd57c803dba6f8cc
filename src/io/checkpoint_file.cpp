// Checkpoint files (see include/dmuon/checkpoint.h). dmuon writes safetensors checkpoints
// (checkpoint_safetensors.cpp); this file reads both those and the format-2 archives earlier dmuon
// versions wrote (a versioned header, a CRC32C for the whole archive and for every tensor and the
// optimizer metadata, all verified on load), and holds the CRC32C both formats use.
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/serialize/archive.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <set>
#include <sstream>

#include "dmuon/checkpoint.h"
#include "checkpoint_safetensors.h"
#include "dmuon/safetensors.h"
#include "file_io.h"
#include "comm/error_text.h"

namespace dmuon {

namespace {
constexpr const char* kFormat = "dmuon-checkpoint-v2";  // the archive's "format" entry
}  // namespace

// ---- files ---------------------------------------------------------------------------------------
// Format version 2 (read only; dmuon wrote it up to 2026-12): a 32-byte header, then a
// torch::serialize archive.
//   [0, 8)   magic "DMUONCKP"
//   [8, 12)  format version (u32, little-endian)
//   [12, 16) reserved, 0
//   [16, 24) archive length in bytes (u64)
//   [24, 28) CRC32C of the archive bytes
//   [28, 32) CRC32C of bytes [0, 28)
// The archive's "checksums" dict holds a CRC32C for every tensor ("model/<key>", "optim_muon/<key>",
// "optim_adamw/<key>": over its dtype, shape and contiguous bytes) and for the optimizer metadata
// ("optimizer metadata": group names, flags, hyperparameters, steps_taken). The whole-archive
// checksum catches every changed byte; the per-entry ones say which tensor or section it hit.
namespace {

constexpr char kMagic[8] = {'D', 'M', 'U', 'O', 'N', 'C', 'K', 'P'};
constexpr uint32_t kVersion = 2;
constexpr size_t kHeaderSize = 32;
constexpr const char* kMetaKey = "optimizer metadata";
constexpr const char* kUserKey = "metadata";  // the caller's metadata (save_checkpoint's `metadata`)
constexpr const char* kCorruptFix =
    " The file was damaged after it was written (disk, copy or transfer): resume from another checkpoint, or "
    "re-save this one from a run that still holds the state.";

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), slicing-by-8: eight table lookups per 8 bytes.
struct Crc32cTables {
  uint32_t t[8][256];
  Crc32cTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

#if defined(__x86_64__) && defined(__GNUC__)
// The same CRC by the SSE4.2 crc32 instruction, 8 bytes at a time (several times the tables' speed).
__attribute__((target("sse4.2"))) uint32_t crc32c_words_sse42(uint32_t c, const unsigned char* p, size_t words) {
  uint64_t x = c;
  for (size_t i = 0; i < words; ++i, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    x = __builtin_ia32_crc32di(x, v);
  }
  return static_cast<uint32_t>(x);
}
bool have_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

uint32_t get_u32(const unsigned char* p) { return static_cast<uint32_t>(io::load_le(p, 4)); }
uint64_t get_u64(const unsigned char* p) { return io::load_le(p, 8); }
void put_u32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u64(unsigned char* p, uint64_t v) {
  put_u32(p, static_cast<uint32_t>(v));
  put_u32(p + 4, static_cast<uint32_t>(v >> 32));
}

std::string hex(uint32_t v) {
  std::ostringstream o;
  o << "0x" << std::hex << std::setw(8) << std::setfill('0') << v;
  return o.str();
}

// Fixed-width little-endian fields appended to a byte string (what the metadata checksum covers).
struct Bytes {
  std::string b;
  void u64(uint64_t v) {
    unsigned char p[8];
    put_u64(p, v);
    b.append(reinterpret_cast<const char*>(p), 8);
  }
  void str(const std::string& s) {
    u64(s.size());
    b += s;
  }
  uint32_t crc() const { return checkpoint_crc32c(b.data(), b.size()); }
};

// Over what is written: the dtype, the shape and the contiguous CPU bytes.
uint32_t tensor_crc(const at::Tensor& t) {
  Bytes head;
  head.str(c10::toString(t.scalar_type()));
  head.u64(static_cast<uint64_t>(t.dim()));
  for (int64_t s : t.sizes()) head.u64(static_cast<uint64_t>(s));
  const at::Tensor c = t.cpu().contiguous();
  return checkpoint_crc32c(c.data_ptr(), c.nbytes(), head.crc());
}

struct GroupLists {
  std::vector<std::string> names;
  std::vector<bool> is_muon, nesterov;
  at::Tensor hparams;  // [groups, 7] double: lr, momentum, weight_decay, beta1, beta2, eps, ns_steps
  int64_t steps_taken = 0;
};

uint32_t meta_crc(const GroupLists& g) {
  Bytes b;
  b.u64(g.names.size());
  for (const auto& n : g.names) b.str(n);
  b.u64(g.is_muon.size());
  for (bool f : g.is_muon) b.u64(f);
  b.u64(g.nesterov.size());
  for (bool f : g.nesterov) b.u64(f);
  b.u64(static_cast<uint64_t>(g.steps_taken));
  return checkpoint_crc32c(b.b.data(), b.b.size(), tensor_crc(g.hparams));
}

uint32_t user_crc(const std::map<std::string, std::string>& m) {
  Bytes b;
  b.u64(m.size());
  for (const auto& [k, v] : m) {
    b.str(k);
    b.str(v);
  }
  return b.crc();
}

// A file that is a torch archive (a zip) but has no dmuon header: a format-1 dmuon checkpoint or something else.
[[noreturn]] void refuse_zip(const std::string& path) {
  bool v1 = false;
  try {
    torch::serialize::InputArchive ar;
    ar.load_from(path);
    c10::IValue v;
    v1 = ar.try_read("format", v) && v.isString() && v.toStringRef() == "dmuon-checkpoint-v1";
  } catch (const std::exception&) {
  }
  TORCH_CHECK(!v1, "load_checkpoint: '", path, "' is a dmuon checkpoint of format version 1, which has no "
              "checksums, so its integrity cannot be verified; this dmuon reads format version ", kVersion,
              ". Write a new checkpoint with dmuon::save_checkpoint.");
  TORCH_CHECK(false, "load_checkpoint: '", path, "' is a torch archive but not a dmuon checkpoint (", kFormat,
              "); write it with dmuon::save_checkpoint.");
}

// Reads the archive's sections and checks every entry against the checksum table. Returns the
// first damaged part ("" when everything matches). Throws when the archive cannot be read.
std::string read_sections(torch::serialize::InputArchive& ar, Checkpoint& ck) {
  c10::IValue v;
  if (!ar.try_read("format", v) || !v.isString() || v.toStringRef() != kFormat)
    return "its format tag (\"format\", expected \"" + std::string(kFormat) + "\")";
  if (!ar.try_read("checksums", v) || !v.isGenericDict()) return "the checksum table (\"checksums\")";
  std::map<std::string, uint32_t> sums;
  for (const auto& it : v.toGenericDict()) sums[it.key().toStringRef()] = static_cast<uint32_t>(it.value().toInt());
  std::set<std::string> seen;
  std::string damaged;
  auto section = [&](const char* key, const char* label, TensorDict& out) {
    c10::IValue d;
    if (!ar.try_read(key, d) || !d.isGenericDict()) {
      if (damaged.empty()) damaged = std::string("the ") + label + " (\"" + key + "\")";
      return;
    }
    for (const auto& it : d.toGenericDict()) {
      const std::string& name = it.key().toStringRef();
      const at::Tensor t = it.value().toTensor();
      const std::string id = std::string(key) + "/" + name;
      auto s = sums.find(id);
      seen.insert(id);
      if (!damaged.empty()) continue;
      if (s == sums.end()) {
        damaged = "tensor '" + name + "' of the " + label + ", which has no checksum (its key or the checksum table "
                  "is damaged)";
      } else if (const uint32_t got = tensor_crc(t); got != s->second) {
        damaged = "tensor '" + name + "' of the " + label + " (stored checksum " + hex(s->second) + ", read " +
                  hex(got) + ")";
      }
      out[name] = t;
    }
  };
  section("model", "model state", ck.model);
  if (sums.count(kUserKey)) {
    seen.insert(kUserKey);
    c10::IValue m;
    if (!ar.try_read(kUserKey, m) || !m.isGenericDict()) {
      if (damaged.empty()) damaged = "the caller's metadata (\"metadata\": missing or of the wrong type)";
    } else {
      for (const auto& it : m.toGenericDict()) ck.metadata[it.key().toStringRef()] = it.value().toStringRef();
      if (damaged.empty() && user_crc(ck.metadata) != sums.at(kUserKey))
        damaged = "the caller's metadata (\"metadata\")";
    }
  }
  const bool has_optim = sums.count(kMetaKey) > 0;
  if (has_optim) {
    OptimizerStateDict o;
    section("optim_muon", "Muon state", o.muon);
    section("optim_adamw", "AdamW state", o.adamw);
    c10::IValue names, is_muon, nesterov, hp, steps;
    if (!ar.try_read("optim_group_names", names) || !ar.try_read("optim_group_is_muon", is_muon) ||
        !ar.try_read("optim_group_nesterov", nesterov) || !ar.try_read("optim_group_hparams", hp) ||
        !ar.try_read("optim_steps_taken", steps) || !names.isList() || !is_muon.isList() || !nesterov.isList() ||
        !hp.isTensor() || !steps.isInt())
      return damaged.empty() ? std::string("the ") + kMetaKey + " (an entry is missing or of the wrong type)" : damaged;
    GroupLists g;
    for (const auto& n : names.toListRef()) g.names.push_back(n.toStringRef());
    for (const auto& b : is_muon.toListRef()) g.is_muon.push_back(b.toBool());
    for (const auto& b : nesterov.toListRef()) g.nesterov.push_back(b.toBool());
    g.hparams = hp.toTensor();
    g.steps_taken = steps.toInt();
    seen.insert(kMetaKey);
    if (damaged.empty() && meta_crc(g) != sums.at(kMetaKey))
      damaged = std::string("the ") + kMetaKey + " (param_groups' names and hyperparameters, steps_taken)";
    const size_t n = g.names.size();
    if (damaged.empty() && (g.is_muon.size() != n || g.nesterov.size() != n || g.hparams.dim() != 2 ||
                            g.hparams.size(0) != static_cast<int64_t>(n) || g.hparams.size(1) != 7 ||
                            g.hparams.scalar_type() != at::kDouble))
      damaged = std::string("the ") + kMetaKey + " (the group lists do not fit together)";
    if (damaged.empty()) {
      const at::Tensor steps_col = g.hparams.select(1, 6);  // ns_steps, whole numbers a cast can take
      if (!(steps_col.eq(steps_col.floor()) & steps_col.abs().le(double{1 << 30})).all().item<bool>())
        damaged = std::string("the ") + kMetaKey + " (an ns_steps that is not a whole number)";
    }
    if (damaged.empty()) {
      const at::Tensor h = g.hparams.contiguous();
      const double* r = h.data_ptr<double>();
      for (size_t i = 0; i < n; ++i, r += 7)
        o.param_groups.push_back({g.names[i], g.is_muon[i], r[0], r[1], r[2], r[3], r[4], r[5], g.nesterov[i],
                                  static_cast<int64_t>(r[6])});
      o.steps_taken = g.steps_taken;
    }
    ck.optim = std::move(o);
  } else if (ar.try_read("optim_muon", v) && damaged.empty()) {
    damaged = "the checksum table (it has no entry for the optimizer state the file holds)";
  }
  for (const auto& [id, s] : sums)
    if (damaged.empty() && !seen.count(id))
      damaged = "the checksum table: its entry '" + id + "' belongs to no tensor in the file (a damaged key?)";
  return damaged;
}

}  // namespace

uint32_t checkpoint_crc32c(const void* data, size_t n, uint32_t crc) {
  static const Crc32cTables tables;
  const auto& t = tables.t;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  // single bytes (the unaligned head and the tail) always by the table, so that tests comparing
  // byte-by-byte with bulk CRCs check the fast path against it
  for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0; --n) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
#if defined(__x86_64__) && defined(__GNUC__)
  if (have_sse42()) {
    c = crc32c_words_sse42(c, p, n / 8);
    p += n / 8 * 8;
    n %= 8;
  }
#endif
  for (; n >= 8; n -= 8, p += 8) {
    const uint32_t lo = get_u32(p) ^ c, hi = get_u32(p + 4);
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^ t[3][hi & 0xFF] ^
        t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return ~c;
}

void save_checkpoint(const std::string& path, const TensorDict& model, const OptimizerStateDict* optim,
                     const std::map<std::string, std::string>& metadata) {
  io::save_checkpoint_safetensors(path, model, optim, metadata);
}

bool is_dmuon_checkpoint(const std::string& path) {
  if (!std::filesystem::is_regular_file(path)) return false;
  if (io::looks_like_safetensors(path)) {
    try {
      const SafetensorsFile f(path);
      auto fmt = f.metadata().find("format");
      return fmt != f.metadata().end() && fmt->second.rfind("dmuon-checkpoint", 0) == 0;
    } catch (const std::exception&) {
      return false;
    }
  }
  io::Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  unsigned char h[sizeof(kMagic)] = {};
  return f.fd >= 0 && io::read_at(f.fd, h, sizeof(h), 0) == sizeof(h) && std::memcmp(h, kMagic, sizeof(h)) == 0;
}

Checkpoint load_checkpoint(const std::string& path) { return load_checkpoint(path, /*include_model=*/true); }

std::shared_ptr<ParamSource> checkpoint_model_source(const std::string& path, bool allow_unverified) {
  TORCH_CHECK(std::filesystem::is_regular_file(path), "checkpoint_model_source: '", path,
              "' does not exist or is not a file.");
  if (io::looks_like_safetensors(path)) return io::checkpoint_safetensors_model_source(path, allow_unverified);
  return tensor_dict_source(load_checkpoint(path).model, "checkpoint '" + path + "'");
}

Checkpoint load_checkpoint(const std::string& path, bool include_model, bool allow_unverified) {
  TORCH_CHECK(std::filesystem::is_regular_file(path), "load_checkpoint: '", path, "' does not exist or is not a file.");
  io::Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(f.fd >= 0, "load_checkpoint: cannot open '", path, "': ", std::strerror(errno));
  struct stat sb {};
  TORCH_CHECK(::fstat(f.fd, &sb) == 0, "load_checkpoint: cannot stat '", path, "': ", std::strerror(errno));
  const auto size = static_cast<uint64_t>(sb.st_size);
  const char* what_fix = " Pass a file written by dmuon::save_checkpoint.";
  if (size > 0 && io::looks_like_safetensors(path)) return io::load_checkpoint_safetensors(path, include_model, allow_unverified);
  TORCH_CHECK(size > 0, "load_checkpoint: '", path, "' is not a readable checkpoint: it is empty (0 bytes; was "
              "it created but never written?).", what_fix);
  unsigned char h[kHeaderSize] = {};
  const size_t got = io::read_at(f.fd, h, kHeaderSize, 0);
  if (got >= 4 && std::memcmp(h, "PK\x03\x04", 4) == 0) refuse_zip(path);
  // a safetensors file whose header length is out of bounds (damaged): the safetensors reader says so
  const std::string ext = ".safetensors";
  if ((got > 8 && h[8] == '{') ||
      (path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0))
    return io::load_checkpoint_safetensors(path, include_model, allow_unverified);
  TORCH_CHECK(got >= sizeof(kMagic) && std::memcmp(h, kMagic, sizeof(kMagic)) == 0, "load_checkpoint: '", path,
              "' is not a readable checkpoint: it does not begin with the dmuon checkpoint header (a text file, "
              "another format, or a checkpoint whose first bytes are damaged?).", what_fix);
  TORCH_CHECK(got == kHeaderSize, "load_checkpoint: '", path, "' is truncated: ", size, " bytes, shorter than its ",
              kHeaderSize, "-byte header (an interrupted copy or a full disk?). Resume from another checkpoint.");
  TORCH_CHECK(get_u32(h + 28) == checkpoint_crc32c(h, 28), "load_checkpoint: '", path,
              "' is corrupt: its header (the first ", kHeaderSize, " bytes) does not match its checksum.", kCorruptFix);
  const uint32_t version = get_u32(h + 8);
  TORCH_CHECK(version == kVersion, "load_checkpoint: '", path, "' has checkpoint format version ", version,
              "; this dmuon reads version ", kVersion, ". Load it with the dmuon that wrote it.");
  const uint64_t len = get_u64(h + 16);
  TORCH_CHECK(size >= kHeaderSize + len, "load_checkpoint: '", path, "' is truncated: ", size, " of its ",
              kHeaderSize + len, " bytes are there (an interrupted copy or a full disk?). Resume from another "
              "checkpoint.");
  TORCH_CHECK(size == kHeaderSize + len, "load_checkpoint: '", path, "' is corrupt: ", size - kHeaderSize - len,
              " bytes follow the ", kHeaderSize + len, " bytes its header announces.", kCorruptFix);
  // the whole archive first: any changed byte shows here
  uint32_t crc = 0;
  {
    std::vector<char> buf(size_t{8} << 20);
    for (uint64_t pos = 0; pos < len;) {
      const size_t n = io::read_at(f.fd, buf.data(), static_cast<size_t>(std::min<uint64_t>(buf.size(), len - pos)),
                               kHeaderSize + pos);
      TORCH_CHECK(n > 0, "load_checkpoint: reading '", path, "' failed at byte ", kHeaderSize + pos, ": ",
                  std::strerror(errno));
      crc = checkpoint_crc32c(buf.data(), n, crc);
      pos += n;
    }
  }
  const bool archive_ok = crc == get_u32(h + 24);
  // then the sections, each against its own checksum, to name the damaged one
  Checkpoint ck;
  std::string damaged;
  try {
    torch::serialize::InputArchive ar;
    ar.load_from(
        [&](uint64_t pos, void* buf, size_t n) -> size_t {
          if (pos >= len) return 0;
          return io::read_at(f.fd, buf, static_cast<size_t>(std::min<uint64_t>(n, len - pos)), kHeaderSize + pos);
        },
        [&]() -> size_t { return static_cast<size_t>(len); });
    damaged = read_sections(ar, ck);
  } catch (const std::exception& e) {
    std::string why = detail::error_text(e);
    why = why.substr(0, why.find('\n'));
    for (char& c : why)  // the damaged bytes torch quotes
      if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7E) c = '?';
    TORCH_CHECK(!archive_ok, "load_checkpoint: '", path, "' is not a readable checkpoint: ", why);
    damaged = "the archive's structure (it cannot be parsed: " + why + ")";
  }
  if (damaged.empty() && !archive_ok)
    damaged = "the archive's structure (zip headers or padding; every tensor and the optimizer metadata match "
              "their checksums)";
  TORCH_CHECK(damaged.empty(), "load_checkpoint: '", path, "' is corrupt; the damage is in ", damaged,
              archive_ok ? std::string(".") : " [whole archive: stored checksum " + hex(get_u32(h + 24)) + ", read " +
                                                  hex(crc) + "].",
              kCorruptFix);
  if (!include_model) ck.model.clear();  // the archive has no random access: it was read and verified whole
  if (ck.optim) check_optimizer_state_dict(*ck.optim, "load_checkpoint: '" + path + "'");
  return ck;
}

}  // namespace dmuon
