// Internal: a JSON value read from a file, quoted in an error message. A hostile or damaged file may nest
// values deeper than nlohmann's recursive dump() can go (its parser and destructor are iterative, dump() is
// not: a 100k-deep array parses, then overflows the stack when printed); this prints two levels and about
// 80 characters.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace dmuon::detail {

inline std::string json_brief(const nlohmann::json& j, int depth = 0) {
  constexpr size_t kMax = 80;
  if (!j.is_structured()) {
    std::string s = j.dump();
    return s.size() > kMax ? s.substr(0, kMax - 3) + "..." : s;
  }
  const bool array = j.is_array();
  if (depth >= 2) return array ? "[...]" : "{...}";
  std::string out = array ? "[" : "{";
  size_t k = 0;
  for (auto it = j.begin(); it != j.end(); ++it, ++k) {
    if (out.size() > kMax) {
      out += ",...";
      break;
    }
    if (k) out += ",";
    if (!array) out += nlohmann::json(it.key()).dump() + ":";
    out += json_brief(*it, depth + 1);
  }
  return out + (array ? "]" : "}");
}

}  // namespace dmuon::detail
