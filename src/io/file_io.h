// file_io.h -- the io layer's file primitives: positioned reads and writes that retry, and the one
// atomic-replace sequence every dmuon file goes through (a temporary name in the same directory,
// written, fsync'ed, renamed over the target, the directory fsync'ed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "env/atomic_write.h"

namespace dmuon::io {

// A descriptor closed when it goes out of scope.
using detail::Fd;

// Little-endian integers as the file formats store them.
inline uint64_t load_le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = v << 8 | p[i];
  return v;
}
// The largest safetensors header read (the Python library's own limit, 100 MB).
inline constexpr uint64_t kMaxSafetensorsHeader = uint64_t{100} << 20;
// Whether the file's first bytes are a safetensors header (an 8-byte length within the limit, then '{').
bool looks_like_safetensors(const std::string& path);

// 0, or the errno of the failed write.
using detail::write_all;
// The bytes read (fewer than n only at the end of the file or on an error).
size_t read_at(int fd, void* data, size_t n, uint64_t offset);

// Writes `path` atomically (detail::write_atomically: a temporary beside it, filled by `body(fd)`,
// which throws std::exception with the reason on failure; fsync'ed and renamed over `path`). On any
// failure nothing is replaced and a c10::Error names `who`, the path and the reason.
void write_atomically(const std::string& path, const std::string& who, const std::function<void(int fd)>& body);

}  // namespace dmuon::io
