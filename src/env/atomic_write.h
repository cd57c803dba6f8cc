// atomic_write.h -- (internal) the LibTorch-free core of dmuon's atomic file writes: the io layer's
// checkpoints and safetensors, dmuon/files.h, and `dmuon plan --calibrate` all go through it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace dmuon::detail {

// A file descriptor closed when it goes out of scope (movable, not copyable).
struct Fd {
  int fd = -1;
  Fd() = default;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  ~Fd();
};

// 0, or the errno of the failed write: `n` bytes of `data` at `offset` of `fd`, retried until written.
int write_all(int fd, const void* data, size_t n, uint64_t offset);

// Writes `path` so a reader sees the old file or the whole new one, never a part: `body(fd)` fills a new
// temporary beside it (".NAME.tmp-PID", created O_EXCL | O_NOFOLLOW: never through a link someone put at
// its name), which is fsync'ed, renamed over `path`, and the directory fsync'ed. Temporaries of earlier
// writes of `path` whose process died mid-write are removed first; SIGINT/SIGTERM during the write remove
// the temporary before the signal takes its course. On any failure (body throws std::exception with the
// reason, or a system call fails) the temporary is removed, nothing is replaced, and the exception
// (a std::exception giving the reason alone; the caller names what it was writing) propagates.
void write_atomically(const std::string& path, const std::function<void(int fd)>& body);

}  // namespace dmuon::detail
