// The batched Newton-Schulz runner (see include/dmuon/ns_runner.h).
#include "dmuon/ns_runner.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>

#include "dmuon/env.h"

namespace dmuon {

bool ns_stacking_pays(c10::DeviceType device, int64_t small_side) {
  return env::batched_ns().value_or(true) && (device == c10::DeviceType::CUDA || small_side <= kCpuStackMaxSide);
}

int64_t ns_batch_cap_bytes() {
  const std::string v = env::ns_batch_mb();
  if (v.empty()) return int64_t{256} << 20;
  const std::optional<int64_t> mb = env::parse_count(v, int64_t{1} << 20);
  TORCH_CHECK(mb, "DMUON_NS_BATCH_MB='", v,
              "' is not a number of MiB from 1 to 1048576: set it to the largest stacked Newton-Schulz call in MiB "
              "(e.g. 256, the default), or unset it.");
  return *mb << 20;
}

void run_ns_batched(std::vector<NsJob>& jobs, const NsFn& ns, const NsBatchOptions& options,
                    const std::function<void(size_t, double)>& timed) {
  if (jobs.empty()) return;
  struct Key {
    int64_t m, n;
    at::ScalarType dtype;
    c10::DeviceType type;
    int index;
    int steps;
    bool operator<(const Key& o) const {
      return std::tie(m, n, dtype, type, index, steps) < std::tie(o.m, o.n, o.dtype, o.type, o.index, o.steps);
    }
  };
  std::map<Key, std::vector<size_t>> groups;  // in first-seen order within each key
  std::vector<Key> order;
  int64_t all_bytes = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const at::Tensor& u = jobs[i].like;
    TORCH_CHECK(u.dim() == 2, "Newton-Schulz job ", i, " has shape ", u.sizes(), "; expected a matrix");
    const Key k{std::min(u.size(0), u.size(1)), std::max(u.size(0), u.size(1)), u.scalar_type(), u.device().type(),
                u.device().index(), jobs[i].steps};
    auto [it, fresh] = groups.try_emplace(k);
    if (fresh) order.push_back(k);
    it->second.push_back(i);
    all_bytes += u.numel() * static_cast<int64_t>(u.element_size());
  }
  int64_t cap = options.cap_bytes >= 0 ? options.cap_bytes : ns_batch_cap_bytes();
  if (options.cap_to_quarter) cap = std::min(cap, all_bytes / 4);
  auto input_of = [&](size_t i, const at::Tensor& out) {
    return jobs[i].input ? jobs[i].input(out) : out.defined() ? out.copy_(jobs[i].like) : jobs[i].like;
  };
  // each batch's results are applied (and its inputs freed) as soon as they are computed
  auto apply = [&](size_t i, const at::Tensor& result) {
    jobs[i].apply(result);
    jobs[i].input = nullptr;  // drops what the input was made from (e.g. a converted gradient)
    jobs[i].apply = nullptr;
    jobs[i].like = at::Tensor();
  };
  auto wide = [](const at::Tensor& t) { return t.size(0) > t.size(1); };  // stored tall: runs transposed
  for (const Key& k : order) {
    const std::vector<size_t>& idx = groups.at(k);
    const int64_t per = k.m * k.n * static_cast<int64_t>(c10::elementSize(k.dtype));
    const size_t chunk = ns_stacking_pays(k.type, k.m)
                             ? static_cast<size_t>(std::max<int64_t>(1, cap / std::max<int64_t>(per, 1)))
                             : 1;
    for (size_t b = 0; b < idx.size(); b += chunk) {
      const size_t e = std::min(idx.size(), b + chunk);
      const auto tb = std::chrono::steady_clock::now();
      if (e - b == 1) {
        apply(idx[b], ns(input_of(idx[b], at::Tensor()), k.steps));
      } else {
        at::Tensor in = at::empty({static_cast<int64_t>(e - b), k.m, k.n}, jobs[idx[b]].like.options());
        std::vector<bool> tall(e - b);
        for (size_t i = b; i < e; ++i) {
          tall[i - b] = wide(jobs[idx[i]].like);
          const at::Tensor slot = in.select(0, static_cast<int64_t>(i - b));
          input_of(idx[i], tall[i - b] ? slot.t() : slot);  // computed in place
        }
        const at::Tensor out = ns(in, k.steps);
        in = at::Tensor();
        for (size_t i = b; i < e; ++i) {
          const at::Tensor r = out.select(0, static_cast<int64_t>(i - b));
          apply(idx[i], tall[i - b] ? r.t() : r);
        }
      }
      if (options.after_batch) options.after_batch();
      if (timed) {
        const double share = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - tb).count() /
                             static_cast<double>(e - b);
        for (size_t i = b; i < e; ++i) timed(idx[i], share);
      }
    }
  }
}

std::vector<at::Tensor> newton_schulz_many(const NewtonSchulz& ns, const std::vector<at::Tensor>& inputs, int steps) {
  std::vector<at::Tensor> out(inputs.size());
  std::vector<NsJob> jobs(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].dim() == 2, "newton_schulz_many: input ", i, " has shape ", inputs[i].sizes(),
                "; expected a matrix");
    jobs[i].like = inputs[i];
    jobs[i].steps = steps;
    jobs[i].apply = [&out, i](const at::Tensor& r) { out[i] = r; };
  }
  NsBatchOptions o;
  o.cap_to_quarter = false;
  run_ns_batched(jobs, [&ns](const at::Tensor& g, int s) { return ns.local(g, s); }, o);
  return out;
}

}  // namespace dmuon
