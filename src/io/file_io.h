// file_io.h -- the io layer's file primitives: positioned reads and writes that retry, and the one
// atomic-replace sequence every dmuon file goes through (a temporary name in the same directory,
// written, fsync'ed, renamed over the target, the directory fsync'ed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace dmuon::io {

struct Fd {
  int fd = -1;
  Fd() = default;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  ~Fd();
};

// 0, or the errno of the failed write.
int write_all(int fd, const void* data, size_t n, uint64_t offset);
// The bytes read (fewer than n only at the end of the file or on an error).
size_t read_at(int fd, void* data, size_t n, uint64_t offset);

// Writes `path` atomically: `body(fd)` fills a temporary file beside it (throwing std::exception
// with the reason on failure), which is flushed to disk and renamed over `path`. On any failure the
// temporary file is removed, nothing is replaced, and the error names `who`, the path and the reason.
void write_atomically(const std::string& path, const std::string& who, const std::function<void(int fd)>& body);

}  // namespace dmuon::io
