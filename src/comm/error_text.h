// error_text.h -- how dmuon quotes a caught exception inside its own errors: its message (a c10::Error without
// its C++ backtrace, which its what() carries; anything else as what() says), its kind, and a list of ranks.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

namespace dmuon::detail {

inline std::string error_text(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

// A caller mistake (Python: ValueError, TypeError) rather than a failure of the system (RuntimeError): what dmuon re-raises
// on a caller's behalf keeps this kind.
inline bool is_caller_mistake(const std::exception& e) {
  return dynamic_cast<const c10::ValueError*>(&e) != nullptr || dynamic_cast<const c10::TypeError*>(&e) != nullptr ||
         dynamic_cast<const std::invalid_argument*>(&e) != nullptr;
}

// "1, 3": ranks for messages.
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

}  // namespace dmuon::detail
