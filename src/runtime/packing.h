// Internal: how a route splits many tensors into few collectives (checkpoint gathers).
#pragma once

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

namespace dmuon::detail {

// A full state dict's packed collective holds at most this many bytes (a larger tensor goes alone): what a
// checkpoint holds beside the values it gathered.
inline constexpr int64_t kCheckpointPackBytes = int64_t{64} << 20;

// Calls `pack(indices)` for consecutive runs of `items` that share a dtype and hold at most `cap` bytes
// together (a larger item alone), dtypes in order of first appearance: the same packs on every rank that
// passes the same list.
inline void for_each_pack(const std::vector<size_t>& items, const std::function<at::ScalarType(size_t)>& dtype,
                          const std::function<int64_t(size_t)>& bytes, int64_t cap,
                          const std::function<void(const std::vector<size_t>&)>& pack) {
  std::vector<at::ScalarType> dtypes;
  for (size_t i : items)
    if (std::find(dtypes.begin(), dtypes.end(), dtype(i)) == dtypes.end()) dtypes.push_back(dtype(i));
  std::vector<size_t> run;
  for (at::ScalarType dt : dtypes) {
    int64_t held = 0;
    for (size_t i : items) {
      if (dtype(i) != dt) continue;
      const int64_t b = bytes(i);
      if (!run.empty() && held + b > cap) {
        pack(run);
        run.clear();
        held = 0;
      }
      run.push_back(i);
      held += b;
    }
    if (!run.empty()) pack(run);
    run.clear();
  }
}

}  // namespace dmuon::detail
