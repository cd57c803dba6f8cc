// error_text.h -- the message of a caught exception as dmuon quotes it inside its own errors: a c10::Error
// without its C++ backtrace (its what() carries one), anything else as what() says.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace dmuon::detail {

inline std::string error_text(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

}  // namespace dmuon::detail
