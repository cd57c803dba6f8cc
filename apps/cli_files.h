// cli_files.h -- the CLI's checks of the files a user names, shared by plan and train (LibTorch-free).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

namespace dmuon::cli {

// Why `path` cannot be read as an input file ("" when it can): it does not exist, is a directory,
// or is not a regular file (a pipe, socket or device: reading one could hang, or leave nothing for
// the next reader). The caller prefixes the flag: "--data DIR: is a directory; pass a file".
inline std::string input_file_problem(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) return "no such file";
  if (fs::is_directory(st)) return "is a directory; pass a file";
  if (!fs::is_regular_file(st))
    return "is not a regular file (a pipe, socket or device); write its contents to a file and pass that";
  return "";
}

// Why `path` cannot be written as an output file ("" when it can): it is a directory or another
// non-regular file, or its directory does not exist or is not writable.
inline std::string output_file_problem(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return "is a directory; name a file in it";
  if (fs::exists(path, ec) && !fs::is_regular_file(path, ec)) return "exists and is not a regular file";
  const fs::path dir = fs::path(path).has_parent_path() ? fs::path(path).parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) return "the directory " + dir.string() + " does not exist; create it first";
  if (::access(dir.c_str(), W_OK) != 0) return "the directory " + dir.string() + " is not writable";
  return "";
}

// Writes `content` to `path` so a reader sees the old file or the whole new one, never a part: a new temporary
// beside it (O_EXCL | O_NOFOLLOW: never through a link put at its name), fsync, rename over `path`, fsync of the
// directory. Throws std::runtime_error naming `flag` and the path; nothing is replaced then. (dmuon's io layer
// has the same for LibTorch programs: dmuon/files.h; this one serves the LibTorch-free `dmuon plan`.)
inline void write_output_atomically(const std::string& flag, const std::string& path, const std::string& content) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const fs::path tmp = dir / ("." + target.filename().string() + ".tmp-" + std::to_string(::getpid()));
  auto fail = [&](const std::string& what) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw std::runtime_error(flag + ": writing '" + path + "' failed: " + what + ": " + why + " (nothing was replaced).");
  };
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  int fd = ::open(tmp.c_str(), flags, 0644);
  if (fd < 0 && errno == EEXIST && ::unlink(tmp.c_str()) == 0) fd = ::open(tmp.c_str(), flags, 0644);
  if (fd < 0) fail("cannot create " + tmp.string());
  for (size_t done = 0; done < content.size();) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      fail("write");
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail("fsync (is the disk full?)");
  }
  ::close(fd);
  if (::rename(tmp.c_str(), target.c_str()) != 0) fail("rename");
  if (const int d = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); d >= 0) {
    ::fsync(d);
    ::close(d);
  }
}

}  // namespace dmuon::cli
