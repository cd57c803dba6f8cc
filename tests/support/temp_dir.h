// temp_dir.h -- test directories that do not outlive the test process.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace dmuon::testing {

namespace detail {
// Every directory fresh_temp_dir made, removed with its contents when the process that made them
// exits normally (a failed expectation included); a forked child's exit leaves them to the parent.
struct TempDirs {
  std::mutex mu;
  std::vector<std::string> dirs;
  const pid_t owner = ::getpid();
  ~TempDirs() {
    if (::getpid() != owner) return;
    std::error_code ignored;
    for (const auto& d : dirs) std::filesystem::remove_all(d, ignored);
  }
};
inline TempDirs& temp_dirs() {
  static TempDirs t;
  return t;
}
}  // namespace detail

// A fresh, empty directory under $TMPDIR (unique per call), gone when the test process exits.
inline std::string fresh_temp_dir(const std::string& prefix = "dmuon-test") {
  std::string path = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  if (!::mkdtemp(path.data())) throw std::runtime_error("mkdtemp failed for " + path);
  auto& t = detail::temp_dirs();
  std::lock_guard<std::mutex> g(t.mu);
  t.dirs.push_back(path);
  return path;
}

}  // namespace dmuon::testing
