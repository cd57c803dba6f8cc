// The io layer's file primitives (see file_io.h).
#include "file_io.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <cerrno>
#include <exception>

namespace dmuon::io {

size_t read_at(int fd, void* data, size_t n, uint64_t offset) {
  char* p = static_cast<char*>(data);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    done += static_cast<size_t>(r);
  }
  return done;
}

void write_atomically(const std::string& path, const std::string& who, const std::function<void(int fd)>& body) {
  try {
    detail::write_atomically(path, body);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, who, ": writing '", path, "' failed: ", e.what(), " (nothing was replaced).");
  }
}

}  // namespace dmuon::io
