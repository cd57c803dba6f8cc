// ns_profile.cpp -- measured Newton-Schulz costs per shape (ns_profile.h).
#include "dmuon/ns_profile.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "dmuon/digest.h"
#include "env/json_text.h"

namespace dmuon {
namespace {
using json = nlohmann::json;

// Multiply-adds of one NS step sequence on an s x b matrix (s <= b), the planner's FLOP measure.
double ns_work(int64_t rows, int64_t cols, int steps) {
  const double s = static_cast<double>(std::min(rows, cols)), b = static_cast<double>(std::max(rows, cols));
  return steps * s * (3.0 * s * b);
}

bool same_shape(const NsTiming& t, int64_t rows, int64_t cols) {
  return std::min(t.rows, t.cols) == std::min(rows, cols) && std::max(t.rows, t.cols) == std::max(rows, cols);
}

NsCost from_timing(const NsTiming& t) {
  NsCost c;
  c.measured = true;
  if (t.batch >= 2) {
    c.per_matrix_us = std::max(0.0, (t.batch_us - t.single_us) / (t.batch - 1));
    c.fixed_us = std::max(0.0, t.single_us - c.per_matrix_us);
  } else {
    c.per_matrix_us = t.single_us;
  }
  return c;
}

}  // namespace

NsCost NsProfile::cost_of(int64_t rows, int64_t cols, int64_t elem_bytes) const {
  if (timings.empty())
    throw std::invalid_argument("NS profile" + (source.empty() ? std::string() : " '" + source + "'") +
                                " has no timings: run `dmuon plan --calibrate FILE` on the target device");
  const NsTiming* any = nullptr;
  for (const NsTiming& t : timings) {
    if (!same_shape(t, rows, cols)) continue;
    if (t.elem_bytes == elem_bytes) return from_timing(t);
    if (!any) any = &t;
  }
  if (any) return from_timing(*any);
  // not measured: least squares single_us = a + c * work over the measured shapes of this element
  // size (all shapes when fewer than two have it), a, c >= 0
  std::vector<const NsTiming*> pts;
  for (const NsTiming& t : timings)
    if (t.elem_bytes == elem_bytes) pts.push_back(&t);
  if (pts.size() < 2) {
    pts.clear();
    for (const NsTiming& t : timings) pts.push_back(&t);
  }
  const double x = ns_work(rows, cols, ns_steps);
  NsCost c;
  if (pts.size() == 1) {
    c.per_matrix_us = pts[0]->single_us * x / ns_work(pts[0]->rows, pts[0]->cols, ns_steps);
    return c;
  }
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const NsTiming* t : pts) {
    const double xi = ns_work(t->rows, t->cols, ns_steps), yi = t->single_us;
    sx += xi, sy += yi, sxx += xi * xi, sxy += xi * yi;
  }
  const double n = static_cast<double>(pts.size()), den = n * sxx - sx * sx;
  double slope = den > 0 ? (n * sxy - sx * sy) / den : 0.0;
  double icept = (sy - slope * sx) / n;
  if (slope < 0) slope = 0, icept = sy / n;
  if (icept < 0) icept = 0, slope = sxx > 0 ? sxy / sxx : 0.0;
  c.per_matrix_us = icept + slope * x;
  return c;
}

uint64_t NsProfile::digest() const {
  Fnv1a h;
  h.i64(ns_steps).i64(static_cast<int64_t>(timings.size()));
  for (const NsTiming& t : timings) {
    h.i64(t.rows).i64(t.cols).i64(t.elem_bytes).i64(t.batch);
    h.f64(t.single_us).f64(t.batch_us);
  }
  return h.value();
}

