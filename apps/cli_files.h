// cli_files.h -- the CLI's checks of the files a user names, shared by plan and train (LibTorch-free).
#pragma once

#include <unistd.h>

#include <filesystem>
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

}  // namespace dmuon::cli
