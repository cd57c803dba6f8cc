// digest.h -- FNV-1a (64-bit), the one hash behind every digest dmuon compares across ranks or keeps:
// plan fingerprints, the agreements before a state dict loads and on Muon's options, precision and NS
// profile digests, and the per-parameter seeds of deferred init.
//
// Integers are hashed as their little-endian bytes and a double as its bits, so a digest is the same on
// every machine and build (std::hash is not: never use it for anything two ranks compare).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace dmuon {

class Fnv1a {
 public:
  static constexpr uint64_t kOffset = 0xcbf29ce484222325ull;  // 14695981039346656037
  static constexpr uint64_t kPrime = 0x100000001b3ull;          // 1099511628211

  Fnv1a() = default;
  explicit Fnv1a(uint64_t start) : h_(start) {}  // continues a digest

  Fnv1a& bytes(const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h_ = (h_ ^ c[i]) * kPrime;
    return *this;
  }
  Fnv1a& u64(uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    return bytes(b, 8);
  }
  Fnv1a& i64(int64_t v) { return u64(static_cast<uint64_t>(v)); }
  Fnv1a& f64(double v) {
    uint64_t u;
    std::memcpy(&u, &v, sizeof u);
    return u64(u);
  }
  Fnv1a& chars(std::string_view s) { return bytes(s.data(), s.size()); }  // the characters only
  Fnv1a& str(std::string_view s) { return u64(s.size()).chars(s); }       // length first: "ab","c" != "a","bc"
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = kOffset;
};

// The digest of a string's characters.
inline uint64_t fnv1a(std::string_view s) { return Fnv1a().chars(s).value(); }

}  // namespace dmuon
