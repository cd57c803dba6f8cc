// Internal: a parameter's resolved mixed-precision policy.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

#include "dmuon/digest.h"

namespace dmuon {

// ParamPolicy's dtype fields with the defaults applied (see dmuon/dedicate.h).
struct Precision {
  at::ScalarType param = at::kFloat;   // dtype of the module parameter in forward/backward
  at::ScalarType reduce = at::kFloat;  // gradient reduce payload
  at::ScalarType master = at::kFloat;  // what the optimizer updates and gradients are averaged in
  at::ScalarType optim = at::kFloat;   // optimizer state
  bool has_master() const { return master != param; }
  bool operator==(const Precision&) const = default;
  bool operator<(const Precision& o) const {
    return std::tie(param, reduce, master, optim) < std::tie(o.param, o.reduce, o.master, o.optim);
  }
  // the parameter's own dtype everywhere (no policy)
  static Precision plain(at::ScalarType t) { return Precision{t, t, t, t}; }
};

// Digest of a precision (part of the cross-rank plan fingerprint).
inline uint64_t precision_digest(const Precision& pr) {
  Fnv1a h;
  for (at::ScalarType t : {pr.param, pr.reduce, pr.master, pr.optim}) h.i64(static_cast<int64_t>(t));
  return h.value();
}

}  // namespace dmuon
