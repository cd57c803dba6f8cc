// env_guard.h -- test support: an environment variable set (or unset) for a scope.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

namespace dmuon::testing {

// Sets (or unsets, with nullopt) an environment variable for the lifetime of the guard; restores the
// previous value. Use in the main thread only, before starting rank threads (ranks are threads of one
// process: they share the environment).
class EnvGuard {
 public:
  EnvGuard(std::string name, const std::optional<std::string>& value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) old_ = std::string(old);
    set(value);
  }
  ~EnvGuard() { set(old_); }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;
  void set(const std::optional<std::string>& value) {
    if (value) ::setenv(name_.c_str(), value->c_str(), 1);
    else ::unsetenv(name_.c_str());
  }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

}  // namespace dmuon::testing