void validate_ns_profile(const NsProfile& p, const std::string& source) {
  if (p.ns_steps < 1) throw std::invalid_argument(source + ": \"ns_steps\" must be >= 1, got " + std::to_string(p.ns_steps));
  if (p.timings.empty())
    throw std::invalid_argument(source + ": the NS profile has no timings (`dmuon plan --calibrate FILE` measures them)");
  for (size_t i = 0; i < p.timings.size(); ++i) {
    const NsTiming& t = p.timings[i];
    const std::string where = source + ": timings[" + std::to_string(i) + "]";
    if (t.rows < 1 || t.cols < 1 || t.elem_bytes < 1 || t.batch < 1)
      throw std::invalid_argument(where + ": rows, cols, elem_bytes and batch must be >= 1");
    if (!(t.single_us > 0) || !std::isfinite(t.single_us) || (t.batch >= 2 && !(t.batch_us > 0)) ||
        !std::isfinite(t.batch_us))
      throw std::invalid_argument(where + ": single_us (and batch_us when batch >= 2) must be finite and > 0");
  }
}

NsProfile ns_profile_from_json(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(source + ": NS profile is not JSON: " + e.what());
  }
  if (j.is_object() && j.contains("ns_profile")) j = j["ns_profile"];  // inside a hardware description
  if (!j.is_object() || !j.contains("timings") || !j["timings"].is_array())
    throw std::invalid_argument(source + ": an NS profile is a JSON object with a \"timings\" array "
                                "(`dmuon plan --calibrate FILE` writes one)");
  // a field of the wrong type, or a count that is not a whole number in range, names the file and the field
  auto string_field = [&](const char* k, const std::string& fallback) {
    if (!j.contains(k)) return fallback;
    if (!j[k].is_string())
      throw std::invalid_argument(source + ": the NS profile's \"" + k + "\" must be a string, got " +
                                  detail::json_brief(j[k]));
    return j[k].get<std::string>();
  };
  auto whole = [](const json& v, const std::string& where, const char* k, double max) {
    if (!v.is_number() || v.get<double>() != std::floor(v.get<double>()) || v.get<double>() < 1 || v.get<double>() > max)
      throw std::invalid_argument(where + ": \"" + k + "\" must be a whole number from 1 to " +
                                  std::to_string(static_cast<int64_t>(max)) + ", got " + detail::json_brief(v));
    return static_cast<int64_t>(v.get<double>());
  };
  NsProfile p;
  p.device = string_field("device", "cpu");
  p.source = string_field("source", "file " + source);
  p.ns_steps = j.contains("ns_steps") ? static_cast<int>(whole(j["ns_steps"], source, "ns_steps", 1000)) : 5;
  for (size_t i = 0; i < j["timings"].size(); ++i) {
    const json& e = j["timings"][i];
    const std::string where = source + ": timings[" + std::to_string(i) + "]";
    auto num = [&](const char* k) {
      if (!e.is_object() || !e.contains(k) || !e[k].is_number())
        throw std::invalid_argument(where + " needs a number \"" + k + "\"");
      return e[k].get<double>();
    };
    auto count = [&](const char* k, double max) {
      num(k);
      return whole(e[k], where, k, max);
    };
    NsTiming t;
    t.rows = count("rows", 1e9);
    t.cols = count("cols", 1e9);
    t.elem_bytes = e.contains("elem_bytes") ? count("elem_bytes", 64) : 4;
    t.single_us = num("single_us");
    t.batch = e.contains("batch") ? static_cast<int>(count("batch", 1e6)) : 1;
    t.batch_us = t.batch >= 2 ? num("batch_us") : 0.0;
    p.timings.push_back(t);
  }
  if (p.timings.empty()) throw std::invalid_argument(source + ": the NS profile's \"timings\" array is empty");
  validate_ns_profile(p, source);
  return p;
}

std::string ns_profile_to_json(const NsProfile& p) {
  json j;
  j["device"] = p.device;
  j["source"] = p.source;
  j["ns_steps"] = p.ns_steps;
  j["timings"] = json::array();
  for (const NsTiming& t : p.timings)
    j["timings"].push_back({{"rows", t.rows}, {"cols", t.cols}, {"elem_bytes", t.elem_bytes}, {"batch", t.batch},
                            {"single_us", t.single_us}, {"batch_us", t.batch_us}});
  return j.dump(2) + "\n";
}

NsProfile load_ns_profile(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw std::invalid_argument("cannot read the NS profile '" + path +
                                "': no such file (write one with `dmuon plan --calibrate " + path + "`)");
  std::stringstream ss;
  ss << in.rdbuf();
  return ns_profile_from_json(ss.str(), path);
}

}  // namespace dmuon
